"""The batch script of a run on SLURM, as text: sbatch's lines from the recipe's slurm section, then
one task per node, each running torchrun (through cluster/launch.py, whose exit code says why ranks
failed) with c10d rendezvous on the first node's address (torchtitan's multinode_trainer.slurm
shape), and SLURM's warning before the time limit turned into a checkpoint and a requeue.

The signal path, end to end: `--signal=B:USR2@S` sends SIGUSR2 to this script's shell alone, S
seconds before the limit; its trap hands the signal to the step (srun forwards it to each node's
torchrun), and torchrun (asked by --signals-to-handle; torch 2.14 forwards only SIGTERM, SIGINT,
SIGHUP and SIGQUIT unless told) forwards it to every rank, and waits --shutdown-timeout for them (30
s by default: too short for a large checkpoint, so the whole lead is given). The ranks agree on the
step, write one checkpoint and exit 140 (train/interrupt.py). The shell then asks requeue.py, which
requeues the job or says why not.

A preemption's or a scancel's SIGTERM reaches every process of the job at once (slurmstepd signals
the whole step), then SIGKILL after the cluster's KillWait. srun answers SIGTERM by killing its step
(srun_job.c: SIGTERM -> SIGKILL to every task), so on one node the script runs torchrun itself,
without srun: torchrun and the ranks get the SIGTERM, and the ranks write a checkpoint within
KillWait. On several nodes srun is the only launcher, and the ranks get no time: the run resumes
from its last periodic checkpoint (docs/cluster.md says what to ask the cluster for).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from vitcli.cluster.requeue import EXITS_ENV
from vitcli.errors import OutputError
from vitcli.recipe.cluster_checks import check_one_line, control_character, procs_per_node
from vitcli.recipe.schema import SlurmConfig
from vitcli.runtime.run_files import (
    JOB_SCRIPT,
    POINTS_FILE,
    RECIPE_FILE,
    SLURM_ARRAY_LOG,
    SLURM_DIR,
    SLURM_LOG,
)

# torchrun's default list and the two signals SLURM's --signal sends (submitit: USR2; some sites:
# USR1)
FORWARDED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2"
# the rendezvous port is slurm.port + job id mod PORTS: two jobs on one first node differ
PORTS = 1000


@dataclass(frozen=True)
class Job:
    """What the batch script runs: `vit STAGE` with `args`, in `workdir`, from `cwd` (absolute
    paths)."""

    stage: str  # pretrain | finetune
    # the command's own flags beyond --recipe and --workdir (a sweep's, --task ...)
    args: tuple[str, ...]
    workdir: Path
    cwd: Path
    python: str  # the interpreter that submitted: the compute nodes run the same installation
    points: int = 0  # a sweep's number of points, each an array task; 0: one run
    # the option that tells an array task its index: a sweep's point, or a search's trial slot
    index_flag: str = "--sweep-point"


def slurm_dir(workdir: Path) -> Path:
    """Where a run's SLURM files live: WORKDIR/slurm."""
    return workdir / SLURM_DIR


def script_path(workdir: Path) -> Path:
    """The batch script, WORKDIR/slurm/job.sh: `sbatch` it again to resubmit."""
    return slurm_dir(workdir) / JOB_SCRIPT


def log_pattern(job: Job) -> Path:
    """sbatch's --output: WORKDIR/slurm/<job id>.out, or <array job>_<task>.out for a sweep."""
    return slurm_dir(job.workdir) / (SLURM_ARRAY_LOG if job.points else SLURM_LOG)


# what an #SBATCH value may hold unquoted: sbatch splits its lines at blanks, reads " and ' as
# quotes, \ as an escape and an unquoted # as the start of a comment (sbatch/opt.c, _get_argument)
_SBATCH_PLAIN = re.compile(r"[\w@%:,./+=&|!*()\[\]-]*")


