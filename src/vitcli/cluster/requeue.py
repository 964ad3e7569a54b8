"""What a SLURM job of a run does when its step ends: finished, requeued to resume, or failed; and
one line per attempt in WORKDIR/slurm/attempts.jsonl, which the next attempt reads.

The batch script (cluster/slurm.py) runs `python -m vitcli.cluster.requeue begin RUN` before its
step and `... end RUN --rc RC --signal SIG` after it. Torch-free and quick: it runs inside the time
limit's lead.

The rules (`decide`): a finished run is never requeued; a step that failed with no signal from SLURM
is a failure (requeueing a crash would crash again); a stop SLURM asked for is requeued, after a
time limit at most slurm.max_requeues times (submitit: 3; a week-long run on a 24-hour partition
needs 7), after a preemption always (the cluster's doing, not the run's); but a time limit met with
no checkpoint moved forward since the job started is requeued once, and not a second time in a row:
the same failure twice is not requeued forever (a time limit shorter than the start-up and a step,
say).

A preemption's SIGTERM reaches every process of the job, srun included, and srun answers it by
killing the step at once: the ranks get no time to write a checkpoint, and the run resumes from its
last periodic one (run.ckpt_every, run.ckpt_every_minutes). A cluster with
PreemptParameters=send_user_signal sends the warning (USR2) at preemption instead, and the run
checkpoints at its next step as before a time limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vitcli.runtime import run_dir
from vitcli.runtime.files import write_text
from vitcli.runtime.run_files import ATTEMPTS_FILE, SLURM_DIR


@dataclass(frozen=True)
class Outcome:
    """What the job does now: `done`, `requeue` or `fail`, and the line that says why."""

    action: str
    why: str


def decide(rc: int, signal: str, finished: bool, progress: bool, history: list[dict],
           max_requeues: int) -> Outcome:
    """The requeue rules (module docstring). `history`: the earlier attempts' records, oldest
    first."""
    if finished:
        return Outcome("done", "the run is finished")
    if not signal:
        return Outcome("fail", f"the run exited {rc} without a signal from SLURM: not requeued (a crash "
                               "would crash again); fix it and sbatch the script again")
    if signal == "USR2" and not progress and history and not history[-1].get("progress", True):
        return Outcome("fail", "no checkpoint moved forward in this attempt nor the one before: not "
                               "requeued again (is the time limit shorter than the start-up and a step?)")
    timeouts = sum(1 for a in history if a.get("signal") == "USR2" and a.get("action") == "requeue")
    if signal == "USR2" and timeouts >= max_requeues:
        return Outcome("fail", f"the time limit came {timeouts + 1} times: slurm.max_requeues={max_requeues} "
                               "requeues are spent; sbatch the script again to go on")
    why = "the time limit is near" if signal == "USR2" else "SLURM stopped the job (preemption)"
    return Outcome("requeue", f"{why}: requeued, the run resumes from its last checkpoint")


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


def end(workdir: Path, rc: int, signal: str, max_requeues: int) -> Outcome:
    """Decide, record the outcome in this attempt's line, and requeue the job if that is the
    decision."""
    records = attempts(workdir) or [begin(workdir)]
    current, history = records[-1], records[:-1]
    step = run_dir.newest_step(workdir)  # by name alone: verifying one would import torch (seconds)
    progress = step > int(current.get("from_step", 0))
    done = run_dir.finished(workdir) is not None
    outcome = decide(rc, signal, done, progress, history, max_requeues)
    current.update({"ended": time.strftime("%Y-%m-%dT%H:%M:%S"), "rc": rc, "signal": signal,
                    "to_step": step, "progress": progress, "action": outcome.action, "why": outcome.why})
    _write(workdir, records)
    if outcome.action == "requeue":
        done = subprocess.run(["scontrol", "requeue", _job_id()], check=False, capture_output=True,
                              text=True)
        if done.returncode != 0:
            return Outcome("fail", f"scontrol requeue {_job_id()} failed: {done.stderr.strip()}")
    return outcome


def _job_id() -> str:
    """This job's id for scontrol: an array task as <array job>_<task>."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID", "")


def main(argv: list[str] | None = None) -> int:
    """`python -m vitcli.cluster.requeue begin|end RUN [--rc N --signal SIG --max-requeues N]`: the
    batch script's two calls. Exit 0 when finished or requeued, else the step's exit code (1 if it
    was 0)."""
    parser = argparse.ArgumentParser(prog="python -m vitcli.cluster.requeue")
    parser.add_argument("when", choices=("begin", "end"))
    parser.add_argument("run", type=Path)
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--signal", default="")
    parser.add_argument("--max-requeues", type=int, default=0)
    args = parser.parse_args(argv)
    if args.when == "begin":
        record = begin(args.run)
        sys.stderr.write(f"vit: job {record['job']} (restart {record['restart']}) starts {args.run} at step "
                         f"{record['from_step']}\n")
        return 0
    outcome = end(args.run, args.rc, args.signal, args.max_requeues)
    sys.stderr.write(f"vit: {outcome.why}\n")
    return 0 if outcome.action != "fail" else (args.rc or 1)


if __name__ == "__main__":
    sys.exit(main())
