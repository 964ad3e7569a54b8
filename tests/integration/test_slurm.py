"""`vit pretrain --slurm` on a real one-node SLURM cluster started for these tests
(tests/slurm_cluster.py): the job runs torchrun, SLURM's warning before the time limit (`scancel
--batch --signal=USR2`, what `--signal=B:USR2@S` sends) becomes a checkpoint and a requeue, and the
requeued job ends with the uninterrupted run's weights, bit for bit; a crash is not requeued.
Skipped, with the reason, where SLURM cannot start."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import slurm_cluster
from helpers import REPO
from vitcli.checkpoints.weights import load_weights
from vitcli.runtime.run_files import ATTEMPTS_FILE, METRICS_FILE, MODEL_FILE, SLURM_DIR, SWEEP_FILE

STEPS = 300
TINY = ["-r", str(REPO / "recipes/quickstart/pretrain.yaml"), "schedule.epochs=0", f"schedule.steps={STEPS}",
        "schedule.warmup_steps=5", "run.log_every=1", "run.ckpt_every=100000",
        "data.synthetic.train_size=256", "data.val_split=", "data.test_split=", "data.batch_size=16",
        "model.depth=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
        "slurm.signal_seconds=30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    started = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    if isinstance(started, str):
        pytest.skip(f"no SLURM cluster on this machine: {started}")
    yield started
    started.stop()


def vit(cluster, *args: str) -> subprocess.CompletedProcess:
    env = {**cluster.env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vitcli.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def submit(cluster, workdir: Path, *extra: str) -> str:
    done = vit(cluster, "pretrain", *TINY, "--slurm", "--json", "--workdir", str(workdir), *extra)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)["job_id"]


def wait_for_step(workdir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = workdir / METRICS_FILE
        if metrics.exists() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s: {log(workdir)[-2000:]}")


def log(workdir: Path) -> str:
    return "".join(p.read_text() for p in sorted((workdir / SLURM_DIR).glob("*.out")))


def attempts(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / SLURM_DIR / ATTEMPTS_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """The same run, uninterrupted, on this machine without SLURM: its final weights."""
    workdir = tmp_path_factory.mktemp("straight")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "vitcli.cli", "pretrain", *TINY, "--workdir", str(workdir)],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return load_weights(workdir / MODEL_FILE)[0]


@pytest.mark.parametrize("signal, scancel", [("USR2", "--batch"), ("TERM", "--full")],
                         ids=["the time limit's warning (to the batch shell)",
                              "a preemption's SIGTERM (to every process of the job)"])
def test_a_stopped_job_is_requeued_and_ends_with_the_uninterrupted_weights(cluster, straight, tmp_path,
                                                                           signal, scancel):
    """The warning: every rank checkpoints at its next step. A preemption's SIGTERM: srun kills the
    step at once (its own answer to SIGTERM), so the run resumes from its last periodic
    checkpoint."""
    workdir = tmp_path / "run"
    job = submit(cluster, workdir, "run.ckpt_every=50")
    wait_for_step(workdir, 120)
    cluster.run("scancel", scancel, f"--signal={signal}", job)
    requeued = cluster.wait_state(job, ("PENDING",), timeout=120)
    assert int(requeued["Restarts"]) == 1
    first = attempts(workdir)[0]
    assert first["signal"] == signal and first["action"] == "requeue" and 100 <= first["to_step"] < STEPS
    if signal == "USR2":  # a checkpoint at the step the warning found, not only a periodic one
        assert f"stopped by SIGUSR2 at step {first['to_step']}/{STEPS}" in log(workdir)
    # SLURM holds a requeued job ~2 min; released at once, slurmd would refuse it: a credential
    # newer than the revoked one of the job's last run is needed, and their times are in whole
    # seconds
    time.sleep(2.5)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    ended = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert ended["JobState"] == "COMPLETED", log(workdir)[-3000:]
    second = attempts(workdir)[1]
    assert second["from_step"] == first["to_step"] and second["action"] == "done", attempts(workdir)
    resumed = load_weights(workdir / MODEL_FILE)[0]
    assert all(torch.equal(resumed[k], straight[k]) for k in straight), "requeued run != uninterrupted run"

    again = vit(cluster, "pretrain", *TINY, "--slurm", "--workdir", str(workdir))
    assert again.returncode == 2 and "holds a finished run" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr and len(attempts(workdir)) == 2


def test_a_crash_is_not_requeued(cluster, tmp_path):
    workdir = tmp_path / "run"
    job = submit(cluster, workdir, "optim.lr=1e30", "schedule.warmup_steps=0")  # the loss turns non-finite
    ended = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"))
    assert ended["JobState"] == "FAILED" and int(ended["Restarts"]) == 0, log(workdir)[-3000:]
    (only,) = attempts(workdir)
    assert only["action"] == "fail" and only["signal"] == "" and only["rc"] != 0
    assert "without a signal from SLURM: not requeued" in log(workdir)


def test_a_sweep_is_a_job_array_whose_last_task_writes_the_table(cluster, tmp_path):
    workdir = tmp_path / "sweep"
    job = submit(cluster, workdir, "schedule.steps=20", "--sweep", "run.seed=0,1")
    for task in ("0", "1"):
        ended = cluster.wait_state(f"{job}_{task}", ("COMPLETED", "FAILED", "CANCELLED"))
        assert ended["JobState"] == "COMPLETED", log(workdir)[-3000:]
    table = json.loads((workdir / SWEEP_FILE).read_text())
    assert sorted(p["run.seed"] for p in table["points"]) == [0, 1]
    for point in ("run.seed=0", "run.seed=1"):
        assert (workdir / point / MODEL_FILE).is_file() and attempts(workdir / point)[-1]["action"] == "done"
