"""`vit pretrain --slurm` on a real one-node SLURM cluster started for these tests
(tests/slurm_cluster.py): the job runs torchrun; SLURM's warning before the time limit (`scancel
--batch --signal=USR2`, what `--signal=B:USR2@S` sends) and a preemption (a job of a partition of
higher priority, which SLURM requeues the run's job for) each become a checkpoint and a requeue,
and the requeued job ends with the uninterrupted run's weights, bit for bit; a rank killed by
SIGKILL (what the kernel's OOM killer sends) is requeued; a user's scancel ends the job; a crash
is not requeued; a second submission while the job runs, a finished sweep and a submission sbatch
refuses leave the workdir as it was. Skipped, with the reason, where SLURM cannot start."""

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


def preempt(cluster, job: str) -> None:
    """What a cluster does: a job of the `urgent` partition (higher PriorityTier) needs every CPU of
    the node, and SLURM preempts the run's job for it (PreemptMode=REQUEUE)."""
    cluster.run("sbatch", "--partition=urgent", f"--cpus-per-task={os.cpu_count()}", "--output=/dev/null",
                "--wrap=sleep 1")


def release(cluster, job: str) -> None:
    """SLURM holds a requeued job ~2 min; released at once, slurmd would refuse it: a credential
    newer than the revoked one of the job's last run is needed, and their times are in whole
    seconds."""
    cluster.wait_state(job, ("PENDING",), timeout=120)
    time.sleep(2.5)
    cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")


