"""data.micro_batch_size: auto, the largest micro-batch that fits in memory, found by trying before
training.

The candidates are the divisors of the batch per process (data.batch_size / world size; the even
ones only when Mixup or CutMix pair the images), so the global batch is kept by accumulation and the
run trains exactly as it would with the chosen micro-batch set by hand: `resolved` puts that number
in the recipe before recipe.yaml and the first checkpoint are written, and a resumed run takes its
checkpoint's without trying again.

Each candidate tried is a trial (run/trial.py): the run's steps at that micro-batch in a fresh child
process, which reports its peak memory. It fits when it finishes and its peak is within the budget
(run.memory_budget_mb; 0: a GPU's total memory, on a CPU the host's MemAvailable over the node's
processes). Being a process of its own, a trial that runs out of memory leaves nothing behind in the
training process: no fragmented caching allocator, no half-traced compiled graph, no heap grown to
the trial's high-water mark. On a CPU this parent kills a trial whose resident memory passes the
budget, so no trial can push the host into swap or its OOM killer; on CUDA the trial caps its own
caching allocator.

Memory grows with the micro-batch, so the search is a bisection over the candidates: ceil(log2(n +
1)) trials for n candidates (4 for the 13 divisors of 4096), the candidate above the choice among
them.

Under torchrun every node's local rank 0 searches on its own device (nodes may differ) while the
other ranks wait, and all take the smallest of the nodes' choices. Under run.strategy=fsdp a trial
holds the whole model, as one process does: its choice fits, but may be smaller than the largest
that would with the model sharded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vitcli.checkpoints.manager import Checkpoint
from vitcli.data.rows import sources
from vitcli.errors import CheckpointError, DataError, ModelError, RecipeError, TrainingError
from vitcli.objectives import registry
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import Recipe
from vitcli.run import trial as child
from vitcli.run.trial import ERRORS, MICRO_BATCHES, RESULT, SPEC
from vitcli.runtime import files, launcher
from vitcli.runtime.dist import Dist, all_gather, barrier
from vitcli.runtime.launcher import LaunchEnv
from vitcli.runtime.memory import available_mb, status_mb
from vitcli.runtime.metrics import console

POLL_S = 0.01  # how often the parent reads a CPU trial's resident memory
TRIAL_TIMEOUT_S = 3600  # a trial builds, compiles and steps the model once: an hour of it is a hang
# torchrun's variables, which a trial does not inherit: it is one process of its own (the four
# runtime.launcher reads, and the rendezvous's)
LAUNCHER_VARS = (*launcher.VARS, "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")
RAISED = {e.__name__: e for e in (RecipeError, ModelError, DataError, CheckpointError, TrainingError)}


@dataclass(frozen=True)
class Trial:
    """What the trial at micro-batch `micro` found: whether it fits, what it saw ("peak 812 MiB",
    "out of memory"), and its peak in MiB if it finished."""

    micro: int
    fits: bool
    said: str
    peak_mb: float | None = None


@dataclass(frozen=True)
class Budget:
    """The MiB a trial's peak may reach, and where that figure came from."""

    mb: float
    source: str


def candidates(share: int, even: bool = False) -> list[int]:
    """The micro-batches that keep the global batch: the divisors of the batch per process,
    ascending; the even ones only (`even`) when Mixup or CutMix pair each image with its mirror in
    the micro-batch."""
    return [m for m in range(1, share + 1) if share % m == 0 and not (even and m % 2)]


