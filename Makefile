# Every target runs offline: nothing here may reach the Hugging Face Hub.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup system-deps test demo record quotes lint bench soak rehearse bench-memory bench-startup threads-ab gpu-check clean

setup: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml setup.py src/vitcli/data/decoding/_jpeg_region.c
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# the official DINOv2 (its losses, head, masking, schedules, param groups) for the DINO parity tests
	# (tests/unit/test_dino_reference.py). --no-deps: its pins (torch 2.0) would replace torch 2.14.1, and
	# the modules the tests import need only torch and numpy.
	$(PY) -m pip install -q --no-deps dinov2==0.0.1.dev2
	touch $(VENV_STAMP)

# The lint first: ruff enforces the line length and import order (pyproject.toml), in seconds.
# One pytest-xdist worker per core, at most 4 (each imports torch; tests/conftest.py gives each its share of
# the cores' threads); each test goes to whichever worker is free. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 4 ] && n=4; echo $$n)
test: lint system-deps
	$(PY) -m pytest -rs $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

demo: setup
	bash scripts/quickstart.sh

# What the docs quote from the quickstart, measured again: make demo's stages, the two baselines the docs set
# against them and `vit evaluate` of the fine-tune, into a fresh runs/record, kept in
# docs/measured/quickstart.json (date, machine, source); then every quote rewritten from it. make demo's
# time, a fine-tune's and two few-shot tables'.
record: setup
	rm -rf runs/record
	RUNS=runs/record bash scripts/quickstart.sh --record
	$(PY) scripts/record_quickstart.py runs/record
	$(PY) scripts/quotes.py --write

# Rewrite every marked figure (<!-- quote: KEY -->) from its record in docs/measured/; tests/integration/
# test_quotes.py fails when one differs. `python scripts/quotes.py` alone lists them.
quotes: setup
	$(PY) scripts/quotes.py --write

# SLURM and munge for tests/integration/test_slurm.py's one-node cluster, installed where this is root with
# apt-get (CI); elsewhere those tests skip and say why (-rs lists every skip's reason)
system-deps:
	bash scripts/system_deps.sh

lint: setup
	.venv/bin/ruff check src tests bench scripts

# One JSON object on stdout (progress on stderr), also kept in bench/last.json (not committed). ~29 min.
# TIMM_TRAIN=path/to/timm/train.py adds the command-level comparison against timm's own train.py.
bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/run.py $(if $(TIMM_TRAIN),--timm-train $(TIMM_TRAIN)) > bench/last.json && cat bench/last.json

# One run on two Gloo ranks under torchrun meets 13 injected faults of 12 kinds (ranks killed, hung, crashed,
# killed mid-write; a NaN and a spike; a full disk, a damaged checkpoint; the S3 store failing mid-upload and
# restarted; a preemption's SIGTERM; a node lost with its disk) and must end bit-identical to the run that met
# none: the report (each fault and the seconds it cost) in bench/soak.json (not committed). ~3 min. The size
# make test runs is tests/integration/test_soak.py.
soak: setup
	$(PY) bench/soak.py --out bench/soak.json

# ImageNet met before a user meets it: a 1,000 x 1,281 folder of hard links, `vit pretrain` on it as a user
# types it beside timm's train.py (TIMM_TRAIN=path/to/timm/train.py, from timm's repository at the installed
# version; without it vit's side alone): start, img/s and every process's peak memory, one JSON, also kept in
# bench/rehearsal.json (not committed). ARGS=... passes options (--quick, --keep DIR, --steps N). ~20 min.
rehearse: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/rehearse.py $(if $(TIMM_TRAIN),--timm-train $(TIMM_TRAIN)) --out bench/rehearsal.json $(ARGS)

# Peak RSS of one ViT-B/16 384 px fine-tuning step (recipes/finetune/imagenet.yaml's micro-batch). Minutes.
bench-memory: setup
	$(PY) bench/memory.py

# Seconds and peak RSS of `vit --help` and of `vit pretrain --dry-run` with a misspelt key, median of 5
# processes each; the target: the misspelt key reported in under 1 s. Seconds.
bench-startup: setup
	$(PY) bench/startup.py

# The quickstart at 2 threads and at 1, twice each: img/s, the load, and whether the run advised fewer
# threads (src/vitcli/runtime/threads.py quotes what it gave on 2 shared cores). ~2 min.
threads-ab: setup
	bash scripts/threads_ab.sh

# On a GPU machine: one JSON object on stdout (progress on stderr), under 10 min; bench/gpu_check.py says what
# it checks, `--quick` checks the script anywhere (CI does). `make gpu-check PY=python3` runs it in an
# environment that already holds the dependencies (a GPU image without network) instead of .venv;
# ARGS=... passes options (--out FILE, --keep DIR, --only SECTIONS).
gpu-check: $(if $(findstring .venv/,$(PY)),setup)
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(PY) bench/gpu_check.py $(ARGS)

clean:
	rm -rf .venv runs build *.egg-info
