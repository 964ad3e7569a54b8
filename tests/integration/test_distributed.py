"""Several processes: one run through torchrun (Gloo on CPU), one set of files, and only rank 0
writes or talks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from helpers import REPO, kill_when
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.weights import load_weights, save_weights
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.grid import Grid, points
from vitcli.recipe.layers import nest
from vitcli.recipe.resolve import derive, resolve
from vitcli.recipe.schema import ModelConfig
from vitcli.runtime.dist import setup
from vitcli.runtime.metrics import console, read_metrics, stdout
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages import sweep as sweep_mod
from vitcli.stages import vtab as vtab_mod
from vitcli.stages.fewshot import eval_fewshot

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SMALL = ["--recipe", str(REPO / "recipes/quickstart/pretrain.yaml"), "schedule.epochs=0",
         "schedule.warmup_steps=1", "data.synthetic.train_size=256", "data.synthetic.val_size=64",
         "data.synthetic.test_size=64", "data.batch_size=32", "data.micro_batch_size=8", "data.num_workers=0"]


def vit(nproc: int, workdir: Path, *overrides: str) -> list[str]:
    """`vit pretrain` on the quickstart recipe made small, under torchrun with `nproc` processes
    (or plain)."""
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                if nproc > 1 else [])
    return [sys.executable, *launcher, "-m", "vitcli.cli", "pretrain", "--workdir", str(workdir),
            *SMALL, *overrides]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def weights(workdir: Path) -> dict:
    return load_weights(workdir / MODEL_FILE)[0]


def test_torchrun_two_processes(tmp_path):
    run(vit(2, tmp_path, "schedule.steps=6", "run.log_every=1"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 7)), "rank 0 logs each step once"
    final = [r for r in rows if "test/top1" in r]
    assert len(final) == 1 and 0 <= final[0]["test/top1"] <= 1
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "state-6.pt").is_file()


def test_a_rank_other_than_0_computes_but_writes_and_prints_nothing(tmp_path, monkeypatch, capsys):
    """As torchrun starts rank 1: eval-fewshot (reports, feature cache), the sweeps and the VTAB
    driver produce their results in memory, and leave no file and no console line; rank 0 does
    both."""
    monkeypatch.setenv("RANK", "1")  # world size 1, so there is no group to join, but this is not rank 0
    monkeypatch.setattr(console, "quiet", False)  # restored after the test: dist.setup flips it
    monkeypatch.setattr(stdout, "quiet", False)
    init = tmp_path / "pre"
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    save_weights(init / MODEL_FILE, build_model(cfg, 4).state_dict(), {"model": model_spec(cfg, 4)})
    before = sorted(tmp_path.rglob("*"))

    r = resolve("eval-fewshot", None, ["fewshot.tasks=synthetic", "fewshot.shots=1", "fewshot.seeds=1",
                                       f"init.checkpoint={init}", "data.synthetic.train_size=40",
                                       "data.synthetic.test_size=40", "data.num_workers=0"],
                complete=complete)
    assert len(eval_fewshot(r, tmp_path / "fewshot")["runs"]) == 1

    monkeypatch.setattr(sweep_mod, "run_training", lambda recipe, *a, **k: {"val/top1": recipe.optim.lr})
    monkeypatch.setattr(vtab_mod, "run_training", lambda recipe, *a, **k: {"test/top1": 0.5})
    ft = resolve("finetune", None,
                 ["schedule.steps=10", "schedule.warmup_steps=1", "data.val_split=validation"])
    dist = setup("cpu")
    assert sweep_mod.lr_sweep(ft, tmp_path / "sweep", [0.1, 0.2], dist)["best_lr"] == 0.2
    found = points(["optim.lr=0.1,0.2"])
    grid = Grid(found, [derive(ft, nest(p.overrides)) for p in found])
    assert sweep_mod.sweep_grid(grid, tmp_path / "grid", dist)["best"] == "optim.lr=0.2"
    assert (list(vtab_mod.run_vtab(ft, tmp_path / "vtab", vtab_mod.vtab_tasks("vtab/dmlab"), dist))
            == ["vtab/dmlab"])

    assert sorted(tmp_path.rglob("*")) == before
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "")


# Dropout, drop-path and mixup on: every random draw of a step must be the same whichever process
# makes it. every random draw a run makes: dropout, drop-path, and DeiT's augmentation (RandAugment,
# erasing, mixup and CutMix switched half the time)
RANDOM = ("model.dropout=0.1", "model.drop_path=0.1", "data.mixup_alpha=0.2", "data.cutmix_alpha=1.0",
          "data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25")


def test_one_and_two_processes_train_the_same(tmp_path):
    """The same global batch of 32 as 4 micro-batches of 8 in one process, or 2 + 2 in two (Gloo):
    the same images, augmentation, mixup and dropout draws, so the runs differ only in the float
    summation order of the gradient (DDP averages two partial sums). Adam divides each gradient
    element by its own running scale, so an element whose gradient is float noise can move visibly:
    after 6 steps the weights agree to 5e-5 (measured 4.8e-6; run.seed=1 instead differs by 0.29)
    and the logged losses to 1e-5 (measured 2.4e-7)."""
    steps = ("schedule.steps=6", "run.log_every=1", *RANDOM)
    run(vit(1, tmp_path / "one", *steps))
    run(vit(2, tmp_path / "two", *steps))
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert one.keys() == two.keys()
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 5e-5, worst
    losses = [[r["train/loss"] for r in read_metrics(tmp_path / w / "metrics.jsonl") if "train/loss" in r]
              for w in ("one", "two")]
    assert len(losses[0]) == 6 and np.allclose(losses[0], losses[1], rtol=0, atol=1e-5), losses


def test_one_and_two_processes_mask_and_train_mae_the_same(tmp_path):
    """objective: mae, the same global batch of 32 split as above: each image's mask is drawn from
    its index in the run, not from its micro-batch or rank, so the runs again differ only in the
    float summation order (weights measured 3.9e-6 apart after 6 steps). The held-out MAE loss is
    computed on the ranks' shares of the split and exercised here too."""
    steps = ("objective=mae", "mae.decoder_embed_dim=32", "mae.decoder_depth=1", "mae.decoder_num_heads=4",
             "schedule.steps=6", "run.log_every=1", "model.drop_path=0.1")
    run(vit(1, tmp_path / "one", *steps))
    run(vit(2, tmp_path / "two", *steps))
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 5e-5, worst
    losses = [[r["train/loss"] for r in read_metrics(tmp_path / w / "metrics.jsonl") if "train/loss" in r]
              for w in ("one", "two")]
    assert len(losses[0]) == 6 and np.allclose(losses[0], losses[1], rtol=0, atol=1e-5), losses


