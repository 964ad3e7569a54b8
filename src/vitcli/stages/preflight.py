"""`vit pretrain --preflight` (and `vit finetune --preflight`): what a training run will cost,
measured on the run itself before committing to it, and reported.

The command's own decision comes first (run.build.decide): a workdir whose run is finished, which
the command would not train, is said so (exit 2) and nothing is measured; one the command would
refuse is refused alike. Then a few real steps of the run as the command would start it
(run.measure) in a throwaway folder beside the workdir, on the file system the run would write to,
removed on every way out (an error, Ctrl-C, SIGTERM); the workdir itself is never created or
touched. run.estimate turns what they cost into the whole run's figures, printed here as one table
with what the run should change first.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rich.table import Table

from vitcli.errors import Interrupted, OutputError
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_text
from vitcli.recipe.schema import Recipe
from vitcli.run.build import Finished, decide
from vitcli.run.estimate import estimate
from vitcli.run.measure import measure
from vitcli.runtime import threads
from vitcli.runtime.dist import Dist, all_gather, setup
from vitcli.runtime.metrics import console, pairs_table, stdout
from vitcli.runtime.workdir import check_writable, existing_ancestor

PREFIX = ".vit-preflight-"  # the throwaway folder's name; one left by a SIGKILL is safe to delete


def preflight(recipe: Recipe, workdir: Path, *, steps: int, resume: bool | None = None,
              overwrite: bool = False) -> dict:
    """`--preflight`: join the process group, time the run in a throwaway folder beside `workdir`
    (never touched), print what the whole run will cost; returns those figures (what --json prints).
    The run is decided as the command decides it (`resume`, `overwrite`: its flags): the precision,
    compilation and micro-batch it would get (data.micro_batch_size auto searched as the run
    searches it: its time is the run's start-up too); a finished run, which the command would not
    train, is an OutputError."""
    dist = setup(recipe.run.device)
    decided = decide(recipe, workdir, dist, resume, overwrite)
    if isinstance(decided, Finished):
        raise OutputError(f"--preflight: {decided.line()}")
    recipe = decided.recipe
    shared = dist.device.type == "cpu" and threads.check(recipe.data.num_workers)
    try:
        with throwaway(workdir, dist) as tmp:
            found = measure(recipe, tmp, dist, steps)
    except Interrupted as e:  # the loop's checkpoint went with the folder: nothing to resume
        name = signal.Signals(e.exit_code - 128).name
        raise Interrupted(f"preflight stopped by {name}: its throwaway folder is removed, {workdir} "
                          "untouched", exit_code=e.exit_code) from None
    figures = estimate(found, workdir, dist)
    figures["warnings"] = ([shared] if shared else []) + warnings(figures, recipe, dist)
    if dist.is_main:
        for line in figures["warnings"]:
            console.log(f"[yellow]warning: {line}")
        stdout.print(report(figures))
    return figures


def warnings(f: dict, r: Recipe, dist: Dist) -> list[str]:
    """What the run should change before it starts: an input-bound loader, a disk that cannot hold
    its checkpoints, a SLURM time limit too short or needing more requeues than slurm.max_requeues
    allows."""
    out = [f["train/input_advice"]] if f["train/input_advice"] else []
    if not f["disk/fits"]:
        out.append(f"the run needs {size(f['disk/needed_bytes'])} of disk ({f['disk/checkpoints_kept']} "
                   f"checkpoints and the model; its check before it starts asks for "
                   f"{size(f['disk/checked_bytes'])}) but {size(f['disk/free_bytes'])} is free: free some, "
                   "lower run.keep_checkpoints or pick another --workdir")
    if f["slurm/time_limit_s"] is None:
        return out
    if f["slurm/time_limit_s"] < f["slurm/least_time_limit_s"]:
        least = f["slurm/least_time_limit_s"]
        out.append(f"slurm.time={r.slurm.time} is too short: the start-up ({f['eta/fixed_s']:.0f} s), a step "
                   f"({f['train/step_s']:.2g} s), a checkpoint ({f['time/checkpoint_s']:.2g} s) and the "
                   f"warning (slurm.signal_seconds={r.slurm.signal_seconds}) need {least} s, and a job that "
                   "writes no checkpoint requeues without progress until it fails: slurm.time="
                   f"{time_limit_text(least)} works, a longer one pays fewer start-ups")
    elif f["slurm/requeues"] is None:
        out.append(f"slurm.time={r.slurm.time} leaves no time to train after the start-up "
                   f"({f['eta/fixed_s']:.0f} s) and slurm.signal_seconds={r.slurm.signal_seconds}")
    elif f["slurm/requeues"] > r.slurm.max_requeues:
        out.append(f"slurm.time={r.slurm.time} needs {f['slurm/requeues']} requeues, more than "
                   f"slurm.max_requeues={r.slurm.max_requeues}: raise either")
    procs = r.slurm.nodes * procs_per_node(r.slurm)
    if procs != dist.world_size:
        out.append(f"timed with {dist.world_size} process(es), while the slurm section asks for {procs}: "
                   "the step time, ETA and requeues there differ")
    return out


def report(f: dict) -> Table:
    """The figures as a two-column table."""
    title = f"preflight of {f['stage']}: the whole run in about {duration(f['eta/seconds'])}"
    return pairs_table(title, [(what, detail(f)) for what, detail in ROWS])


def _step(f: dict) -> str:
    mfu = f", MFU {f['train/mfu']:.1%}" if f["train/mfu"] is not None else ""
    first = (f"; the first epoch's {f['train/first_epoch_steps']} steps, decoding every image for the cache, "
             f"{duration(f['train/first_epoch_step_s'])}" if f["train/first_epoch_steps"] else "")
    return (f"{duration(f['train/step_s'])}, {f['train/img_per_s']:.0f} img/s (over "
            f"{f['preflight/steps_timed']} steady steps, micro-batches of {f['data/micro_batch_size']} x "
            f"{f['data/accumulation']}){mfu}{first}")


def _host(f: dict) -> str:
    worker = f["mem/worker_peak_mb"]
    workers = f"largest loader worker {worker:.0f} MiB" if worker is not None else "no loader workers"
    growth = f["mem/cache_growth_mb"]
    grown = f" (with the {growth:.0f} MiB the image cache still grows by)" if growth >= 0.5 else ""
    return f"main process {f['mem/main_peak_mb']:.0f} MiB, {workers}{grown}"


def _device(f: dict) -> str:
    if f["mem/device_allocated_mb"] is None:
        return "none (CPU)"
    return f"{f['mem/device_allocated_mb']:.0f} MiB allocated, {f['mem/device_reserved_mb']:.0f} MiB reserved"


def _schedule(f: dict) -> str:
    evals = [f"{f[k]} x {k[5:-5]} ({duration(f[k[:-5] + '_s'])})"
             for k in f if k.startswith("eval/") and k.endswith("_runs")]
    return (f"{f['schedule/steps']} steps, {', '.join(evals) or 'no evaluation'}, "
            f"{f['schedule/checkpoint_writes']} checkpoints ({duration(f['time/checkpoint_s'])} each)")


def _eta(f: dict) -> str:
    parts = {"start-up and wind-down": "fixed_s", "steps": "steps_s", "evaluations": "eval_s",
             "checkpoints": "checkpoint_s"}
    return f"{duration(f['eta/seconds'])}: " + ", ".join(f"{k} {duration(f['eta/' + v])}"
                                                         for k, v in parts.items())


def _gpu_hours(f: dict) -> str:
    if f["eta/gpu_hours"] is None:
        return "none (CPU)"
    return f"{f['eta/gpu_hours']:.2f} ({f['eta/processes']} processes)"


def _disk(f: dict) -> str:
    return (f"{f['disk/checkpoints_kept']} x {size(f['disk/checkpoint_bytes'])} checkpoints + "
            f"{size(f['disk/model_bytes'])} model = {size(f['disk/needed_bytes'])} of "
            f"{size(f['disk/free_bytes'])} free" + ("" if f["disk/fits"] else ": does NOT fit"))


def _requeues(f: dict) -> str:
    if f["slurm/time_limit_s"] is None:
        return "no slurm.time"
    if f["slurm/requeues"] is None:
        return "the time limit leaves no time to train"
    return f"{f['slurm/requeues']} (jobs of {duration(f['slurm/time_limit_s'])})"


ROWS = [("step", _step), ("waiting for data", lambda f: f"{f['train/data_wait']:.0%} of the time"),
        ("host memory", _host), ("device memory", _device), ("schedule", _schedule), ("ETA", _eta),
        ("GPU-hours", _gpu_hours), ("disk", _disk), ("SLURM requeues", _requeues)]


def duration(seconds: float) -> str:
    """0.0813 s, 7.25 s, 38 s, 12 min 5 s, 3 h 20 min."""
    if seconds < 10:
        return f"{seconds:.3g} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def size(n: float) -> str:
    """Bytes in binary units: 945 KiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def throwaway(workdir: Path, dist: Dist) -> Iterator[Path]:
    """A new folder beside `workdir`, on the file system it would be made on, every rank told its
    path; removed with all it holds on every way out (a return, an error, Ctrl-C, SIGTERM: cli.entry
    unwinds)."""
    where = existing_ancestor(workdir.absolute().parent)
    check_writable(where / PREFIX, "--preflight's throwaway folder")
    made = tempfile.mkdtemp(prefix=PREFIX, dir=where) if dist.is_main else None
    try:
        yield Path(all_gather(made, dist)[0])
    finally:
        if made:
            shutil.rmtree(made, ignore_errors=True)
