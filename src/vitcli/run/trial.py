"""One trial of a micro-batch for data.micro_batch_size: auto (run/micro_batch.py searches with
them): the run's own steps at that micro-batch, in a process of its own, and the peak memory they
reached.

`python -m vitcli.run.trial FOLDER/spec.json` builds the run's network and objective as the run does
(run.network: the recipe's objective, with its teacher if any; the weight EMA; the precision,
activation checkpointing and torch.compile of parallelize.apply) and takes two optimizer steps
of two micro-batches each (one when the micro-batch is the whole batch) on random inputs of the
run's shape: the peak of weights, gradients, optimizer slots and one micro-batch's activations is
reached within them (bench/memory.py says why). It writes FOLDER/result.json: its peak in MiB, on
CUDA the caching allocator's max_memory_reserved plus its CUDA context (the allocator capped at the
budget less the context), on a CPU its peak resident memory (VmHWM: torch, the network and its
steps; the run's own process holds its data reading on top, and its loader workers apart); or that
it ran out of memory; or the VitcliError the run would have met. This module imports no more than
the steps and the objectives need: a trial starts in seconds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from vitcli.errors import VitcliError
from vitcli.recipe.layers import merge
from vitcli.recipe.schema import Recipe
from vitcli.run.network import network
from vitcli.runtime import files
from vitcli.runtime.allocator import keep_freed_memory
from vitcli.runtime.dist import Dist, enable_tf32
from vitcli.runtime.memory import own_peak_mb
from vitcli.runtime.precision import autocast
from vitcli.train import parallelize
from vitcli.train.ema import WeightEma
from vitcli.train.loop import Draws
from vitcli.train.optim import build_optimizer

STEPS, MICRO_BATCHES = 2, 2  # the second step's second micro-batch meets every slot and gradient
# a trial's files, in a folder of its own
SPEC, RESULT, ERRORS = "spec.json", "result.json", "stderr.txt"


def run(spec_path: Path) -> None:
    """A trial's process: the steps `spec_path` asks for ({recipe, micro, micro_batches, device,
    width, budget_mb, others_mb}), then beside it RESULT: {"peak_mb"}, {"failed": "out of memory"},
    or a VitcliError's {"error", "kind"}."""
    keep_freed_memory()  # as `vit` itself does (cli.entry): the heap grows as the run's will
    spec = json.loads(spec_path.read_text())
    r = Recipe(stage=spec["recipe"]["stage"])
    merge(r, spec["recipe"])
    try:
        found = {"peak_mb": trial_steps(r, spec["micro"], spec["micro_batches"], torch.device(spec["device"]),
                                        spec["width"], spec["budget_mb"], spec["others_mb"])}
    except VitcliError as e:
        found = {"error": str(e), "kind": type(e).__name__}
    except Exception as e:
        if not _out_of_memory(e):
            raise
        found = {"failed": "out of memory"}
    files.write_text(spec_path.with_name(RESULT), json.dumps(found))


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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_reserved(device) / 2**20 + context
    return own_peak_mb()


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
    run(Path(sys.argv[1]))
    # no interpreter teardown: it takes seconds, and grows a CPU trial's resident memory by ~100 MiB
    # once its result is written (the parent polices the budget only until then)
    os._exit(0)
