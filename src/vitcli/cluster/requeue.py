"""What a SLURM job of a run does when its step ends: finished, requeued to resume, cancelled, or
failed; and one line per attempt in WORKDIR/slurm/attempts.jsonl, which the next attempt reads.

The batch script (cluster/slurm.py) runs `python -m vitcli.cluster.requeue begin RUN` before its
step and `... end RUN --rc RC --signal SIG --log LOG --exits DIR` after it. Torch-free and quick: it
runs inside the time limit's lead, or within KillWait after a SIGTERM.

What stopped the step (`stop_kind`): SLURM's warning (USR2: the time limit is near); a SIGTERM,
told apart by the job's own record (`ended_by`: `scontrol show job` and the line slurmstepd writes
into the job's log): a user's `scancel` ("cancel"), a preemption ("preemption"; SLURM may have
requeued the job itself, PreemptMode=REQUEUE, which Restarts shows), the time limit itself; or no
signal: a rank that hung (the watchdog's errors.HUNG_EXIT_CODE) or was killed by SIGKILL (the
kernel's OOM killer, a node in trouble), else a crash. torchrun says 1 for all three, and srun the
highest code of its tasks (143 for the nodes it stopped, measured on slurm-wlm 22.05): so each
node's launch (cluster/launch.py) writes the cause it found into a folder of this attempt
(EXITS_ENV), and the rules read the cause from there (`cause`), the step's code only without one.

The rules (`decide`): a finished run is never requeued; a cancel ends the job (its checkpoint
stays: `sbatch slurm/job.sh` resumes); a crash is a failure (requeueing a bug would crash again);
a hang or a SIGKILL is requeued at most slurm.max_restarts times; a time limit at most
slurm.max_requeues times (submitit: 3; a week-long run on a 24-hour partition needs 7); a
preemption always (the cluster's doing, not the run's). But a stop with no checkpoint moved forward
since the job started, after an attempt that moved none either, is not requeued again: the same
failure twice is not requeued forever (a time limit shorter than the start-up and a step, a crash
that recurs at the same step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vitcli.errors import HUNG_EXIT_CODE
from vitcli.runtime import run_dir
from vitcli.runtime.files import write_text
from vitcli.runtime.run_files import ATTEMPTS_FILE, SLURM_DIR

KILLED_EXIT_CODE = 128 + 9  # a rank killed by SIGKILL, as cluster/launch.py and the shell report it
# where each node's launch writes the exit code it found (node<SLURM_NODEID>): the batch script
# sets it to a folder of the attempt in RUN/slurm, which `end` reads and removes
EXITS_ENV = "VITCLI_EXITS_DIR"
# what stopped a step, by kind: those the rules may requeue, and what each is called in a line
RESTARTS = {"hang": f"a rank hung (exit {HUNG_EXIT_CODE}, the watchdog's)",
            "kill": "a rank was killed by SIGKILL (out of memory, or its node)"}
# slurmstepd's line in the job's log when the controller ends the job: "*** JOB 12 ON node1
# CANCELLED AT 2026-11-29T06:34:20 DUE TO PREEMPTION ***" (no reason after a user's scancel)
_ENDED = re.compile(r"\*\*\* JOB (\S+) ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))? \*\*\*")


@dataclass(frozen=True)
class Outcome:
    """What the job does now: `done`, `requeue`, `cancel` or `fail`, the line that says why, and what
    stopped the step (stop_kind)."""

    action: str
    why: str
    stop: str = ""


def stop_kind(rc: int, signal: str, ended: str = "") -> str:
    """What stopped the step: "time limit", "preemption", "cancel", "hang", "kill" or "crash".
    `ended`: what the job's record says of a SIGTERM (ended_by): "" (the job still runs: a signal
    that did not end it, as a preemption's grace time sends), "requeued", "preempted", "timeout",
    "cancelled"."""
    if signal == "USR2":
        return "time limit"
    if signal:
        return {"cancelled": "cancel", "timeout": "time limit"}.get(ended, "preemption")
    return {HUNG_EXIT_CODE: "hang", KILLED_EXIT_CODE: "kill"}.get(rc, "crash")


def decide(rc: int, signal: str, finished: bool, progress: bool, history: list[dict],
           max_requeues: int, max_restarts: int = 2, ended: str = "") -> Outcome:
    """The requeue rules (module docstring). `history`: the earlier attempts' records, oldest
    first."""
    kind = stop_kind(rc, signal, ended)
    if finished:
        return Outcome("done", "the run is finished", kind)
    if rc == 0 and not signal:  # a search's trial pruned: its run stops unfinished, its task done
        return Outcome("done", "the command succeeded (a search's trial that was pruned stops "
                               "unfinished)", "")
    if kind == "cancel":
        return Outcome("cancel", "the job was cancelled (scancel): not requeued; its checkpoint stays, and "
                                 "sbatch of its slurm/job.sh resumes the run", kind)
    if kind == "crash":
        return Outcome("fail", f"the run exited {rc} without a signal from SLURM: not requeued (a crash "
                               "would crash again); fix it and sbatch the script again", kind)
    if kind != "preemption" and not progress and history and not history[-1].get("progress", True):
        return Outcome("fail", "no checkpoint moved forward in this attempt nor the one before: not "
                               "requeued again (is the time limit shorter than the start-up and a step? "
                               "does the run fail at the same step each time?)", kind)
    if kind in RESTARTS:
        spent = sum(1 for a in history if a.get("stop") in RESTARTS and a.get("action") == "requeue")
        if spent >= max_restarts:
            return Outcome("fail", f"{RESTARTS[kind]}; slurm.max_restarts={max_restarts} restarts are spent: "
                                   "not requeued; read the log, then sbatch the script again", kind)
        return Outcome("requeue", f"{RESTARTS[kind]}: requeued (restart {spent + 1} of {max_restarts}), the "
                                  "run resumes from its last checkpoint", kind)
    timeouts = sum(1 for a in history if _timed_out(a) and a.get("action") == "requeue")
    if kind == "time limit" and timeouts >= max_requeues:
        return Outcome("fail", f"the time limit came {timeouts + 1} times: slurm.max_requeues={max_requeues} "
                               "requeues are spent; sbatch the script again to go on", kind)
    why = "the time limit is near" if kind == "time limit" else "SLURM stopped the job (preemption)"
    return Outcome("requeue", f"{why}: requeued, the run resumes from its last checkpoint", kind)


def _timed_out(record: dict) -> bool:
    """A record of a time limit (a record written before `stop` existed: its signal USR2)."""
    return record.get("stop", "time limit" if record.get("signal") == "USR2" else "") == "time limit"


def cause(codes: list[int]) -> int:
    """The exit code that says why ranks stopped, from every failed rank's (or node's) code, as a
    shell gives them (128 + a signal's number) or torchrun does (minus the signal's number): a hang
    (75) first, then a SIGKILL (137), then a rank's own failure (below 128), else the first code.
    A hang or a kill first, because a bug follows from them and not the other way round: a rank
    whose peer was SIGKILLed fails in its next collective with an error of its own (exit 1), while
    a bug's peers are stopped by torchrun (SIGTERM, 143) or time out in the watchdog. A bug taken
    for a kill costs at most slurm.max_restarts requeues, and the no-progress rule stops it sooner."""
    shell = [128 - c if c < 0 else c for c in codes]
    for wanted in (HUNG_EXIT_CODE, KILLED_EXIT_CODE):
        if wanted in shell:
            return wanted
    own = [c for c in shell if 0 < c < 128]
    return own[0] if own else (shell[0] if shell else 1)


def node_exits(folder: Path | None) -> list[int]:
    """The codes each node's launch wrote into `folder` (EXITS_ENV); [] without any."""
    if folder is None or not folder.is_dir():
        return []
    return [int(p.read_text().strip()) for p in sorted(folder.glob("node*")) if p.read_text().strip()]


