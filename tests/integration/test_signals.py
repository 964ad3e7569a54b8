"""Ctrl-C and SIGTERM as a user and a scheduler send them: the step finishes, a checkpoint is
written, one line says how to resume, the exit code is 130 / 143, and resuming ends exactly where an
uninterrupted run ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO
from vitcli.checkpoints import state
from vitcli.checkpoints.weights import load_weights
from vitcli.recipe.resolve import resolve
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

STEPS = 300
ARGS = ["pretrain", "-r", str(REPO / "recipes/quickstart/pretrain.yaml"), "schedule.epochs=0",
        f"schedule.steps={STEPS}", "schedule.warmup_steps=5", "run.log_every=1", "run.ckpt_every=100000",
        "data.synthetic.train_size=256", "data.val_split=", "data.test_split=", "data.batch_size=16",
        "model.dropout=0.1", "data.mixup_alpha=0.2", "model.depth=1", "model.embed_dim=32",
        "model.num_heads=2", "model.mlp_dim=64"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def vit(workdir: Path, *extra: str) -> subprocess.Popen:
    """`vit pretrain ...` in its own session, so a signal can go to its whole group, as a terminal's
    does."""
    return subprocess.Popen([sys.executable, "-m", "vitcli.cli", *ARGS, "--workdir", str(workdir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)


def wait_for_step(workdir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    metrics, deadline = workdir / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if len(lines) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The uninterrupted run's final weights."""
    workdir = tmp_path_factory.mktemp("straight")
    proc = vit(workdir)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return load_weights(workdir / MODEL_FILE)[0]


# SLURM's SIGUSR2 (twice, as srun and torchrun deliver it) takes the same path:
# tests/unit/test_interrupt.py, and end to end tests/integration/test_torchrun_cluster.py and
# test_slurm.py
@pytest.mark.parametrize("sig, code, workers", [(signal.SIGINT, 130, 2), (signal.SIGTERM, 143, 0)],
                         ids=["ctrl-c to the group, with loader workers", "sigterm to the process"])
def test_a_signal_checkpoints_and_resuming_ends_where_the_straight_run_ends(tmp_path, straight, sig, code,
                                                                           workers):
    proc = vit(tmp_path, f"data.num_workers={workers}")
    wait_for_step(tmp_path, 10, proc)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # the terminal sends Ctrl-C to every process of the group, workers too
    else:
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(sig).name} at step") and "error" not in err.lower()
    assert "run the same command again to resume" in last, err[-2000:]
    saved = state.checkpoints(tmp_path)
    assert len(saved) == 1, "the signal's checkpoint (ckpt_every is far away)"
    stopped = state.load_state(saved[0])["step"]
    assert 10 <= stopped < STEPS and not (tmp_path / MODEL_FILE).exists()
    assert [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, stopped + 1))

    proc = vit(tmp_path, f"data.num_workers={workers}")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert f"at step {stopped}" in " ".join(err.split())
    resumed = load_weights(tmp_path / MODEL_FILE)[0]
    assert all(torch.equal(resumed[k], straight[k]) for k in straight), "resumed != uninterrupted"


def test_a_second_ctrl_c_aborts_at_once_and_leaves_no_partial_file(tmp_path):
    proc = vit(tmp_path, "data.num_workers=0")
    wait_for_step(tmp_path, 5, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    # the abort, or the first signal's stop when the step ended before the second arrived
    assert proc.returncode == 130, err[-2000:]
    assert last.startswith(("interrupted (Ctrl-C)", "stopped by SIGINT")), err[-2000:]
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left at the target's side"
    for path in state.checkpoints(tmp_path):  # any checkpoint that exists is whole (checksum verified)
        state.load_state(path)


def test_two_augmented_runs_are_identical(tmp_path):
    """DeiT's augmentation (RandAugment, erasing, mixup and CutMix) draws from the per-micro-batch
    seeded streams, not from the global RNGs, which differ between the two runs."""
    tiny = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
            "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4",
            "data.synthetic.train_size=64", "data.val_split=", "data.test_split=", "data.batch_size=16",
            "data.num_workers=0", "data.mixup_alpha=0.4", "data.cutmix_alpha=1.0",
            "data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "schedule.steps=6",
            "schedule.warmup_steps=1"]
    weights = []
    for name in ("a", "b"):
        torch.manual_seed(len(name))
        np.random.seed(len(name) * 7)  # the global streams differ between the two runs
        one_run(resolve("pretrain", None, tiny), tmp_path / name)
        weights.append(load_weights(tmp_path / name / MODEL_FILE)[0])
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
