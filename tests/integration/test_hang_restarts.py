"""A rank that hangs, one SIGKILLed, one that crashes, under torchrun with `--max-restarts`: the
watchdog (train/watchdog.py) finds the hang, dumps the stacks and exits 75; torchrun brings every
rank back, and the same command resumes from the last checkpoint and ends with the weights and the
metrics.jsonl of the run never interrupted. Faults through VITCLI_FAULTS (runtime.faults), 2 Gloo
ranks on the CPU, tiny runs; the three faults share one run (each torchrun attempt costs seconds of
start-up here)."""

import datetime
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from test_torchrun_cluster import ENV, TORCHRUN, VIT, losses, weights

from helpers import kill_tree
from vitcli.runtime import faults
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import METRICS_FILE
from vitcli.train.watchdog import BACKSTOP

FLOOR_S = 3.0  # the bound after the warm-up: the floor (a tiny step's median x 2 is far below it)
# 16 steps, a checkpoint every 4; the watchdog at its floor of 3 s (the first steps: 60 s)
RUN = ["schedule.steps=16", "run.ckpt_every=4", "run.hang_factor=2",
       f"run.hang_floor_s={FLOOR_S:g}", "run.hang_start_s=60"]
# torchrun's line for a rank that failed: its time (glog's, local) and the exit code
FAILED = re.compile(r"^\w\d{4} (\d\d:\d\d:\d\d\.\d+) .*failed \(exitcode: (-?\d+)\) "
                    r"local_rank: (\d)", re.MULTILINE)


def two(workdir: Path, restarts: int, logs: Path) -> list[str]:
    """2 ranks on one node (`--standalone`: a c10d rendezvous), restarted up to `restarts` times,
    each rank's stderr in logs/<run>/attempt_<n>/<rank>/stderr.log."""
    return [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "--log-dir", str(logs), "--redirects", "2", *VIT, "--workdir", str(workdir), *RUN]


def run_with(planned: str, cmd: list[str]) -> str:
    """torchrun's stderr after `cmd` ran with VITCLI_FAULTS=planned and exited 0 (whatever is left
    running of it SIGKILLed on the way out)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**ENV, faults.ENV: planned}, start_new_session=True)
    try:
        err = proc.communicate(timeout=240)[1]
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return err


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run never interrupted, on the same 2 ranks."""
    workdir = tmp_path_factory.mktemp("straight") / "run"
    run_with("", two(workdir, 0, workdir.parent / "logs"))
    return workdir


def rank_log(logs: Path, attempt: int, rank: int) -> str:
    """What the rank wrote to stderr in that attempt, its blanks as one space (the console wraps
    its lines at 80 columns)."""
    (found,) = logs.glob(f"*/attempt_{attempt}/{rank}/stderr.log")
    return " ".join(found.read_text().split())


def same_run(workdir: Path, straight: Path) -> None:
    """Bit-identical weights, and metrics.jsonl's train rows each step once with the straight run's
    losses."""
    a, b = weights(straight), weights(workdir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [row["step"] for row in read_metrics(workdir / METRICS_FILE) if "train/loss" in row]
    assert steps == list(range(1, 17)), steps
    assert losses(workdir) == losses(straight)


def seconds_of_day(clock: str) -> float:
    """HH:MM:SS[.frac] as seconds."""
    h, m, sec = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def local_seconds(unix: float) -> float:
    """A time.time() as seconds of the local day (the clock of torchrun's and the console's
    lines)."""
    t = datetime.datetime.fromtimestamp(unix)
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6


def test_a_killed_a_hung_and_a_crashed_rank_are_each_restarted_and_the_run_ends_bit_identical(
        tmp_path, straight):
    """Three faults, three restarts by torchrun (--max-restarts 3), one run:

    - rank 1 SIGKILLed after step 5 (an OOM kill, a lost node): torchrun reports exit -9;
    - rank 1 asleep before step 10's agreement all-reduce, rank 0 waiting in it: each rank's
      watchdog fires at its bound (3 s, the floor: steps take milliseconds here), writes a line
      naming its rank and step, then every thread's stack (rank 1's names the sleeping frame, rank
      0's the all-reduce), and exits 75;
    - rank 0 raising after step 13 (a bug, a bad node): exit 1.

    Each time every rank comes back and resumes from the last checkpoint (steps 4, 8, 12); each
    fault fires once; the weights, and metrics.jsonl's rows (each step once), are the straight
    run's. Measured for the hang: from its start (its fault record's time) to torchrun seeing exit
    75, within BACKSTOP x the bound (the Python thread's exit, not faulthandler's backstop), and to
    the restarted run's first line (its start-up done)."""
    workdir, logs = tmp_path / "run", tmp_path / "logs"
    err = run_with("kill@5:rank=1,hang@10:rank=1,crash@13:rank=0", two(workdir, 3, logs))
    # torchrun names one failure per attempt, the first by its clock (whole seconds): after the
    # kill, rank 0's own exit 1 (its peer gone) may be the one named; after the hang, either
    # rank's 75
    failed = FAILED.findall(err)
    codes = [code for _, code, _ in failed]
    assert len(codes) == 3 and codes[0] in ("-9", "1") and codes[1:] == ["75", "1"], err[-3000:]
    fired = [json.loads(line) for line in (workdir / faults.FIRED_FILE).read_text().splitlines()]
    assert [f["fault"] for f in fired] == ["kill@5:rank=1", "hang@10:rank=1", "crash@13:rank=0"]
    for attempt, step in enumerate((4, 8, 12), 1):
        assert re.search(rf"resuming from .*? at step {step} ", rank_log(logs, attempt, 0)), attempt

    hung, waiting = rank_log(logs, 1, 1), rank_log(logs, 1, 0)
    said = r"rank 1: step 10 has run [\d.]+ s, past its bound of 3\.0 s"
    assert re.search(said, hung), hung[-3000:]
    assert " in hang_forever" in hung and " in _agree" in waiting and " in all_reduce" in waiting
    assert "rank 0: step 10 has run" in waiting
    assert "injected crash after step 13 on rank 0" in rank_log(logs, 2, 0)
    same_run(workdir, straight)

    began = local_seconds(fired[1]["time"])
    detected = (seconds_of_day(failed[1][0]) - began) % 86400
    back = re.search(r"\[(\d\d:\d\d:\d\d)\]", rank_log(logs, 2, 0)).group(1)
    restarted = (seconds_of_day(back) - began) % 86400  # to the second: the console's clock
    print(f"\nbound {FLOOR_S:g} s: exit 75 seen by torchrun {detected:.2f} s after the hang "
          f"began; the restarted run's first line {restarted:.0f} s after it")
    assert FLOOR_S * 0.9 <= detected < BACKSTOP * FLOOR_S, detected
