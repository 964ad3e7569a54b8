"""What a command imports, as `python -X importtime` lists it: `vit pretrain --help` imports no
torch, and a one-process CPU run, up to its first training step, imports neither
torch.distributed.checkpoint (a sharded run's: 12.8 s measured under load) nor matplotlib (drawing
the curves at the end: 4.4 s), and a micro-batch trial reads no data."""

import subprocess
import sys

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4",
        "data.synthetic.train_size=64", "data.synthetic.val_size=32", "data.synthetic.test_size=32",
        "data.batch_size=32", "data.num_workers=0", "schedule.steps=3", "schedule.warmup_steps=1",
        "run.device=cpu", "run.compile=false", "run.precision=fp32"]
STARTS = "-- training starts --"
# the run's entry as `vit` runs it, the loop's train() replaced by a marker: what is imported before
# it is what the run imported to start
UP_TO_TRAINING = f"""
import sys
from vitcli.train import loop
def started(job, dist):
    sys.stderr.write({STARTS!r} + "\\n")
    sys.stderr.flush()
    raise SystemExit(0)
loop.train = started
from vitcli.cli import main
sys.argv = sys.argv[1:]
main()
"""


def imported(args: list[str], until: str | None = None) -> dict[str, int]:
    """Each module `python -X importtime ARGS` imports (up to the line `until`), with its cumulative
    microseconds."""
    done = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    if until is not None:
        assert until in lines, done.stderr[-3000:]
        lines = lines[:lines.index(until)]
    found = {}
    for line in lines:
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                found[name.strip()] = int(cumulative)
    assert found, "no -X importtime lines"
    return found


def test_pretrain_help_imports_no_torch():
    modules = imported(["-m", "vitcli.cli", "pretrain", "--help"])
    assert "vitcli.cli.commands" in modules
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]


def test_a_one_process_cpu_run_starts_without_the_sharded_checkpoint_or_matplotlib(tmp_path):
    command = ["vit", "pretrain", "--workdir", str(tmp_path / "w"), *TINY]
    modules = imported(["-c", UP_TO_TRAINING, *command], until=STARTS)
    assert "vitcli.checkpoints.manager" in modules and "torch" in modules  # the run was built
    unwanted = ("torch.distributed.checkpoint", "matplotlib")
    found = [m for m in modules if m.startswith(unwanted)]
    assert not found, found


def test_a_micro_batch_trial_imports_no_data_reading():
    """A trial (data.micro_batch_size: auto) measures its own process's peak memory, on random
    inputs: datasets, pandas and pyarrow (~100 MiB resident) would count against its budget."""
    modules = imported(["-c", "import vitcli.run.trial"])
    assert "vitcli.objectives.registry" in modules and "vitcli.train.loop" in modules
    found = [m for m in modules if m.split(".")[0] in ("datasets", "pandas", "pyarrow")]
    assert not found, found[:5]
