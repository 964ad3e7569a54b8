"""`--slurm`: the batch script and the frozen recipe written into WORKDIR/slurm, then `sbatch`; the
job id back. With --dry-run the script is printed, after the same refusals, and nothing is written
or submitted."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from vitcli.cluster.slurm import Job, batch_script, log_pattern, script_path, slurm_dir
from vitcli.errors import ClusterError, OutputError
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_dir import finished
from vitcli.runtime.run_files import POINTS_FILE, RECIPE_FILE
from vitcli.runtime.workdir import refuse_single_run


def submit(recipe: Recipe, workdir: Path, args: tuple[str, ...] = (), points: list[str] | None = None,
           dry_run: bool = False) -> dict | None:
    """Submit `vit <recipe.stage>` of `workdir` (a sweep's `points`, one array task each) to SLURM;
    returns the job id, the script and the log. `args` are the command's own flags the job passes
    on."""
    workdir = workdir.absolute()
    job = Job(recipe.stage, tuple(args), workdir, Path.cwd(), sys.executable, len(points or []))
    written = f"`vit {recipe.stage} --slurm` on {time.strftime('%Y-%m-%d %H:%M')}"
    text = batch_script(recipe.slurm, job, written)
    # before the dry run's script: --dry-run refuses what the submission would
    if not points and finished(workdir) is not None:
        raise OutputError(f"{workdir} holds a finished run: nothing to submit (a new --workdir trains again)")
    if points:
        refuse_single_run(workdir)
    if dry_run:
        sys.stdout.write(text)
        return None
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ClusterError("--slurm: sbatch is not on PATH (submit from the cluster's login node); "
                           "--dry-run prints the batch script")
    here = slurm_dir(workdir)
    write_text(here / RECIPE_FILE, to_yaml(recipe))
    if points:
        write_text(here / POINTS_FILE, "".join(f"{p}\n" for p in points))
    script = script_path(workdir)
    write_text(script, text)
    script.chmod(0o755)
    done = subprocess.run([sbatch, "--parsable", str(script)], check=False, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise ClusterError(f"sbatch refused {script}: {_last_line(done.stderr)}")
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "<id>" or "<id>;<cluster>"
    return _report(job_id, script, job)


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
