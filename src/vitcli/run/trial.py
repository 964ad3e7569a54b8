"""One trial of a micro-batch for data.micro_batch_size: auto (run/micro_batch.py searches with
them): the run's own steps at that micro-batch, in a process of its own, and the peak memory they
reached.

`python -m vitcli.run.trial FOLDER/spec.json` builds the run's network and objective as the run does
(run.network: the recipe's objective, with its teacher if any; the weight EMA; the precision,
activation checkpointing and torch.compile of parallelize.apply) and takes two optimizer steps
of two micro-batches each (one when the micro-batch is the whole batch) on random inputs of the
run's shape: the peak of weights, gradients, optimizer slots and one micro-batch's activations is
reached within them (bench/memory.py says why). What the run's process holds besides the steps is
held here too: a copy of the weights and the optimizer's state on the CPU through the second step
(a checkpoint being staged while training goes on), a held-out pass at data.eval_batch_size (the
evaluators', without gradients) while the gradients are still there, and on a CPU what the run does
once at its end (the measured peak FLOP/s, the curves' figure).

It writes FOLDER/floor.json as soon as its imports are done ({"rss_mb", "anon_mb"}: its resident
memory before any network; the parent reads it, and counts the trial's process beside its own),
then FOLDER/result.json: its peak in MiB, on CUDA the caching allocator's max_memory_reserved plus
its CUDA context (the allocator capped at the budget less the context), on a CPU its peak resident
memory (VmHWM) with its floor; or that it ran out of memory; or the VitcliError the run would have
met. This module imports no more than the steps and the objectives need: a trial starts in seconds.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import torch

from vitcli.errors import VitcliError
from vitcli.figures.canvas import new_figure
from vitcli.models.flops import counted
from vitcli.recipe.layers import merge
from vitcli.recipe.schema import Recipe
from vitcli.run.network import network
from vitcli.runtime import files
from vitcli.runtime.allocator import keep_freed_memory
from vitcli.runtime.dist import Dist, enable_tf32
from vitcli.runtime.memory import own_peak_mb, status_mb
from vitcli.runtime.peak import peak_flops
from vitcli.runtime.precision import autocast
from vitcli.train import parallelize
from vitcli.train.ema import WeightEma
from vitcli.train.loop import Draws
from vitcli.train.optim import build_optimizer

STEPS, MICRO_BATCHES = 2, 2  # the second step's second micro-batch meets every slot and gradient
# a trial's files, in a folder of its own
SPEC, RESULT, ERRORS, FLOOR = "spec.json", "result.json", "stderr.txt", "floor.json"


def run(spec_path: Path) -> str:
    """A trial's process: the steps `spec_path` asks for ({recipe, micro, micro_batches, device,
    width, budget_mb, others_mb}), then beside it RESULT: {"peak_mb"}, {"failed": "out of memory"},
    or a VitcliError's {"error", "kind"}."""
    keep_freed_memory()  # as `vit` itself does (cli.entry): the heap grows as the run's will
    _first_to_go()
    floor = {"rss_mb": status_mb("self", "VmRSS"), "anon_mb": status_mb("self", "RssAnon")}
    files.write_text(spec_path.with_name(FLOOR), json.dumps(floor))
    spec = json.loads(spec_path.read_text())
    r = Recipe(stage=spec["recipe"]["stage"])
    merge(r, spec["recipe"])
    try:
        found = {"peak_mb": trial_steps(r, spec["micro"], spec["micro_batches"], torch.device(spec["device"]),
                                        spec["width"], spec["budget_mb"], spec["others_mb"]), **floor}
    except VitcliError as e:
        found = {"error": str(e), "kind": type(e).__name__}
    except Exception as e:
        if not _out_of_memory(e):
            raise
        found = {"failed": "out of memory"}
    files.write_text(spec_path.with_name(RESULT), json.dumps(found))
    return torch.device(spec["device"]).type


def _first_to_go() -> None:
    """The kernel's out-of-memory killer takes this process before any other (oom_score_adj 1000)
    where a hard cap (a cgroup, SLURM --mem) is met during the search: the trial dies, not the run."""
    try:
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass


