"""run.memory_budget_mb holds for the whole run on a CPU: a `vit pretrain` with
data.micro_batch_size=auto, a loader worker and a held-out pass every step is watched from outside
(/proc: the `vit` process's resident memory plus each child's own, USS, every few ms), and what it
measures stays within the figures the search judged the budget by; summary.json's peak is the
kernel's high-water mark of the process; and under a budget at those figures, measured here, the
whole run stays within it. (A budget under the floor: test_micro_batch_auto.py.)"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitcli.runtime.run_files import SUMMARY_FILE

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.img_size=64", "model.patch_size=4", "model.embed_dim=64", "model.depth=2", "model.num_heads=2",
        "model.mlp_dim=128", "data.synthetic.num_classes=4", "data.synthetic.train_size=98",
        "data.synthetic.val_size=16", "data.synthetic.img_size=32", "data.test_split=",
        "data.num_workers=1", "data.eval_batch_size=16",
        # 5: the candidates are 1 and 5, so a search is two trials
        "data.batch_size=5", "schedule.steps=2", "schedule.warmup_steps=1", "run.ckpt_every=1",
        "run.eval_every=1", "run.precision=fp32", "run.compile=false"]
TRIAL = re.compile(r"micro-batch (\d+): the run (\d+) MiB .*?, the search (\d+)")


def _mb(pid: int, name: str, field: str) -> float | None:
    """A `Field: N kB` line of /proc/PID/NAME in MiB; None once the process has gone."""
    try:
        text = Path(f"/proc/{pid}/{name}").read_text()
    except OSError:
        return None
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else None


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        try:
            kids = [int(c) for t in Path(f"/proc/{todo.pop()}/task").iterdir()
                    for c in (t / "children").read_text().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def _own(pid: int) -> float:
    """A child's own memory (USS): the pages no other process maps."""
    clean, dirty = _mb(pid, "smaps_rollup", "Private_Clean"), _mb(pid, "smaps_rollup", "Private_Dirty")
    return (clean or 0.0) + (dirty or 0.0)


def watched_vit(workdir: Path, *args) -> dict:
    """`vit pretrain ARGS` watched until it exits: its stderr, exit code, the largest sum of its
    resident memory and its children's own (while trials ran, and after), and its VmHWM just before
    and just after summary.json appeared."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "COLUMNS": "2000"}
    cmd = [sys.executable, "-m", "vitcli", "pretrain", "--workdir", str(workdir), *TINY, *map(str, args)]
    seen = {"search": 0.0, "run": 0.0, "hwm_before": 0.0, "hwm_after": None, "workdir": workdir}
    with open(workdir.with_suffix(".log"), "w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
        while proc.poll() is None:
            rss, hwm = _mb(proc.pid, "status", "VmRSS"), _mb(proc.pid, "status", "VmHWM")
            kids = _descendants(proc.pid)
            trials = any(b"vitcli.run.trial" in _cmdline(k) for k in kids)
            if rss and hwm:  # None or 0 once the process is leaving
                total = rss + sum(_own(k) for k in kids)
                phase = "search" if trials else "run"
                seen[phase] = max(seen[phase], total)
                if (workdir / SUMMARY_FILE).exists():
                    seen["hwm_after"] = seen["hwm_after"] or hwm
                else:
                    seen["hwm_before"] = hwm
            time.sleep(0.005)
        log.seek(0)
        seen.update(code=proc.returncode, err=log.read())
    return seen


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture(scope="module")
def generous(tmp_path_factory) -> dict:
    """An auto run under a budget everything fits, watched."""
    return watched_vit(tmp_path_factory.mktemp("generous") / "run", "data.micro_batch_size=auto",
                       "run.memory_budget_mb=8000")


def _figures(seen: dict) -> tuple[dict, int, int]:
    """({micro-batch: (the run's figure, the search's)} as the log says, the chosen micro-batch, and
    the most it said the run holds with it."""
    trials = {int(m): (int(run), int(search)) for m, run, search in TRIAL.findall(seen["err"])}
    chosen = re.search(r"auto -> (\d+) \(.*?: at most (\d+) MiB", seen["err"])
    return trials, int(chosen.group(1)), int(chosen.group(2))


def test_an_auto_run_stays_within_what_its_search_counted_and_reports_its_true_peak(generous):
    seen = generous
    assert seen["code"] == 0, seen["err"][-3000:]
    trials, chosen, _ = _figures(seen)
    assert set(trials) == {1, 5} and chosen == 5, seen["err"]  # 8000 MiB: the whole batch fits
    # the training process, its loader worker and the held-out pass's (every step), from outside:
    # within the run's figure for the chosen micro-batch; the search (this process and a trial's)
    # within the search's figures. So a budget at those figures is never passed.
    assert 0 < seen["run"] <= trials[chosen][0], (seen, trials)
    assert 0 < seen["search"] <= max(search for _, search in trials.values()), (seen, trials)
    summary = json.loads((seen["workdir"] / SUMMARY_FILE).read_text())
    # the kernel's high-water mark of the process when summary.json was written, not a sample of it
    # (read here every few ms: the figure lies between the last reading before the file appeared
    # and the first after it)
    assert seen["hwm_before"] - 1 <= summary["mem/main_peak_mb"] <= seen["hwm_after"] + 1, (summary, seen)
    assert summary["mem/run_peak_mb"] >= summary["mem/main_peak_mb"] and "mem/worker_peak_mb" in summary


def test_a_budget_at_what_the_search_measured_holds_for_every_process(generous, tmp_path):
    """The budget: what the generous run's search said the run holds at most, measured on this host
    now, and 5% for the figures' spread between runs (the interpreter's exit varies by ~30 MiB)."""
    assert generous["code"] == 0, generous["err"][-3000:]
    budget = math.ceil(_figures(generous)[2] * 1.05)
    seen = watched_vit(tmp_path / "run", "data.micro_batch_size=auto", f"run.memory_budget_mb={budget}")
    assert seen["code"] == 0, seen["err"][-3000:]
    _, chosen, most = _figures(seen)
    assert chosen in (1, 5) and most <= budget, seen["err"]
    assert 0 < max(seen["run"], seen["search"]) <= budget, (seen, budget)
