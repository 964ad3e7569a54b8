"""What tests/integration/test_parallelize.py runs on 2 processes (torchrun, Gloo, CPU), in one
launch: `python -m torch.distributed.run --standalone --nproc_per_node 2
tests/integration/parallel_ranks.py OUTDIR`. Rank 0 writes into OUTDIR, for each case, the whole
weights after the last step (`<case>.safetensors`) and a row of `cases.json`: the gradient
reductions each micro-batch's backward made, step by step, and the optimizer's kernel.

- `compiled-<strategy>`: parallelize.apply as a CUDA run applies it by default (activation
checkpointing,
  then DDP or FSDP2, then torch.compile: CPU inductor here), stepped through the loop's own
  micro-batch accumulation (loop._accumulate_grads);
- `<optimizer>-<strategy>`: every optimizer the recipes can name takes a few steps under each
strategy, so a
  kernel without a rule for FSDP2's DTensors fails here first.
"""

import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from fsdp_ranks import GLOBAL_BATCH, MICRO_BATCHES, OPTIM, STEPS, global_batch, tiny_model
from safetensors.torch import save_file
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from vitcli.recipe.schema import OptimConfig, RunConfig
from vitcli.runtime.dist import Dist, setup
from vitcli.train import loop, parallelize
from vitcli.train.optim import build_optimizer

STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = {  # every optim.name x weight_decay_convention pair: timm's adamw, momentum and sgdw
    "adamw": OPTIM,
    "sgd_torch": OptimConfig(name="sgd", lr=0.1, weight_decay=1e-2, clip_grad_norm=OPTIM.clip_grad_norm),
    "sgd_big_vision": OptimConfig(name="sgd", lr=0.1, weight_decay=1e-3, weight_decay_convention="big_vision",
                                  clip_grad_norm=OPTIM.clip_grad_norm),
}
OPTIMIZER_STEPS = 2


class Reductions:
    """Gradient reductions made so far: FSDP2's reduce-scatters (one per sharded unit and backward)
    and DDP's all-reduced buckets, counted through a communication hook."""

    def __init__(self):
        self.count = 0
        real = torch_dist.reduce_scatter_single  # FSDP2's default ReduceScatter looks it up at each call

        def reduce_scatter_single(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        torch_dist.reduce_scatter_single = reduce_scatter_single

    def watch(self, parallel: parallelize.Parallel) -> None:
        """Count DDP's bucket all-reduces too (FSDP2's reduce-scatters are always counted)."""
        if isinstance(parallel.synced, torch.nn.parallel.DistributedDataParallel):
            parallel.synced.register_comm_hook(None, self._all_reduce)

    def _all_reduce(self, process_group, bucket):
        self.count += 1
        return default_hooks.allreduce_hook(process_group, bucket)


def micro_batches(step: int, dist: Dist) -> list:
    """This rank's share of the global batch of `step`, as MICRO_BATCHES (images, labels)
    micro-batches."""
    x, y = global_batch(step)
    share = GLOBAL_BATCH // dist.world_size
    x, y = x[dist.rank * share:(dist.rank + 1) * share], y[dist.rank * share:(dist.rank + 1) * share]
    return list(zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES), strict=True))


def train(parallel, optimizer, steps: int, cfg: OptimConfig, dist: Dist, reductions: Reductions) -> list:
    """`steps` optimizer steps as the loop takes them; per step, the reductions of each
    micro-batch's backward (read before each micro-batch's forward and after the last backward)."""
    per_step, seen = [], []

    def objective(model, x, y, i):
        seen.append(reductions.count)
        return F.cross_entropy(model(x), y), None

    for step in range(steps):
        seen.clear()
        loop._accumulate_grads(parallel, optimizer, iter(micro_batches(step, dist)), MICRO_BATCHES,
                               objective, "fp32", dist)
        seen.append(reductions.count)
        per_step.append([after - before for before, after in itertools.pairwise(seen)])
        parallelize.clip_grad_norm(parallel.train, cfg.clip_grad_norm)
        optimizer.step()
    return per_step


def case(out: Path, name: str, run: RunConfig, cfg: OptimConfig, steps: int, dist: Dist,
         reductions: Reductions) -> dict:
    """Train one case from tiny_model(0); write its weights; return its row of cases.json."""
    parallel = parallelize.apply(tiny_model(0), run, dist)
    reductions.watch(parallel)
    optimizer = build_optimizer(parallel.model, cfg)
    per_step = train(parallel, optimizer, steps, cfg, dist, reductions)
    weights = parallel.full_state(parallel.model)
    if dist.is_main:
        save_file(weights, str(out / f"{name}.safetensors"))
    kernel = [k for k in ("fused", "foreach") if optimizer.defaults.get(k)]
    return {"reductions": per_step, "kernel": kernel}


if __name__ == "__main__":
    outdir = Path(sys.argv[1])
    rank_dist = setup("cpu")
    counter = Reductions()
    cases = {}
    for strategy in STRATEGIES:
        run = RunConfig(strategy=strategy, compile=True, activation_checkpointing=True)
        cases[f"compiled-{strategy}"] = case(outdir, f"compiled-{strategy}", run, OPTIM, STEPS, rank_dist,
                                             counter)
    for opt_name, opt_cfg in OPTIMIZERS.items():
        for strategy in STRATEGIES:
            name = f"{opt_name}-{strategy}"
            cases[name] = case(outdir, name, RunConfig(strategy=strategy, compile=False), opt_cfg,
                               OPTIMIZER_STEPS, rank_dist, counter)
    if rank_dist.is_main:
        (outdir / "cases.json").write_text(json.dumps(cases))
    # every rank done with its last collective before any tears the group down (fsdp_ranks.py: why)
    torch_dist.barrier()
    torch_dist.destroy_process_group()
