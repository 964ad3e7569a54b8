"""`--slurm`: the batch script and the frozen recipe written into WORKDIR/slurm, then `sbatch`; the
job id back. With --dry-run the script is printed, after the same refusals, and nothing is written
or submitted.

Refused before anything is written: a finished run or a finished sweep (nothing to train), and a
workdir whose last submitted job (WORKDIR/slurm/job_id) squeue still lists as queued or running
(two jobs would train the same run at once). Said, not refused: slurm.cpus_per_task left at 0 (the
partition's default CPUs, often one, for every rank and loader) and a time limit that leaves little
room before the warning. Nothing half-written: the job is submitted held with the script on sbatch's
stdin, and only once sbatch took it are its files written and the job released; a refusal leaves
the workdir as it was.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from vitcli.cluster.slurm import Job, batch_script, log_pattern, script_path, slurm_dir
from vitcli.errors import ClusterError, OutputError
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_seconds
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_dir import finished
from vitcli.runtime.run_files import JOB_ID_FILE, POINTS_FILE, RECIPE_FILE
from vitcli.runtime.workdir import refuse_single_run

# a job segment shorter than this before the warning is said to be short at submit time: start-up
# (imports, data, rendezvous, a compile) takes a minute or more on a cluster, then a step and a
# checkpoint must fit; --preflight measures them
SHORT_SEGMENT_S = 600
# squeue's states of a job that has ended: any other (PENDING, RUNNING, COMPLETING, SUSPENDED,
# REQUEUED, ...) still holds the workdir
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY", "SPECIAL_EXIT", "REVOKED"}


def submit(recipe: Recipe, workdir: Path, args: tuple[str, ...] = (), points: list[str] | None = None,
           dry_run: bool = False, index_flag: str = "--sweep-point") -> dict | None:
    """Submit `vit <recipe.stage>` of `workdir` (a sweep's `points`, or a search's trial slots, one
    array task each, told its index by `index_flag`) to SLURM; returns the job id, the script and
    the log. `args` are the command's own flags the job passes on."""
    given, workdir = workdir, workdir.absolute()
    job = Job(recipe.stage, tuple(args), workdir, Path.cwd(), sys.executable, len(points or []), index_flag)
    written = f"`vit {recipe.stage} --slurm` on {time.strftime('%Y-%m-%d %H:%M')}"
    text = batch_script(recipe.slurm, job, written)
    # before the dry run's script: --dry-run refuses what the submission would
    refuse_finished(workdir, points)
    if points:
        refuse_single_run(workdir)
    refuse_queued(workdir)
    sbatch = shutil.which("sbatch")
    if sbatch is None and not dry_run:
        raise ClusterError("--slurm: sbatch is not on PATH (submit from the cluster's login node); "
                           "--dry-run prints the batch script")
    for line in advice(recipe):
        sys.stderr.write(f"warning: {line}\n")  # one line each, unwrapped: a log keeps them whole
    if dry_run or sbatch is None:
        sys.stdout.write(text)
        _list_points(given, points or [], "search" if index_flag == "--search-task" else "sweep")
        return None
    job_id = _sbatch_held(sbatch, text, workdir)
    here = slurm_dir(workdir)
    write_text(here / RECIPE_FILE, to_yaml(recipe))
    if points:
        write_text(here / POINTS_FILE, "".join(f"{p}\n" for p in points))
    script = script_path(workdir)
    write_text(script, text)
    script.chmod(0o755)
    write_text(here / JOB_ID_FILE, f"{job_id}\n")
    released = subprocess.run(["scontrol", "release", job_id], check=False, capture_output=True, text=True)
    if released.returncode != 0:
        raise ClusterError(f"job {job_id} is submitted but held: scontrol release {job_id} failed "
                           f"({_last_line(released.stderr)}); run it when SLURM answers")
    return _report(job_id, script, job)


def refuse_finished(workdir: Path, points: list[str] | None) -> None:
    """A finished run, or a sweep whose every point is finished: nothing to submit."""
    if not points and finished(workdir) is not None:
        raise OutputError(f"{workdir} holds a finished run: nothing to submit (a new --workdir trains again)")
    if points and all(finished(workdir / p) is not None for p in points):
        raise OutputError(f"{workdir} holds a finished sweep (its {len(points)} points): nothing to submit "
                          "(a new --workdir trains again)")