def largest_fitting(options: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of `options` (ascending) that `fits`, where fits holds up to some option and
    fails above it (memory grows with the micro-batch): a bisection, ceil(log2(n + 1)) calls for n
    options, which tries the neighbour above the answer too. None when even the smallest fails."""
    # options[lo] fits (-1: none known to), options[hi] does not (n: none known)
    lo, hi = -1, len(options)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(options[mid]):
            lo = mid
        else:
            hi = mid
    return options[lo] if lo >= 0 else None


def resolved(r: Recipe, dist: Dist, start: Checkpoint | None) -> Recipe:
    """The recipe with data.micro_batch_size's auto replaced by a number, said on the console: the
    checkpoint's when the run resumes one (`start`), else the largest candidate that fits, the same
    on every process. Any other value comes back as it is."""
    if r.data.micro_batch_size != "auto":
        return r
    if start is not None:
        micro = start[1]["recipe"]["data"].get("micro_batch_size", 0)
        why = f"the checkpoint's, {start[0].name}: a resumed run keeps its micro-batch"
    else:
        micro, why = _agreed(r, dist)
    if dist.is_main:
        console.log(f"data.micro_batch_size: auto -> {micro} ({why})")
    return replace(r, data=replace(r.data, micro_batch_size=micro))


def _agreed(r: Recipe, dist: Dist) -> tuple[int, str]:
    """(micro-batch, why): each node's local rank 0 searches its device, every rank takes the
    smallest."""
    mine = search(r, dist.device, dist.world_size) if dist.local_rank == 0 else None
    # a search takes minutes: waited out under the barrier's long timeout, not a collective's
    barrier(dist)
    found = sorted(choice for choice in all_gather(mine, dist) if choice is not None)
    micro, why = found[0]
    if len({m for m, _ in found}) > 1:
        why += f"; the smallest of the nodes' {', '.join(str(m) for m, _ in found)}"
    return micro, why


def search(r: Recipe, device: torch.device, world_size: int = 1) -> tuple[int, str]:
    """(the largest candidate micro-batch that fits on `device`, why): the chosen one's peak against
    the budget and the next candidate's outcome. A RecipeError when not even the smallest fits."""
    share = r.data.batch_size // world_size
    limit, width, tried = budget(r, device), head_width(r), {}

    def fits(micro: int) -> bool:
        tried[micro] = trial(r, micro, share // micro, device, limit.mb, width)
        console.log(f"data.micro_batch_size auto: micro-batch {micro}: {tried[micro].said}")
        return tried[micro].fits

    chosen = largest_fitting(candidates(share, bool(r.data.mixup_alpha or r.data.cutmix_alpha)), fits)
    if chosen is None:
        smallest = min(tried)
        fixes = ((["raise run.memory_budget_mb"] if r.run.memory_budget_mb else [])
                 + ([] if r.run.activation_checkpointing else ["set run.activation_checkpointing=true"]))
        raise RecipeError(f"data.micro_batch_size=auto: no micro-batch fits the {limit.mb:.0f} MiB budget "
                          f"({limit.source}): micro-batch {smallest}: {tried[smallest].said}; "
                          f"{' or '.join(fixes) or 'train a smaller model'}")
    above = min((m for m in tried if m > chosen), default=None)
    why = (f"{share // chosen} x {chosen} per step per process: peak {tried[chosen].peak_mb:.0f} MiB of the "
           f"{limit.mb:.0f} MiB budget, {limit.source}; ")
    return chosen, why + (f"{above}: {tried[above].said}" if above else "the whole batch per process fits")


def budget(r: Recipe, device: torch.device) -> Budget:
    """run.memory_budget_mb, or 0's: a GPU's total memory; on a CPU, the memory available on the
    host (MemAvailable) shared by the node's processes (torchrun's LOCAL_WORLD_SIZE)."""
    if r.run.memory_budget_mb:
        return Budget(r.run.memory_budget_mb, "run.memory_budget_mb")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**20
        return Budget(total, f"the memory of {torch.cuda.get_device_name(device)}")
    available = available_mb()
    if available is None:
        raise RecipeError("data.micro_batch_size=auto: this host does not say how much memory is available "
                          "(no /proc/meminfo); set run.memory_budget_mb")
    processes = LaunchEnv.read().local_world_size
    shared = f" over {processes} processes" if processes > 1 else ""
    return Budget(available / processes, f"MemAvailable {available:.0f} MiB{shared}")


def head_width(r: Recipe) -> int:
    """The classifier's width the run builds (run.build's): its objective's (none for mpp and mae;
    the recipe's, else its data's, read only then)."""
    return registry.named(r).head_width(r, lambda: train_split(r))


def train_split(r: Recipe):
    """The recipe's train split, streamed or not, as the run loads it."""
    if r.data.streaming:
        return sources.load_stream(r.data)
    return sources.load_split(r.data, r.data.train_split)


def trial(r: Recipe, micro: int, accum: int, device: torch.device, budget_mb: float, width: int) -> Trial:
    """A trial of micro-batch `micro` (`accum` of them per step in the run) in a child process on
    `device` (run/trial.py), for a classifier `width` wide. An error of the recipe's (a teacher that
    does not load) is raised as the run would raise it; a trial that fails otherwise, not for
    memory, is a TrainingError."""
    spec = {"recipe": to_dict(r), "micro": micro, "micro_batches": min(accum, MICRO_BATCHES),
            "device": str(device), "budget_mb": budget_mb, "width": width, "others_mb": _used_mb(device)}
    with tempfile.TemporaryDirectory(prefix="vit-micro-batch-") as tmp:
        folder = Path(tmp)
        files.write_text(folder / SPEC, json.dumps(spec))
        with open(folder / ERRORS, "wb") as errors:
            proc = subprocess.Popen([sys.executable, "-m", child.__name__, str(folder / SPEC)],
                                    env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=errors)
            stopped_at = _watch(proc, budget_mb if device.type == "cpu" else None, folder / RESULT)
        return _outcome(micro, proc.returncode, stopped_at, folder, budget_mb)


def _used_mb(device: torch.device) -> float:
    """MiB of the GPU already taken (this process's context, other processes'), so that a trial can
    tell its own context from them; 0 on a CPU."""
    if device.type != "cuda":
        return 0.0
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


def _child_env() -> dict[str, str]:
    """This environment less torchrun's variables, with this vitcli first on the path: the child
    imports the code its parent runs."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def _watch(proc: subprocess.Popen, cap_mb: float | None, result: Path) -> float | None:
    """Wait for a trial; with a `cap_mb` (a CPU's budget) kill it once its resident memory passes
    the cap before it has written its `result`. The resident MiB it was stopped at, or None when it
    ended by itself. However this returns (Ctrl-C, a scheduler's SIGTERM), the child does not
    outlive it."""
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    try:
        while proc.poll() is None:
            policed = cap_mb is not None and not result.exists()
            resident = status_mb(proc.pid, "VmRSS") if policed else None
            if resident is not None and resident > cap_mb:
                proc.kill()
                return resident
            if time.monotonic() > deadline:
                raise TrainingError(f"data.micro_batch_size=auto: a trial ran over {TRIAL_TIMEOUT_S} s; set "
                                    "data.micro_batch_size by hand")
            time.sleep(POLL_S)
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _outcome(micro: int, code: int, stopped_at: float | None, folder: Path, budget_mb: float) -> Trial:
    """The trial's outcome from how it ended and what it wrote."""
    if stopped_at is not None:
        return Trial(micro, False, f"stopped as its resident memory passed the budget ({stopped_at:.0f} MiB)")
    if (folder / RESULT).is_file():
        found = json.loads((folder / RESULT).read_text())
        if "error" in found:
            raise RAISED.get(found["kind"], TrainingError)(found["error"])
        if "failed" in found:
            return Trial(micro, False, found["failed"])
        peak = found["peak_mb"]
        over = "" if peak <= budget_mb else ", over the budget"
        return Trial(micro, peak <= budget_mb, f"peak {peak:.0f} MiB{over}", peak)
    if code == -signal.SIGKILL:  # not by us: the kernel's OOM killer, most likely
        return Trial(micro, False, "killed (SIGKILL: the host's out-of-memory killer?)")
    lines = (folder / ERRORS).read_text(errors="replace").strip().splitlines()
    raise TrainingError(f"data.micro_batch_size=auto: the trial of micro-batch {micro} failed (exit {code}): "
                        f"{lines[-1] if lines else 'no message'}; set data.micro_batch_size by hand")
