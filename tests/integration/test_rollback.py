"""A loss spike rolls the run back to its newest checkpoint and skips the batches since, in the same
process: it ends with the weights of a run given the recorded skip up front (data.skip_steps), even
when killed after the rollback and run again; the skip is in the checkpoints, metrics.jsonl,
rollbacks.jsonl and the SLURM attempt's record; past run.max_rollbacks it stops in one line."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers import REPO, run_vit
from vitcli.checkpoints import manager
from vitcli.checkpoints.weights import load_weights
from vitcli.recipe.resolve import resolve
from vitcli.runtime import faults
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run
from vitcli.train import loop

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4",
        "data.synthetic.train_size=64", "data.synthetic.img_size=32", "data.batch_size=16",
        "data.num_workers=0", "data.val_split=", "data.test_split=", "optim.lr=3e-3",
        "schedule.warmup_steps=1", "run.log_every=1", "run.precision=fp32", "model.dropout=0.1",
        "schedule.steps=12", "run.ckpt_every=4", "run.ckpt_every_minutes=0"]
# nan at step 7: back to state-4, the batches of steps 5-7 skipped
RECORDED = "data.skip_steps=[5-7]"


def _run(path, *extra):
    return one_run(resolve("pretrain", None, [*TINY, *extra]), path)


def _weights(path) -> dict:
    return load_weights(path / "model.safetensors")[0]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of a run given the skip up front, and of one without it."""
    root = tmp_path_factory.mktemp("reference")
    _run(root / "skip", RECORDED)
    _run(root / "plain")
    return {"skip": _weights(root / "skip"), "plain": _weights(root / "plain")}


def test_a_nan_rolls_back_and_ends_as_the_run_given_its_skip(tmp_path, monkeypatch, reference):
    monkeypatch.setenv(faults.ENV, "nan@7")
    (tmp_path / "slurm").mkdir(parents=True)
    attempts = tmp_path / "slurm" / "attempts.jsonl"
    attempts.write_text(json.dumps({"job": "1", "from_step": 0}) + "\n")
    _run(tmp_path)
    assert _same(_weights(tmp_path), reference["skip"])
    assert not _same(reference["skip"], reference["plain"])  # the skip changed what was trained
    record = {"from_step": 7, "to_step": 4, "loss": None, "window": [5, 7], "skips": [[5, 7]]}
    recorded = (tmp_path / "rollbacks.jsonl").read_text().splitlines()
    assert [json.loads(ln) for ln in recorded] == [record]
    attempt = json.loads(attempts.read_text())
    assert attempt["rollbacks"] == [record] and attempt["job"] == "1"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, *range(5, 13)]  # the thrown-away rows went
    assert rows[4] == {"step": 4, "rollback/from_step": 7, "rollback/first_batch": 5,
                       "rollback/last_batch": 7, "rollback/spiked_loss": None}
    _, saved = manager.latest_good_state(tmp_path)
    assert saved["step"] == 12 and saved["data"]["skips"] == [[5, 7]]


# `vit pretrain`, SIGKILLed where its loop meets step 6 the second time (after the rollback from 7)
KILLED = """
import os, signal, sys
from vitcli.train import loop
real, seen = loop._step, []
def _step(optimizer, model, ema, done, objective):
    seen.append(done)
    if seen.count(6) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    real(optimizer, model, ema, done, objective)
loop._step = _step
sys.argv = ["vit", *sys.argv[1:]]
from vitcli.cli import main
main()
"""


def test_killed_after_a_rollback_before_a_checkpoint_ends_alike(tmp_path, monkeypatch, reference):
    """`vit pretrain` SIGKILLed at step 6 replayed, before any checkpoint holds the skip; the same
    run again (in this process) resumes from state-4 with the skip rollbacks.jsonl recorded, and
    ends with the weights of the run given it."""
    monkeypatch.setenv(faults.ENV, "nan@7")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-c", KILLED, "pretrain", "--workdir", str(tmp_path), *TINY]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert (tmp_path / "rollbacks.jsonl").is_file() and not (tmp_path / "state-8.pt").exists()
    _run(tmp_path)
    # resumed at step 4: the rollback's row kept, the killed attempt's later rows gone
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, *range(5, 13)]
    assert _same(_weights(tmp_path), reference["skip"])


def test_a_checkpoint_after_a_rollback_resumes_with_its_skip(tmp_path, monkeypatch, reference):
    """state-8, written after the rollback, holds the skip itself: resumed from it with no
    rollbacks.jsonl beside it, the run still ends with the weights of the run given the skip."""
    monkeypatch.setenv(faults.ENV, "nan@7")
    _run(tmp_path)
    assert (tmp_path / "state-8.pt").is_file()
    for name in ("rollbacks.jsonl", "summary.json", "model.safetensors", "state-12.pt",
                 "state-12.pt.sha256"):
        (tmp_path / name).unlink()
    _run(tmp_path)
    assert _same(_weights(tmp_path), reference["skip"])