def attempts(workdir: Path) -> list[dict]:
    """Every attempt's record, oldest first (WORKDIR/slurm/attempts.jsonl)."""
    path = workdir / SLURM_DIR / ATTEMPTS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(workdir: Path, records: list[dict]) -> None:
    write_text(workdir / SLURM_DIR / ATTEMPTS_FILE, "".join(json.dumps(r) + "\n" for r in records))


def begin(workdir: Path) -> dict:
    """Record this attempt's start: the job, how often SLURM restarted it, the step it starts
    from."""
    record = {"job": _job_id(), "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
              "host": os.uname().nodename, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "from_step": run_dir.newest_step(workdir)}
    _write(workdir, [*attempts(workdir), record])
    return record


def end(workdir: Path, rc: int, signal: str, max_requeues: int, max_restarts: int = 2,
        log: Path | None = None, exits: Path | None = None) -> Outcome:
    """Decide, record the outcome in this attempt's line, and requeue the job if that is the
    decision (unless SLURM requeued it itself). `rc`: the step's exit code; `exits`: the folder
    where each node's launch wrote the cause it found (removed here)."""
    found = node_exits(exits)
    if exits is not None:
        shutil.rmtree(exits, ignore_errors=True)
    ranks_rc = cause(found) if found else rc
    records = attempts(workdir) or [begin(workdir)]
    current, history = records[-1], records[:-1]
    step = run_dir.newest_step(workdir)  # by name alone: verifying one would import torch (seconds)
    progress = step > int(current.get("from_step", 0))
    done = run_dir.finished(workdir) is not None
    ended = ended_by(log, int(current.get("restart", 0))) if signal == "TERM" else ""
    outcome = decide(ranks_rc, signal, done, progress, history, max_requeues, max_restarts, ended)
    current.update({"ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "rc": rc, "ranks_rc": ranks_rc,
                    "signal": signal,
                    "stop": outcome.stop, "to_step": step, "progress": progress, "action": outcome.action,
                    "why": outcome.why})
    _write(workdir, records)
    if outcome.action == "requeue" and ended != "requeued":
        done = subprocess.run(["scontrol", "requeue", _job_id()], check=False, capture_output=True,
                              text=True)
        if done.returncode != 0:
            why = f"scontrol requeue {_job_id()} failed: {done.stderr.strip()}"
            return Outcome("fail", why, outcome.stop)
    return outcome