def _out_of_memory(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from, is running out of memory: torch.compile reports
    one met while it compiles or tunes as its own error, raised from the OutOfMemoryError."""
    while e is not None:
        if isinstance(e, torch.OutOfMemoryError | MemoryError) or "out of memory" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def trial_steps(r: Recipe, micro: int, micro_batches: int, device: torch.device, width: int,
                budget_mb: float = float("inf"), others_mb: float = 0.0) -> float:
    """STEPS optimizer steps of `micro_batches` micro-batches of `micro` random images each, as the
    run takes them (network, objective, precision, parallelize.apply, optimizer, EMA); the peak MiB
    of this process on `device` (see the module's docstring). Run it in a process of its own: it is
    `run`'s."""
    context = _context_mb(device, budget_mb, others_mb)
    torch.manual_seed(r.run.seed)
    model, objective = network(r, width, device)
    parallel = parallelize.apply(model.to(device), r.run, Dist(0, 1, 0, device))
    optimizer = build_optimizer(parallel.model, r.optim)
    ema = WeightEma(parallel.model, r.ema) if r.ema.decay else None
    parallel.train.train()  # dropout and drop-path keep their masks for the backward, as in the run
    staged = None
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        draws = [Draws(r.run.seed, step, i, micro * micro_batches) for i in range(micro_batches)]
        taken = [(objective.example(micro, device), torch.randint(max(width, 1), (micro,), device=device))
                 for _ in range(micro_batches)]  # mpp and mae read no labels
        if objective.whole_step:
            with autocast(device, r.run.precision):
                objective.before_step([x for x, _ in taken], draws)
        for (x, y), d in zip(taken, draws):
            with autocast(device, r.run.precision):
                value = objective.loss(parallel.train, x, y, d)[0]
            (value / micro_batches).backward()
        parallelize.clip_grad_norm(parallel.train, r.optim.clip_grad_norm)
        objective.before_update(parallel.model, step - 1)
        optimizer.step()
        if ema is not None:
            ema.update(parallel.model, step)
        objective.after_step(parallel.model, step)
        # an asynchronous checkpoint's CPU copy, in flight while the next step trains
        staged = staged or _staged(parallel.model, optimizer, ema)
    _held_out_pass(r, parallel.model, objective, width, device)
    del staged
    _run_tail(r, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device) / 2**20 + context
    return own_peak_mb()


def _staged(model: torch.nn.Module, optimizer, ema: WeightEma | None) -> list[torch.Tensor]:
    """A copy on the CPU of the weights, the optimizer's state and the EMA's (what a checkpoint
    holds), as a checkpoint writer stages them while the next steps train."""
    tensors = [*model.state_dict().values(), *(ema.state_dict().values() if ema is not None else [])]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    # a DTensor (run.strategy=fsdp) stages its shard, as a sharded checkpoint does
    return [(t.to_local() if hasattr(t, "to_local") else t).detach().to("cpu", copy=True) for t in tensors]


def _held_out_pass(r: Recipe, model: torch.nn.Module, objective, width: int, device: torch.device) -> None:
    """One batch of data.eval_batch_size through the objective's loss without gradients, the model
    in eval mode, as an evaluator's pass takes it while the step's gradients are still held."""
    n = r.data.eval_batch_size
    model.eval()
    with torch.no_grad(), autocast(device, r.run.precision):
        objective.loss(model, objective.example(n, device), torch.randint(max(width, 1), (n,), device=device),
                       Draws(r.run.seed, 0, 0, n))
    model.train()


def _run_tail(r: Recipe, device: torch.device) -> None:
    """What the run's process does once after training, with memory of its own: on a CPU the
    measured peak FLOP/s for train/mfu (three 2048^2 matrices) and the curves' figure (matplotlib,
    as figures/curves.py draws it)."""
    if device.type != "cpu":
        return
    if not counted(r.model):  # the run measures it for train/mfu
        peak_flops(device, r.run.precision)
    fig = new_figure(figsize=(8.4, 3.8))
    for i in (1, 2):
        fig.add_subplot(1, 2, i).plot(range(100), range(100))
    fig.tight_layout()
    fig.savefig(io.BytesIO(), format="png", dpi=120)


def _context_mb(device: torch.device, budget_mb: float, others_mb: float) -> float:
    """On CUDA, the MiB of this process's CUDA context (the device's used memory before any tensor,
    less the `others_mb` other processes held as the trial began), with the caching allocator capped
    at the budget less it; 0 on a CPU."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.set_device(device)
    enable_tf32()  # as the run's process has it (runtime.dist.setup)
    free, total = torch.cuda.mem_get_info(device)  # makes the context
    context = max((total - free) / 2**20 - others_mb, 0.0)
    fraction = (budget_mb - context) * 2**20 / total
    if fraction < 1:
        torch.cuda.set_per_process_memory_fraction(max(fraction, 0.0), device)
    return context


if __name__ == "__main__":
    if run(Path(sys.argv[1])) != "cpu":
        # no interpreter teardown on CUDA: it takes seconds, for host memory the budget does not count
        os._exit(0)
    # on a CPU the interpreter's teardown grows the resident memory by ~110 MiB (torch's finalizers)
    # once the result is written, as the run's process will at its end: the parent reads the
    # process's whole peak from the kernel (wait4's ru_maxrss) and counts it