def refuse_queued(workdir: Path) -> None:
    """The workdir's last submitted job, while squeue lists it as queued or running: a second job
    would train the same run at the same time. A job that ended, or one SLURM no longer knows, is no
    obstacle; without squeue (a dry run off the cluster) nothing can be asked."""
    recorded = slurm_dir(workdir) / JOB_ID_FILE
    squeue = shutil.which("squeue")
    if not recorded.is_file() or squeue is None:
        return
    job_id = recorded.read_text().strip()
    asked = subprocess.run([squeue, "-h", "-j", job_id, "-o", "%T"], check=False, capture_output=True,
                           text=True)
    if asked.returncode != 0 and "Invalid job id" in asked.stderr:
        return
    if asked.returncode != 0:
        raise ClusterError(f"--slurm: cannot tell whether job {job_id}, submitted for {workdir}, still "
                           f"runs: squeue says {_last_line(asked.stderr)}")
    alive = sorted({s for s in asked.stdout.split() if s not in ENDED})
    if alive:
        raise OutputError(f"{workdir}: job {job_id} is still {'/'.join(alive).lower()} for it; a second job "
                          f"would train the same run at once: wait for it to end, or scancel {job_id} first")


def advice(recipe: Recipe) -> list[str]:
    """What the submission says without refusing: CPUs left to the partition's default, a short
    time limit."""
    cfg, out = recipe.slurm, []
    procs, workers = procs_per_node(cfg), recipe.data.num_workers
    if not cfg.cpus_per_task and procs * (workers + 1) > 1:  # one CPU is enough for one process alone
        out.append(f"slurm.cpus_per_task=0: each node's {procs} process(es) and their loader workers "
                   f"(data.num_workers={workers}) get the partition's default CPUs, often one; set "
                   f"slurm.cpus_per_task, e.g. {procs * (workers + 1)} (a CPU per process and per worker)")
    limit = time_limit_seconds(cfg.time)
    if limit and limit - cfg.signal_seconds < SHORT_SEGMENT_S:
        out.append(f"slurm.time={cfg.time} leaves {limit - cfg.signal_seconds} s before the warning "
                   f"(slurm.signal_seconds={cfg.signal_seconds}) for the start-up, a step and a "
                   "checkpoint; an attempt that writes none requeues without progress until the job "
                   "fails: --preflight measures the start-up and the step, and says the limit that works")
    return out


def _sbatch_held(sbatch: str, text: str, workdir: Path) -> str:
    """The script submitted held (`--hold`, on stdin: no file written yet); its job id."""
    done = subprocess.run([sbatch, "--parsable", "--hold"], input=text, check=False, capture_output=True,
                          text=True, cwd=Path.cwd())
    if done.returncode != 0:
        raise ClusterError(f"sbatch refused the job for {workdir}: {_last_line(done.stderr)}; nothing "
                           "was written (--dry-run prints the script)")
    return done.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"


def _list_points(workdir: Path, points: list[str], what: str = "sweep") -> None:
    """A dry run's sweep (or search): its points on stderr, each an array task (as the sweep's
    --dry-run lists them)."""
    if not points:
        return
    sys.stderr.write(f"# {what}: {len(points)} points as a job array, task i running point i, each its "
                     f"own run in {workdir}/<point>\n")
    for i, point in enumerate(points):
        sys.stderr.write(f"#   {i}: {point}\n")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def _report(job_id: str, script: Path, job: Job) -> dict:
    log = str(log_pattern(job)).replace("%j", job_id).replace("%A", job_id).replace("%a", "<task>")
    what = f"{job.points} points as a job array" if job.points else "1 run"
    stdout.print(f"submitted job {job_id} ({what}): {script}\n  log: {log}\n  watch: squeue -j {job_id}; "
                 f"tail -f {log}")
    return {"job_id": job_id, "script": str(script), "log": log, "workdir": str(job.workdir),
            "points": job.points}