def same_weights(workdir: Path, straight: dict) -> bool:
    resumed = load_weights(workdir / MODEL_FILE)[0]
    return all(torch.equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.parametrize("stop", ["USR2", "debug", "cancelable"],
                         ids=["the time limit's warning (to the batch shell)",
                              "a preemption SLURM requeues (SIGTERM to all, SIGKILL after KillWait)",
                              "a preemption SLURM cancels (PreemptMode=CANCEL: the job requeues itself)"])
def test_a_stopped_job_is_requeued_and_ends_with_the_uninterrupted_weights(cluster, straight, tmp_path,
                                                                           stop):
    """Every rank checkpoints at the step the signal found: the warning is forwarded by the batch
    shell; a preemption's SIGTERM reaches torchrun and the ranks themselves (one node: no srun,
    which would kill them at once), within the cluster's KillWait. A preemption that cancels the
    job is told from a user's scancel by slurmstepd's line in the log ("DUE TO PREEMPTION")."""
    workdir = tmp_path / "run"
    partition = [] if stop == "USR2" else [f"slurm.partition={stop}"]
    job = submit(cluster, workdir, "run.ckpt_every=50", *partition)
    wait_for_step(workdir, 120)
    if stop == "USR2":
        cluster.run("scancel", "--batch", "--signal=USR2", job)
    else:
        preempt(cluster, job)
    release(cluster, job)
    first = attempts(workdir)[0]
    assert int(cluster.job(job)["Restarts"]) == 1 and first["action"] == "requeue", first
    signal, kind = ("USR2", "time limit") if stop == "USR2" else ("TERM", "preemption")
    assert first["signal"] == signal and first["stop"] == kind and 100 <= first["to_step"] < STEPS
    # a checkpoint at the step the signal found, not only a periodic one
    assert f"stopped by SIG{signal} at step {first['to_step']}/{STEPS}" in log(workdir)
    ended = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    assert ended["JobState"] == "COMPLETED", log(workdir)[-3000:]
    second = attempts(workdir)[1]
    assert second["from_step"] == first["to_step"] and second["action"] == "done", attempts(workdir)
    assert same_weights(workdir, straight), "requeued run != uninterrupted run"

    again = vit(cluster, "pretrain", *TINY, "--slurm", "--workdir", str(workdir))
    assert again.returncode == 2 and "holds a finished run" in again.stderr, again.stderr
    assert "Traceback" not in again.stderr and len(attempts(workdir)) == 2


def rank_pids(workdir: Path) -> list[int]:
    """The ranks torchrun started for the run in `workdir` (`python -u -m vitcli pretrain ...`)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if args[1:4] == ["-u", "-m", "vitcli"] and str(workdir) in args:
            pids.append(int(proc.name))
    return pids


def test_a_killed_rank_is_requeued_a_cancel_ends_the_job_and_a_second_submission_waits(cluster, straight,
                                                                                       tmp_path):
    """A rank SIGKILLed (the OOM killer's signal): requeued, from the last periodic checkpoint. While
    the job runs a second submission is refused; a user's plain scancel ends it, with a checkpoint
    at the stop; submitted again once it ended, the run finishes with the uninterrupted weights."""
    workdir = tmp_path / "run"
    job = submit(cluster, workdir, "run.ckpt_every=50")
    wait_for_step(workdir, 60)
    (rank,) = rank_pids(workdir)
    os.kill(rank, 9)
    release(cluster, job)
    killed = attempts(workdir)[0]
    assert (killed["rc"], killed["ranks_rc"], killed["stop"]) == (137, 137, "kill"), killed
    assert killed["action"] == "requeue"
    assert not list((workdir / SLURM_DIR).glob("exits-*"))  # the launch's record, read and removed
    assert killed["to_step"] % 50 == 0 and "restart 1 of 2" in killed["why"]  # a periodic checkpoint

    twice = vit(cluster, "pretrain", *TINY, "--slurm", "--workdir", str(workdir))
    assert twice.returncode == 2 and len(twice.stderr.strip().splitlines()) == 1, twice.stderr
    assert f"job {job} is still " in twice.stderr and f"scancel {job}" in twice.stderr
    cluster.wait_state(job, ("RUNNING",), timeout=120)
    rows = len((workdir / METRICS_FILE).read_text().splitlines())
    wait_for_step(workdir, rows + 20)  # the second attempt trains (its rows follow the first's)

    cluster.run("scancel", job)
    ended = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED", "PENDING"), timeout=120)
    assert ended["JobState"] == "CANCELLED" and int(ended["Restarts"]) == 1, log(workdir)[-3000:]
    cancelled = attempts(workdir)[1]
    assert (cancelled["signal"], cancelled["stop"], cancelled["action"]) == ("TERM", "cancel", "cancel")
    assert f"stopped by SIGTERM at step {cancelled['to_step']}/{STEPS}" in log(workdir)

    resubmitted = submit(cluster, workdir)  # the job ended: no obstacle
    ended = cluster.wait_state(resubmitted, ("COMPLETED", "FAILED", "CANCELLED"))
    assert ended["JobState"] == "COMPLETED", log(workdir)[-3000:]
    last = attempts(workdir)[2]
    assert last["from_step"] == cancelled["to_step"] and last["action"] == "done", attempts(workdir)
    assert same_weights(workdir, straight), "killed, cancelled and resubmitted run != uninterrupted run"


def test_a_submission_sbatch_refuses_writes_nothing(cluster, tmp_path):
    workdir = tmp_path / "run"
    done = vit(cluster, "pretrain", *TINY, "--slurm", "--workdir", str(workdir), "slurm.partition=nowhere")
    assert done.returncode == 2 and "sbatch refused the job" in done.stderr, done.stderr
    assert "nothing was written" in done.stderr and not workdir.exists()


def test_a_crash_is_not_requeued(cluster, tmp_path):
    workdir = tmp_path / "run"
    job = submit(cluster, workdir, "optim.lr=1e30", "schedule.warmup_steps=0")  # the loss turns non-finite
    ended = cluster.wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"))
    assert ended["JobState"] == "FAILED" and int(ended["Restarts"]) == 0, log(workdir)[-3000:]
    (only,) = attempts(workdir)
    assert only["action"] == "fail" and only["signal"] == "" and only["stop"] == "crash" and only["rc"] == 2
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
    again = vit(cluster, "pretrain", *TINY, "--slurm", "--workdir", str(workdir), "schedule.steps=20",
                "--sweep", "run.seed=0,1")
    assert again.returncode == 2 and "holds a finished sweep (its 2 points)" in again.stderr, again.stderr
    assert cluster.run("squeue", "-h") == ""  # no new job array
