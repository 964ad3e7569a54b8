"""torchrun as a SLURM job runs it, on this machine: one launch per node meeting at a c10d endpoint,
and the scheduler's SIGUSR2 ahead of a time limit forwarded by torchrun to every rank
(`--signals-to-handle`), which stop at one step with one checkpoint; the same command resumes
bit-for-bit. Tiny runs on Gloo."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from helpers import REPO, kill_tree
from vitcli.checkpoints import state
from vitcli.checkpoints.weights import load_weights
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE
from vitcli.stages.run import one_run

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
# the global batch of 16 as 2 micro-batches of 8: accumulated by one process, or one on each of two;
# dropout, drop-path and mixup draw the same numbers whichever process draws them
TINY = ["schedule.epochs=0", "schedule.warmup_steps=1", "run.log_every=1", "data.synthetic.train_size=64",
        "data.val_split=", "data.test_split=", "data.batch_size=16", "data.micro_batch_size=8",
        "data.num_workers=0", "model.depth=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
        "model.dropout=0.1", "model.drop_path=0.1", "data.mixup_alpha=0.2"]
VIT = ["-m", "vitcli", "pretrain", "--recipe", str(QUICKSTART), *TINY]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# what a SLURM batch script passes: SIGUSR1/2 forwarded to the ranks, and time for their checkpoint
SIGNALS = ["--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2", "--shutdown-timeout", "60"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def launched(*cmds: list[str]):
    """Each command started in a session of its own; on the way out, whatever still runs of them and
    of what they started (torchrun's ranks are in sessions of their own) is SIGKILLed."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                              start_new_session=True) for cmd in cmds]
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
            proc.communicate()


def finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    """Its stderr once it has exited."""
    return proc.communicate(timeout=timeout)[1]


def run(cmd: list[str]) -> str:
    with launched(cmd) as (proc,):
        err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    return err


def weights(workdir: Path) -> dict:
    return load_weights(workdir / MODEL_FILE)[0]


def losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(workdir / METRICS_FILE) if "train/loss" in r}


def test_two_launches_at_a_c10d_endpoint_train_as_one_process(tmp_path, one_thread):
    """Two torchrun launches of one process each, `--nnodes 2` at one c10d endpoint, as a SLURM
    job's two nodes start them, form one run: one workdir, written by rank 0 alone (one launch tells
    the run, the other nothing; each step logged once), whose weights are those of one process with
    the same global batch up to float summation order (5e-5 after 6 steps, the bound of
    test_distributed.py's one-vs-two-process test; measured: equal weights, losses 1.2e-7 apart)."""
    steps = ("schedule.steps=6",)
    one_run(resolve("pretrain", QUICKSTART, [*TINY, *steps]), tmp_path / "one")  # here: one start less
    node = [*TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", uuid.uuid4().hex,
            *VIT, "--workdir", str(tmp_path / "nodes"), *steps]
    with launched(node, node) as procs:
        errs = [finish(proc) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(err[-2000:] for err in errs)
    assert sorted("pretrain: custom" in err for err in errs) == [False, True], "rank 0 alone talks"
    assert list(losses(tmp_path / "nodes")) == list(range(1, 7))
    assert [p.name for p in state.checkpoints(tmp_path / "nodes")] == ["state-6.pt"]
    one, nodes = weights(tmp_path / "one"), weights(tmp_path / "nodes")
    assert one.keys() == nodes.keys()
    worst = max((one[k] - nodes[k]).abs().max().item() for k in one)
    assert worst < 5e-5, worst
    assert np.allclose(list(losses(tmp_path / "one").values()), list(losses(tmp_path / "nodes").values()),
                       rtol=0, atol=1e-5)


def two(workdir: Path, *flags: str) -> list[str]:
    """60 steps on 2 processes through torchrun, with torchrun's `flags`."""
    return [*TORCHRUN, "--standalone", "--nproc-per-node", "2", *flags, *VIT, "--workdir", str(workdir),
            "schedule.steps=60"]


def wait_for_step(workdir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    metrics, deadline = workdir / METRICS_FILE, time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None, finish(proc)[-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.02)


def last_lines(log_dir: Path) -> list[str]:
    """Each rank's last line, from the error file torchrun gives it (cli.entry writes it on every
    rank)."""
    files = sorted(log_dir.glob("*/attempt_0/*/error.json"), key=lambda f: int(f.parent.name))
    return [json.loads(f.read_text())["message"]["message"] for f in files]


def test_sigusr2_through_torchrun_stops_every_rank_at_one_checkpoint_and_resumes_bit_identical(tmp_path):
    """SLURM's warning before a time limit, sent to torchrun, which forwards SIGUSR1/2 to its ranks
    only when `--signals-to-handle` names them (torch 2.14): both ranks finish their step, agree,
    write one checkpoint and exit 140, each saying so in the error file torchrun gives it; torchrun
    itself exits 1. The same command then resumes and ends with exactly (torch.equal) the weights
    and logged losses of the run never stopped."""
    run(two(tmp_path / "straight"))
    stopped, logs = tmp_path / "stopped", tmp_path / "logs"
    with launched(two(stopped, *SIGNALS, "--log-dir", str(logs))) as (proc,):
        wait_for_step(stopped, 3, proc)
        proc.send_signal(signal.SIGUSR2)
        err = finish(proc, timeout=120)
    # torchrun raises the signal it forwarded again, as a traceback, and exits 1 whatever its ranks'
    # codes
    assert proc.returncode == 1 and "SignalException" in err, err[-3000:]
    said = last_lines(logs)
    assert len(said) == 2 and said[0] == said[1], (said, err[-3000:])
    step = int(said[0].split(" at step ")[1].split("/")[0])
    assert said[0].startswith(f"stopped by SIGUSR2 at step {step}/60: checkpoint written"), said[0]
    assert 3 < step < 60 and err.count("run the same command again to resume") == 1  # told by rank 0
    assert state.load_state(state.checkpoints(stopped)[0])["step"] == step
    assert list(losses(stopped)) == list(range(1, step + 1)) and not (stopped / MODEL_FILE).exists()

    assert "resuming from" in run(two(stopped, *SIGNALS))
    a, b = weights(tmp_path / "straight"), weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "straight") == losses(stopped)