def test_past_max_rollbacks_it_stops_in_one_line_naming_the_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(faults.ENV, "nan@6,nan@7")
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, *TINY,
                           "run.max_rollbacks=1")
    line = err.strip().splitlines()[-1]
    assert code == 2
    assert line.startswith("error: the loss spiked at steps 6, 7, past run.max_rollbacks=1")
    assert "loss became nan at step 7" in line
    assert "the newest checkpoint, state-4.pt, is kept" in line
    assert "a lower optim.lr" in line and line.endswith("hold this recipe)")
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [line]
    # the budget is the run's, not the process's: resumed, one more spike stops it again
    monkeypatch.setenv(faults.ENV, "nan@5")
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, *TINY,
                           "run.max_rollbacks=1")
    assert code == 2 and "error: the loss spiked at steps 6, 5, past run.max_rollbacks=1" in err
    # the rollback keys may change on resume: with more, the same workdir goes on
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, *TINY,
                           "run.max_rollbacks=3")
    assert code == 0, err[-2000:]


def test_a_loss_above_k_times_the_median_rolls_back_too(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "spike@10")
    _run(tmp_path, "run.spike_factor=3", "run.spike_window=4")
    record = json.loads((tmp_path / "rollbacks.jsonl").read_text())
    assert (record["from_step"], record["to_step"], record["window"]) == (10, 8, [9, 10])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert record["loss"] > 3 * max(r["train/loss"] for r in rows if r["step"] in (6, 7, 8)
                                    and "train/loss" in r)
    assert manager.latest_good_state(tmp_path)[1]["data"]["skips"] == [[9, 10]]


def test_the_draws_of_a_step_follow_the_batch_it_takes():
    """Dropout, mixup and masking seeds are the skipped-to batch's, the schedule's step stays."""
    plain, moved = loop.Draws(0, 4, 1, 16), loop.Draws(0, 4, 1, 16, batch=7)
    assert moved(3) == loop.Draws(0, 7, 1, 16)(3) != plain(3)
    assert moved.first_sample(8) == 7 * 16 + 8 and moved.step == 4


def test_two_ranks_roll_back_together_when_one_meets_the_spike(tmp_path):
    """nan on rank 1 alone: the loss read is averaged over the ranks, so both see it, go back to
    state-4 together and skip the same batches. The weights are a 1-process run's given the skip
    up to float summation order (the 5e-5 of test_distributed), not a run's without it."""
    two = ["data.micro_batch_size=8", "schedule.steps=6"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "vitcli.cli", "pretrain", "--workdir", str(tmp_path / "two"), *TINY, *two]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"),
           faults.ENV: "nan@5:rank=1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "rollbacks.jsonl").read_text())["skips"] == [[5, 5]]
    _run(tmp_path / "given", *two, "data.skip_steps=[5]")
    _run(tmp_path / "plain", *two)
    rolled, given, plain = (_weights(tmp_path / name) for name in ("two", "given", "plain"))
    assert all(torch.allclose(rolled[k], given[k], atol=5e-5, rtol=0) for k in rolled)
    assert not all(torch.allclose(rolled[k], plain[k], atol=5e-5, rtol=0) for k in rolled)


def test_a_streamed_split_rolls_back_to_the_weights_of_the_run_given_the_skip(tmp_path, monkeypatch):
    """data.streaming: the stream is let go, placed again at state-4's position, and reads past the
    skipped batches' examples without decoding them."""
    _run(tmp_path / "given", "data.streaming=true", RECORDED)
    monkeypatch.setenv(faults.ENV, "nan@7")
    _run(tmp_path / "rolled", "data.streaming=true")
    assert _same(_weights(tmp_path / "rolled"), _weights(tmp_path / "given"))
    monkeypatch.delenv(faults.ENV)
    _run(tmp_path / "plain", "data.streaming=true")
    assert not _same(_weights(tmp_path / "plain"), _weights(tmp_path / "given"))


def test_dino_rolls_back_its_teacher_and_centres_with_the_student(tmp_path, monkeypatch):
    """DINO (iBOT and KoLeo on): the teacher, both centres and the mask token live in the model's
    state, so the checkpoint takes them back too; the run ends as the run given the skip."""
    dino = ["objective=dino", "dino.out_dim=64", "dino.hidden_dim=32", "dino.bottleneck_dim=16",
            "dino.local_crops=2", "dino.local_crop_size=16", "optim.weight_decay_end=0.4",
            "dino.freeze_last_layer_epochs=0.5", "optim.clip_grad_norm=0", "dino.ibot_weight=1",
            "dino.koleo_weight=0.1", "dino.koleo_group=8"]
    _run(tmp_path / "given", *dino, RECORDED)
    monkeypatch.setenv(faults.ENV, "nan@7")
    _run(tmp_path / "rolled", *dino)
    assert _same(_weights(tmp_path / "rolled"), _weights(tmp_path / "given"))
    rolled = manager.latest_good_state(tmp_path / "rolled")[1]
    given = manager.latest_good_state(tmp_path / "given")[1]
    assert {"center", "patch_center", "mask_token"} <= rolled["model"].keys()
    assert any(k.startswith("teacher") for k in rolled["model"])
    assert _same(rolled["model"], given["model"])  # the teacher and the centres with the student