def ended_by(log: Path | None, restart: int) -> str:
    """What the job's record says after a SIGTERM: "requeued" (SLURM requeued it itself: its
    Restarts count passed this attempt's), "" (it still runs: the signal did not end it), else
    why the controller ended it, from slurmstepd's line in the job's `log`: "preempted", "timeout"
    or "cancelled" (a user's scancel, which gives no reason; also where no line is found: a job
    that cannot tell is stopped rather than requeued against its user's will). SLURM 22.05's
    `scontrol show job` says COMPLETING for all three until the job's processes, this one among
    them, have ended."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", os.environ.get("SLURM_JOB_ID", "")],
                           check=False, capture_output=True, text=True).stdout
    state, restarts = re.search(r"\bJobState=(\S+)", shown), re.search(r"\bRestarts=(\d+)", shown)
    if restarts and int(restarts[1]) > restart:
        return "requeued"
    if state and state[1] in ("RUNNING", "SUSPENDED"):
        return ""
    reason = ended_reason(_tail(log), os.environ.get("SLURM_JOB_ID", ""), _job_id())
    return {"PREEMPTION": "preempted", "TIME LIMIT": "timeout"}.get(reason or "", "cancelled")


def ended_reason(text: str, *job: str) -> str | None:
    """The reason in slurmstepd's last "*** JOB <job> ... CANCELLED AT ... ***" line of `text` (the
    job named by any of `job`: an array task has its own id and <array job>_<task>): "PREEMPTION",
    "TIME LIMIT", ... "" without one (a user's scancel); None without the line."""
    found = [m for m in _ENDED.finditer(text) if m[1] in job]
    return (found[-1][2] or "") if found else None


def _tail(log: Path | None, size: int = 1 << 16) -> str:
    """The last `size` bytes of the job's log, as text ("" when it cannot be read)."""
    try:
        with open(log or "", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _job_id() -> str:
    """This job's id for scontrol: an array task as <array job>_<task>."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


def main(argv: list[str] | None = None) -> int:
    """`python -m vitcli.cluster.requeue begin|end RUN [--rc N --signal SIG --max-requeues N
    --max-restarts N --log LOG]`: the batch script's two calls. Exit 0 when finished, requeued or
    cancelled, else the step's exit code (1 if it was 0)."""
    parser = argparse.ArgumentParser(prog="python -m vitcli.cluster.requeue")
    parser.add_argument("when", choices=("begin", "end"))
    parser.add_argument("run", type=Path)
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="")
    parser.add_argument("--max-requeues", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--log", type=Path, default=None)
    parser.add_argument("--exits", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.when == "begin":
        record = begin(args.run)
        sys.stderr.write(f"vit: job {record['job']} (restart {record['restart']}) starts {args.run} at step "
                         f"{record['from_step']}\n")
        return 0
    outcome = end(args.run, args.rc, args.signal, args.max_requeues, args.max_restarts, args.log, args.exits)
    sys.stderr.write(f"vit: {outcome.why}\n")
    return 0 if outcome.action != "fail" else (args.rc or 1)


if __name__ == "__main__":
    sys.exit(main())
