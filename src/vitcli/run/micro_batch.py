"""data.micro_batch_size: auto, the largest micro-batch that fits in memory, found by trying before
training.

The candidates are the divisors of the batch per process (data.batch_size / world size; the even
ones only when Mixup or CutMix pair the images), so the global batch is kept by accumulation and the
run trains exactly as it would with the chosen micro-batch set by hand: `resolved` puts that number
in the recipe before recipe.yaml and the first checkpoint are written, and a resumed run takes its
checkpoint's without trying again.

Each candidate tried is a trial (run/trial.py): the run's steps at that micro-batch in a fresh child
process, which reports its peak memory. Being a process of its own, a trial that runs out of memory
leaves nothing behind in the training process: no fragmented caching allocator, no half-traced
compiled graph, no heap grown to the trial's high-water mark. On CUDA a trial fits when its peak
(the allocator's and its context) is within the budget (run.memory_budget_mb; 0: the GPU's total
memory), and it caps its own caching allocator.

On a CPU the budget is the run's, every process of it (0: the host's MemAvailable over the node's
processes), and a trial is judged by what the run will hold with its micro-batch, not by its own
peak: this process's resident memory now (torch, the data library, the train split: what a trial
does not hold) plus what the trial grew by from its floor to its peak (the network, EMA and teacher,
gradients, optimizer slots, a micro-batch's activations, a checkpoint's staged copy, a held-out
pass: run/trial.py) plus the data side, estimated (each loader worker's own memory and prefetched
batches, for training and again for a held-out pass; the decoded-image cache at its capacity, at
most the split's pixels) plus the interpreter's exit (measured on the trial: wait4's ru_maxrss).
While a trial runs it is a second process beside this one: the parent kills it once the two pass
the budget, so the search itself stays within it, and a budget under the two processes' floors
(measured when the first trial has imported) is refused in one line naming the floor.

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
from vitcli.data.batching.batches import cache_capacity
from vitcli.data.rows import sources
from vitcli.errors import CheckpointError, DataError, ModelError, RecipeError, TrainingError
from vitcli.objectives import registry
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import Recipe
from vitcli.run import trial as child
from vitcli.run.trial import ERRORS, FLOOR, MICRO_BATCHES, RESULT, SPEC
from vitcli.runtime import files, launcher
from vitcli.runtime.dist import Dist, all_gather, barrier
from vitcli.runtime.launcher import LaunchEnv
from vitcli.runtime.memory import available_mb, own_mb, own_peak_mb, status_mb
from vitcli.runtime.metrics import console

POLL_S = 0.01  # how often the parent reads a CPU trial's resident memory
USS_POLLS = 5  # and its USS every so many of those reads
TRIAL_TIMEOUT_S = 3600  # a trial builds, compiles and steps the model once: an hour of it is a hang
# torchrun's variables, which a trial does not inherit: it is one process of its own (the four
# runtime.launcher reads, and the rendezvous's)
LAUNCHER_VARS = (*launcher.VARS, "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")
# a loader worker's own memory beyond the pages it shares with the training process it was forked
# from (its USS): 22-31 MiB measured (quickstart, data.num_workers=2, 2-core Intel Xeon)
WORKER_MB = 32
PREFETCH = 4  # batches each loader worker decodes ahead (data/batching/batches.keyed_loader)
RAISED = {e.__name__: e for e in (RecipeError, ModelError, DataError, CheckpointError, TrainingError)}


@dataclass(frozen=True)
class Trial:
    """What the trial at micro-batch `micro` found: whether it fits, what it saw ("peak 812 MiB",
    "out of memory"), and its peak in MiB if it finished."""

    micro: int
    fits: bool
    said: str
    peak_mb: float | None = None  # on a CPU, the most the run holds with it (every process)
    side: str = "steps"  # on a CPU, what passed the budget: "search", "steps" or "data" (the largest)
    search_mb: float = 0.0  # on a CPU, the most this process and the trial's held together


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
    held = held_mb(device, limit)

    def fits(micro: int) -> bool:
        tried[micro] = trial(r, micro, share // micro, device, limit.mb, width, held)
        console.log(f"data.micro_batch_size auto: micro-batch {micro}: {tried[micro].said}")
        return tried[micro].fits

    chosen = largest_fitting(candidates(share, bool(r.data.mixup_alpha or r.data.cutmix_alpha)), fits)
    if chosen is None:
        smallest = min(tried)
        fixes = _fixes(r, tried[smallest])
        raise RecipeError(f"data.micro_batch_size=auto: no micro-batch fits the {limit.mb:.0f} MiB budget "
                          f"({limit.source}): micro-batch {smallest}: {tried[smallest].said}; "
                          f"{' or '.join(fixes) or 'train a smaller model'}")
    above = min((m for m in tried if m > chosen), default=None)
    # on a CPU the most of the run's and of every trial's search (each ended within the budget)
    most = max([tried[chosen].peak_mb, *(t.search_mb for t in tried.values())])
    peak = "at most" if device.type == "cpu" else "peak"
    why = (f"{share // chosen} x {chosen} per step per process: {peak} {most:.0f} MiB of "
           f"the {limit.mb:.0f} MiB budget, {limit.source}; ")
    return chosen, why + (f"{above}: {tried[above].said}" if above else "the whole batch per process fits")


def budget(r: Recipe, device: torch.device) -> Budget:
    """run.memory_budget_mb, or 0's: a GPU's total memory; on a CPU, the memory available on the
    host (MemAvailable) shared by the node's processes (torchrun's LOCAL_WORLD_SIZE), and what this
    process holds already (the budget is the whole run's, this process included)."""
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
    held = status_mb("self", "VmRSS") or 0.0
    return Budget(available / processes + held,
                  f"MemAvailable {available:.0f} MiB{shared}, and this process's {held:.0f} MiB")


def _fixes(r: Recipe, smallest: Trial) -> list[str]:
    """What can help when not even the `smallest` micro-batch fits, from what passed the budget: the
    search's two processes (a micro-batch set by hand starts no trial), or the run's steps
    (activations: activation checkpointing) and its data side (fewer workers, a smaller cache)."""
    more = ["raise run.memory_budget_mb"] if r.run.memory_budget_mb else []
    if smallest.side == "search":
        return [*more, "set data.micro_batch_size by hand (no trial's process beside the run then)"]
    steps = [] if r.run.activation_checkpointing else ["set run.activation_checkpointing=true"]
    data = ["lower data.num_workers or data.cache_mb"] if smallest.side == "data" else []
    return more + steps + data


def held_mb(device: torch.device, limit: Budget) -> float:
    """On a CPU, this process's resident memory now (the part of the run a trial does not hold); a
    RecipeError when that alone is over the budget: no micro-batch can help. 0 on CUDA, whose
    budget is the device's."""
    if device.type != "cpu":
        return 0.0
    held = status_mb("self", "VmRSS") or own_peak_mb()
    if held >= limit.mb:
        raise RecipeError(f"{limit.source}: the {limit.mb:.0f} MiB budget is under the {held:.0f} MiB this "
                          "process holds before its first batch (torch, the data library, the train split: "
                          f"measured now); {_floor_fix(limit)}")
    return held


def _floor_fix(limit: Budget) -> str:
    """What helps against a floor: more memory, or no search (a micro-batch set by hand starts no
    trial's process)."""
    more = "raise run.memory_budget_mb above it" if limit.source == "run.memory_budget_mb" else (
        "free memory on this host, or set run.memory_budget_mb")
    return f"{more}, or set data.micro_batch_size by hand (no trial's process then)"


def data_side_mb(r: Recipe, micro: int) -> float:
    """MiB of the run's data side that neither this process holds yet nor a trial: each loader
    worker's own memory and the batches it decodes ahead (uint8 at model.img_size), for training and
    again for a held-out pass's workers, and the decoded-image cache (data.cache_mb's share, at most
    the synthetic split's pixels)."""
    image_mb = 3 * r.model.img_size ** 2 / 2**20
    workers = r.data.num_workers * (2 * WORKER_MB + PREFETCH * (micro + r.data.eval_batch_size) * image_mb)
    cache = cache_capacity(r.data) / 2**20
    if r.data.source == "synthetic":
        syn = r.data.synthetic
        cache = min(cache, syn.train_size * 3 * syn.img_size ** 2 / 2**20)
    return workers + cache


def head_width(r: Recipe) -> int:
    """The classifier's width the run builds (run.build's): its objective's (none for mpp and mae;
    the recipe's, else its data's, read only then)."""
    return registry.named(r).head_width(r, lambda: train_split(r))


def train_split(r: Recipe):
    """The recipe's train split, streamed or not, as the run loads it."""
    if r.data.streaming:
        return sources.load_stream(r.data)
    return sources.load_split(r.data, r.data.train_split)


def trial(r: Recipe, micro: int, accum: int, device: torch.device, budget_mb: float, width: int,
          held_mb: float = 0.0) -> Trial:
    """A trial of micro-batch `micro` (`accum` of them per step in the run) in a child process on
    `device` (run/trial.py), for a classifier `width` wide; on a CPU judged with the `held_mb` this
    process holds (held_mb). An error of the recipe's (a teacher that does not load) is raised as the
    run would raise it; a trial that fails otherwise, not for memory, is a TrainingError."""
    spec = {"recipe": to_dict(r), "micro": micro, "micro_batches": min(accum, MICRO_BATCHES),
            "device": str(device), "budget_mb": budget_mb, "width": width, "others_mb": _used_mb(device)}
    with tempfile.TemporaryDirectory(prefix="vit-micro-batch-") as tmp:
        folder = Path(tmp)
        files.write_text(folder / SPEC, json.dumps(spec))
        # the kernel starts a child's ru_maxrss at the high-water mark of the process it was
        # forked from (exec keeps the larger): wait4's figure is the trial's own only above this
        parent_hwm = status_mb("self", "VmHWM") or 0.0
        with open(folder / ERRORS, "wb") as errors:
            proc = subprocess.Popen([sys.executable, "-m", child.__name__, str(folder / SPEC)],
                                    env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=errors)
            cap = budget_mb - held_mb if device.type == "cpu" else None
            stopped_at, (most, whole_life) = _watch(proc, cap, folder / RESULT)
            seen = (most, whole_life if whole_life and whole_life > parent_hwm + 1 else None)
        if device.type == "cpu":
            source = "run.memory_budget_mb" if r.run.memory_budget_mb else "MemAvailable"
            return _judged(r, micro, proc.returncode, (stopped_at, seen), folder, Budget(budget_mb, source),
                           held_mb)
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


def _watch(proc: subprocess.Popen, cap_mb: float | None, result: Path) -> tuple[float | None, tuple]:
    """Wait for a trial, reading its own memory (RssAnon: the pages of the libraries it maps are
    this process's too) every POLL_S; with a `cap_mb` (on a CPU, the budget less what this process
    holds) kill it once that passes the cap after its imports (FLOOR), to its exit.
    (The MiB it was stopped at, or None when it ended by itself; (the most of its own memory seen,
    its peak resident MiB over its whole life, its interpreter's exit included, as the kernel kept
    it: wait4's ru_maxrss, None when stopped).) However this returns (Ctrl-C, a scheduler's
    SIGTERM), the child does not outlive it."""
    deadline, most, polls, uss = time.monotonic() + TRIAL_TIMEOUT_S, 0.0, 0, 0.0
    floor = result.with_name(FLOOR)
    try:
        while (whole_life := _reaped(proc)) is None:
            # its USS too (private file pages besides), every USS_POLLS: reading it takes ~12 ms
            polls, anon = polls + 1, status_mb(proc.pid, "RssAnon") or 0.0
            uss = (own_mb(proc.pid) or 0.0) if polls % USS_POLLS == 0 else uss
            own = max(anon, uss)
            most = max(most, own)
            # policed once its imports are done (its floor, measured then, is what a refusal
            # names), to its exit (which grows it again once its result is written)
            if cap_mb is not None and own > cap_mb and floor.exists():
                proc.kill()
                return own, (most, None)
            if time.monotonic() > deadline:
                raise TrainingError(f"data.micro_batch_size=auto: a trial ran over {TRIAL_TIMEOUT_S} s; set "
                                    "data.micro_batch_size by hand")
            time.sleep(POLL_S)
        return None, (most, whole_life)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()


def _reaped(proc: subprocess.Popen) -> float | None:
    """None while `proc` runs; once it has ended, reaped here (its returncode set), its peak
    resident MiB (ru_maxrss: kB on Linux)."""
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024


def _judged(r: Recipe, micro: int, code: int, watched: tuple, folder: Path, limit: Budget,
            held: float) -> Trial:
    """A CPU trial's outcome as the run's: this process's `held` MiB, the trial's growth from its
    floor to its peak, the data side (data_side_mb) and what the interpreter's exit adds (the
    trial's own, measured: `watched`'s whole life over its peak) within the budget, and the search
    itself (this process and the trial's) within it; a RecipeError naming the floor when the
    trial's process could not even import within what this one leaves."""
    stopped_at, (most_own, whole_life) = watched
    floor = json.loads((folder / FLOOR).read_text()) if (folder / FLOOR).is_file() else None
    if floor is not None and held + floor["anon_mb"] > limit.mb:
        seen = f"{held + floor['anon_mb']:.0f}"
        raise RecipeError(
            f"{limit.source}: the {limit.mb:.0f} MiB budget is under the floor of a "
            f"data.micro_batch_size=auto search, {seen} MiB (measured now: this process's {held:.0f} MiB "
            f"before its first batch and a trial's process beside it before its network); "
            f"{_floor_fix(limit)}")
    if stopped_at is not None:
        return Trial(micro, False, f"stopped as the search passed the budget ({held + stopped_at:.0f} MiB "
                                   "with this process)", side="search", search_mb=held + stopped_at)
    found = json.loads((folder / RESULT).read_text()) if (folder / RESULT).is_file() else {}
    if "peak_mb" not in found:
        return _outcome(micro, code, stopped_at, folder, limit.mb)
    grown = found["peak_mb"] - found["rss_mb"]
    exit_mb = max((whole_life or 0.0) - found["peak_mb"], 0.0)
    need = held + grown + data_side_mb(r, micro) + exit_mb
    # both processes at once: the trial's own memory (its library pages are this one's too) at its
    # floor, and all it grew by from there to the end of its exit, from the kernel's high-water
    # marks (the larger of that and what was read of it while it ran)
    whole = max(found["peak_mb"], whole_life or 0.0)
    search = held + max(most_own, found["anon_mb"] + whole - found["rss_mb"])
    over = max(need, search) > limit.mb
    said = (f"the run {need:.0f} MiB (this process {held:.0f}, the steps {grown:.0f}, the data side "
            f"{data_side_mb(r, micro):.0f}, the exit {exit_mb:.0f}), the search {search:.0f}"
            f"{', over the budget' if over else ''}")
    data = data_side_mb(r, micro) > max(grown, exit_mb)
    side = "search" if search > need else "data" if data else "steps"
    return Trial(micro, not over, said, max(need, search), side, search)


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