def test_two_processes_killed_and_resumed_end_bit_identical(tmp_path):
    """A 2-process run SIGKILLed after its step-30 checkpoint and started again resumes there and
    ends with exactly (torch.equal) the weights and logged losses of the same run never
    interrupted."""
    steps = ("schedule.steps=120", "run.ckpt_every=30", "run.log_every=10", *RANDOM)
    run(vit(2, tmp_path / "straight", *steps))
    # its checksum is written last: the checkpoint is whole (a kill before it leaves one a resume
    # skips)
    kill_when(ENV, vit(2, tmp_path / "killed", *steps), tmp_path / "killed" / "state-30.pt.sha256")
    assert not (tmp_path / "killed" / MODEL_FILE).exists()
    proc = run(vit(2, tmp_path / "killed", *steps))
    assert "resuming from" in proc.stderr and "at step 30" in " ".join(proc.stderr.split())
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    rows = [{r["step"]: r["train/loss"] for r in read_metrics(tmp_path / w / "metrics.jsonl")
             if "train/loss" in r}
            for w in ("straight", "killed")]
    assert rows[0] == rows[1]


def test_fewshot_features_split_across_two_processes_match_one(tmp_path):
    """eval-fewshot under torchrun: each rank extracts every other image and the parts are gathered
    back in dataset order, so the least-squares results equal one process's (to 1e-6: the solves see
    the same numbers)."""
    init = tmp_path / "pre"
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    save_weights(init / MODEL_FILE, build_model(cfg, 4).state_dict(), {"model": model_spec(cfg, 4)})
    args = ["eval-fewshot", "--ckpt", str(init), "--tasks", "synthetic", "--shots", "1,5", "--seeds", "2",
            "data.synthetic.train_size=101", "data.synthetic.test_size=51", "data.eval_batch_size=16",
            "data.num_workers=0"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run([sys.executable, "-m", "vitcli.cli", *args, "--workdir", str(tmp_path / "one")])
    run([*launcher, "-m", "vitcli.cli", *args, "--workdir", str(tmp_path / "two")])
    one, two = (json.loads((tmp_path / w / "results.json").read_text())["runs"] for w in ("one", "two"))
    assert len(one) == len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert ({k: v for k, v in a.items() if k != "accuracy"}
                == {k: v for k, v in b.items() if k != "accuracy"})
        assert abs(a["accuracy"] - b["accuracy"]) < 1e-6
    cached = [sorted((tmp_path / w / "features").iterdir()) for w in ("one", "two")]
    assert [p.name for p in cached[0]] == [p.name for p in cached[1]] and len(cached[0]) == 2
    for p, q in zip(*cached):
        assert (load_file(str(p))["features"] == load_file(str(q))["features"]).all()


def test_a_two_process_run_resumes_on_one_process(tmp_path):
    """Killed on 2 processes, resumed on 1 with the same global and micro batch: it continues the
    same training, ending where one process alone ends, up to float summation order amplified by 60
    Adam steps (5e-4; measured 7.6e-5, where another run.seed is about 0.3 away)."""
    steps = ("schedule.steps=60", "run.ckpt_every=20", "run.log_every=10", *RANDOM)
    kill_when(ENV, vit(2, tmp_path / "moved", *steps), tmp_path / "moved" / "state-20.pt.sha256")  # whole
    proc = run(vit(1, tmp_path / "moved", *steps))
    # map-style batches are the same on any world size: no warning that the data order changed
    assert "resuming from" in proc.stderr and "split over" not in proc.stderr
    assert "at step 20" in " ".join(proc.stderr.split())
    run(vit(1, tmp_path / "one", *steps))
    one, moved = weights(tmp_path / "one"), weights(tmp_path / "moved")
    worst = max((one[k] - moved[k]).abs().max().item() for k in one)
    assert worst < 5e-4, worst


def test_fsdp_trains_as_ddp_resumes_bit_identical_and_exports_the_same_file(tmp_path):
    """`run.strategy=fsdp` on 2 Gloo processes, activation checkpointing on, and a validation split
    whose 65 images give the ranks unequal numbers of batches (a sharded forward is collective: this
    would hang if evaluation stayed sharded):
    - trains what DDP trains: weights within 5e-5 after 6 steps (the 1-vs-2-process tolerance; only
    float
      summation order differs: FSDP reduce-scatters where DDP all-reduces);
    - killed after its step-30 sharded checkpoint (state-30/) and started again, it ends
    bit-identical to the
      same run uninterrupted;
    - exports a model.safetensors with the same keys and shapes as DDP's."""
    fsdp = ("run.strategy=fsdp", "run.activation_checkpointing=true", "data.synthetic.val_size=65",
            "data.eval_batch_size=16", "run.eval_every=3")
    short = ("schedule.steps=6", "run.log_every=1", *RANDOM)
    run(vit(2, tmp_path / "ddp", *short))
    run(vit(2, tmp_path / "fsdp", *short, *fsdp))
    ddp, sharded = weights(tmp_path / "ddp"), weights(tmp_path / "fsdp")
    assert ddp.keys() == sharded.keys()
    assert max((ddp[k] - sharded[k]).abs().max().item() for k in ddp) < 5e-5
    assert (tmp_path / "fsdp" / "state-6").is_dir() and not list((tmp_path / "fsdp").glob("state-*.pt"))

    long = ("schedule.steps=90", "run.ckpt_every=30", "run.log_every=10", *RANDOM, *fsdp)
    run(vit(2, tmp_path / "straight", *long))
    kill_when(ENV, vit(2, tmp_path / "killed", *long), tmp_path / "killed" / "state-30")
    assert "resuming from" in run(vit(2, tmp_path / "killed", *long)).stderr
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert {k: v.shape for k, v in resumed.items()} == {k: v.shape for k, v in ddp.items()}


def test_evaluate_split_across_two_processes_matches_one(tmp_path):
    """vit evaluate under torchrun: each rank predicts every other image, the rows are gathered back
    in order, so top-1, per-class counts, ReaL (matched by row order, so order matters), test-time
    flips, calibration and the temperature fitted on a held-out split equal one process's."""
    ckpt = tmp_path / "ckpt"
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                      head_zero_init=False)
    torch.manual_seed(0)
    save_weights(ckpt / MODEL_FILE, build_model(cfg, 4).state_dict(), {"model": model_spec(cfg, 4)})
    real = tmp_path / "real.json"
    real.write_text(json.dumps([[i % 4, (i + 1) % 4] if i % 3 else [] for i in range(51)]))
    args = ["evaluate", "--ckpt", str(ckpt), "--real-labels", str(real), "data.synthetic.num_classes=4",
            "data.synthetic.test_size=51", "data.eval_batch_size=8", "data.num_workers=0",
            "run.precision=fp32", "--tta", "flip", "--calibrate-on", "validation",
            "data.synthetic.val_size=25"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run([sys.executable, "-m", "vitcli.cli", *args, "--workdir", str(tmp_path / "one")])
    run([*launcher, "-m", "vitcli.cli", *args, "--workdir", str(tmp_path / "two")])
    one, two = (json.loads((tmp_path / w / "results.json").read_text()) for w in ("one", "two"))
    assert one["images"] == two["images"] == 51 and one["real/matched_by"] == "row order"
    for key in ("top1", "per_class", "real/top1", "real/images", "tta/top1", "ts/images"):
        assert one[key] == two[key], key
    for key in ("loss", "ece", "nll", "ts/temperature", "ts/ece", "ts/nll"):
        assert abs(one[key] - two[key]) < 1e-6, key
