"""What tests/integration/test_layer_decay_training.py runs on 2 processes (torchrun, Gloo, CPU):
FSDP2 with optim.layer_decay, the sharded state saved on the way and resumed. Rank 0 writes the
final weights of the straight and the resumed run into OUTDIR; `steps` gives the test its
one-process reference."""

import dataclasses
import sys
from pathlib import Path

import torch
from fsdp_ranks import OPTIM, SAVE_AT, STEPS, tiny_model, train
from safetensors.torch import save_file

from vitcli.checkpoints import manager, sharded
from vitcli.runtime.dist import Dist, setup
from vitcli.train import parallelize
from vitcli.train.optim import build_optimizer

CFG = dataclasses.replace(OPTIM, weight_decay=0.05, layer_decay=0.5)
MULTIPLIERS = [0.5, 1.0, 0.8, 0.3]  # a schedule's factor on the peak lr at each of the STEPS steps


def steps(model, optimizer, start: int, stop: int, dist: Dist | None = None) -> None:
    """Steps start..stop-1, each at the schedule's lr times its group's scale (as loop._set_lr sets
    it); with `dist`, this process's share of each global batch in 2 micro-batches."""
    for step in range(start, stop):
        for group in optimizer.param_groups:
            group["lr"] = CFG.lr * MULTIPLIERS[step] * group["lr_scale"]
        share = (dist.rank, dist.world_size, 2) if dist else ()
        train(model, optimizer, step, step + 1, *share)


def sharded_run(seed: int, dist: Dist):
    model = parallelize.shard(tiny_model(seed), dist, False)
    return model, build_optimizer(model, CFG)


if __name__ == "__main__":
    out, rank_dist = Path(sys.argv[1]), setup("cpu")
    model, optimizer = sharded_run(0, rank_dist)
    steps(model, optimizer, 0, SAVE_AT, rank_dist)
    extra = {"step": SAVE_AT, "recipe": {"run": {"strategy": "fsdp"}}, "data": {},
             "rng": [torch.zeros(3, dtype=torch.uint8)] * rank_dist.world_size}
    manager.save(out / "run", extra, model, optimizer, rank_dist, keep=1, sharded=True)
    steps(model, optimizer, SAVE_AT, STEPS, rank_dist)
    straight = parallelize.full_model_state(model)
    model, optimizer = sharded_run(1, rank_dist)  # other initial weights: all comes from the state
    sharded.load(out / "run" / f"state-{SAVE_AT}", model, optimizer)
    steps(model, optimizer, SAVE_AT, STEPS, rank_dist)
    resumed = parallelize.full_model_state(model)
    if rank_dist.is_main:
        save_file(straight, str(out / "straight.safetensors"))
        save_file(resumed, str(out / "resumed.safetensors"))
    torch.distributed.barrier()  # as fsdp_ranks: no rank tears the group down while the other still works
    torch.distributed.destroy_process_group()