def sbatch_value(text: str) -> str:
    """`text` as one argument of an #SBATCH line: as is when plain, else in double quotes, each
    backslash and double quote escaped (a path with a blank stays one --output, a partition cannot
    add an option)."""
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sbatch_lines(cfg: SlurmConfig, job: Job) -> list[str]:
    """The #SBATCH lines: resources from the recipe, the log in the workdir, the warning, requeue
    allowed; each value one argument to sbatch (sbatch_value), slurm.extra's lines as the recipe
    gives them."""
    v = sbatch_value
    opts = [f"--job-name={v(f'vit-{job.workdir.name}')}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    opts += [f"--gpus-per-node={cfg.gpus_per_node}"] if cfg.gpus_per_node else []
    opts += [f"--cpus-per-task={cfg.cpus_per_task}"] if cfg.cpus_per_task else []
    named = {"mem": cfg.mem, "partition": cfg.partition, "account": cfg.account, "time": cfg.time,
             "qos": cfg.qos, "constraint": cfg.constraint}
    opts += [f"--{name}={v(value)}" for name, value in named.items() if value]
    # append: a requeued job writes on in the same file, after what the first attempt wrote
    opts += [f"--output={v(str(log_pattern(job)))}", "--open-mode=append"]
    opts += [f"--signal=B:USR2@{cfg.signal_seconds}"] if cfg.signal_seconds else []
    opts += ["--requeue"]
    if job.points:
        limit = f"%{cfg.array_parallel}" if cfg.array_parallel else ""
        opts += [f"--array=0-{job.points - 1}{limit}"]
    return [f"#SBATCH {opt}" for opt in [*opts, *cfg.extra]]


def torchrun(cfg: SlurmConfig, job: Job) -> str:
    """One node's launch: torchrun (cluster/launch.py) with c10d rendezvous on the first node's
    address, every rank running `vit STAGE`."""
    q = shlex.quote
    command = [job.stage, "--recipe", str(slurm_dir(job.workdir) / RECIPE_FILE), "--workdir",
               str(job.workdir), *job.args]
    point = f' {job.index_flag} "$SLURM_ARRAY_TASK_ID"' if job.points else ""
    return (f'{q(job.python)} -m vitcli.cluster.launch --nnodes="$SLURM_JOB_NUM_NODES" '
            f'--nproc-per-node={procs_per_node(cfg)} --rdzv-backend=c10d --rdzv-endpoint="$HEAD_IP:$PORT" '
            f'--rdzv-id="$SLURM_JOB_ID" --signals-to-handle={FORWARDED} '
            f"--shutdown-timeout={max(cfg.signal_seconds, 30)} -m vitcli "
            f"{' '.join(q(a) for a in command)}{point}")


def batch_script(cfg: SlurmConfig, job: Job, written: str) -> str:
    """The whole script; `written` says when and by what (its header). No value may hold a control
    character (resolving the recipe refused one already; the paths are checked here)."""
    check_one_line(cfg)
    for name, path in (("--workdir", job.workdir), ("the current directory", job.cwd)):
        found = control_character(str(path))
        if found:
            raise OutputError(f"{name} {str(path)!r} holds the control character {found}: the batch script "
                              "names it in comments and #SBATCH lines, each on one line; choose another")
    q = shlex.quote
    points = q(str(slurm_dir(job.workdir) / POINTS_FILE))
    run = f'"$WORKDIR/$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {points})"' if job.points else '"$WORKDIR"'
    log = '"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}.out"' if job.points else '"$SLURM_JOB_ID.out"'
    requeue = f'{q(job.python)} -m vitcli.cluster.requeue'
    return "\n".join([
        "#!/bin/bash",
        f"# `vit {job.stage}` of {job.workdir} on SLURM, written by {written}.",
        f"# `sbatch {script_path(job.workdir)}` submits it again: the run resumes from its last checkpoint.",
        *sbatch_lines(cfg, job),
        "",
        "set -u",
        f"cd {q(str(job.cwd))}  # the recipe's relative paths are relative to where it was submitted",
        f"WORKDIR={q(str(job.workdir))}",
        f"RUN={run}",
        f"LOG={q(str(slurm_dir(job.workdir)))}/{log}",
        f'{requeue} begin "$RUN"',
        "# each node's launch writes there why its ranks failed (srun exits with its tasks' highest code)",
        f'export {EXITS_ENV}="$RUN/{SLURM_DIR}/exits-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}"',
        *launch_lines(cfg, job),
        "STEP=$!",
        "SIGNAL=",
        "# SLURM's warning (--signal=B:...) comes to this shell alone: handed on to the step.",
        "# A preemption's or a scancel's SIGTERM reaches every process of the job already.",
        "trap 'SIGNAL=USR2; kill -USR2 $STEP 2>/dev/null' USR2",
        "trap 'SIGNAL=TERM' TERM",
        "# a trapped signal ends `wait` early: wait again until the step itself has ended",
        'while :; do wait "$STEP"; RC=$?; [ "$RC" -gt 128 ] && kill -0 "$STEP" 2>/dev/null || break; done',
        (f'exec {requeue} end "$RUN" --rc "$RC" --signal "$SIGNAL" --max-requeues {cfg.max_requeues} '
         f'--max-restarts {cfg.max_restarts} --log "$LOG" --exits "${EXITS_ENV}"'),
        "",
    ])


def launch_lines(cfg: SlurmConfig, job: Job) -> list[str]:
    """The rendezvous address and the step, started in the background. The address is the first
    node's, as torchtitan's multinode_trainer.slurm takes it (a node's name may not resolve to the
    address the others reach; `hostname --ip-address` may list several: the first). One node: this
    shell runs on it (sbatch runs the script on the allocation's first node) and starts torchrun
    itself, so a SIGTERM reaches torchrun and the ranks, not srun, which would kill them at once.
    Several: one srun task per node."""
    first = "hostname --ip-address | awk '{print $1}'"
    port = f"PORT=$(({cfg.port} + SLURM_JOB_ID % {PORTS}))"
    if cfg.nodes == 1:
        return [f"HEAD_IP=$({first})  # this node's: the only one", port, f"{torchrun(cfg, job)} &"]
    return ['HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "$HEAD" {first})', port,
            f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {torchrun(cfg, job)} &"]
