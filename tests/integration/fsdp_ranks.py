"""What tests/integration/test_fsdp.py runs on 2 processes (torchrun, Gloo, CPU), in one launch:
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/integration/fsdp_ranks.py
OUTDIR`. Rank 0 writes what the tests compare into OUTDIR; the helpers here also give the tests
their one-process reference."""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from vitcli.checkpoints import manager
from vitcli.checkpoints import sharded as sharded_format
from vitcli.checkpoints.weights import save_weights
from vitcli.models.zoo import build_model
from vitcli.recipe.schema import EmaConfig, ModelConfig, OptimConfig
from vitcli.runtime.dist import Dist, setup
from vitcli.train import parallelize
from vitcli.train.ema import WeightEma
from vitcli.train.optim import build_optimizer

TINY = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
NUM_CLASSES, GLOBAL_BATCH, MICRO_BATCHES = 4, 8, 2  # per process: 2 micro-batches of 2 images
STEPS, SAVE_AT = 4, 2
OPTIM = OptimConfig(lr=1e-3, clip_grad_norm=0.05)  # a clip this low binds, so clipping is compared too
EMA = EmaConfig(decay=0.9, warmup=True)


def tiny_model(seed: int, cfg: ModelConfig = TINY) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_model(cfg, NUM_CLASSES)
    # the head starts at zero; give it weights so every parameter gets gradients at once
    with torch.no_grad():
        model.head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    return model


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same fixed (images (8, 3, 32, 32), labels (8,)) of `step` everywhere."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(GLOBAL_BATCH, 3, 32, 32, generator=g),
            torch.randint(0, NUM_CLASSES, (GLOBAL_BATCH,), generator=g))


def train(model, optimizer, start: int, stop: int, rank: int = 0, world: int = 1,
          micro: int = 1) -> list[float]:
    """Steps start..stop-1 on this process's share of each global batch, in `micro` micro-batches
    (the mean loss over the global batch, as the trainer's); the gradient norm of each step."""
    norms = []
    for step in range(start, stop):
        x, y = global_batch(step)
        share = GLOBAL_BATCH // world
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        optimizer.zero_grad(set_to_none=True)
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
            with parallelize.gradient_sync(model, i == micro - 1):
                (F.cross_entropy(model(xm), ym) / micro).backward()
        norms.append(float(parallelize.clip_grad_norm(model, OPTIM.clip_grad_norm)))
        optimizer.step()
    return norms


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, read from the parameters themselves (not through a state
    dict)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def sharded(seed: int, dist: Dist, activation_checkpointing: bool = False, cfg: ModelConfig = TINY):
    model = parallelize.shard(tiny_model(seed, cfg), dist, activation_checkpointing)
    return model, build_optimizer(model, OPTIM)


def straight_and_saved(out: Path, dist: Dist) -> None:
    """STEPS steps without a break, saving the sharded state at SAVE_AT on the way."""
    model, optimizer = sharded(0, dist)
    norms = train(model, optimizer, 0, SAVE_AT, dist.rank, dist.world_size, MICRO_BATCHES)
    extra = {"step": SAVE_AT, "recipe": {"run": {"strategy": "fsdp"}}, "data": {"position": SAVE_AT * 4},
             "rng": [torch.full((3,), r, dtype=torch.uint8) for r in range(dist.world_size)]}
    manager.save(out / "run", extra, model, optimizer, dist, keep=2, sharded=True)
    at_save = parallelize.full_model_state(model)
    norms += train(model, optimizer, SAVE_AT, STEPS, dist.rank, dist.world_size, MICRO_BATCHES)
    final, params = parallelize.full_model_state(model), full_params(model)
    if dist.is_main:
        save_weights(out / "at_save.safetensors", at_save, {})
        save_weights(out / "straight.safetensors", final, {"model": "tiny"})
        save_file(params, str(out / "params.safetensors"))
        (out / "norms.json").write_text(json.dumps(norms))


def resumed(out: Path, dist: Dist) -> None:
    """A fresh model (other initial weights) and optimizer, the state of SAVE_AT loaded, then the
    rest."""
    model, optimizer = sharded(1, dist)
    extra = sharded_format.load(out / "run" / f"state-{SAVE_AT}", model, optimizer)
    train(model, optimizer, extra["step"], STEPS, dist.rank, dist.world_size, MICRO_BATCHES)
    final = parallelize.full_model_state(model)
    if dist.is_main:
        save_weights(out / "resumed.safetensors", final, {})


def train_with_ema(model, optimizer, ema: WeightEma, start: int, stop: int, rank: int = 0, world: int = 1,
                   micro: int = 1) -> None:
    """`train`, with the EMA updated after each optimizer step as the loop updates it."""
    for step in range(start, stop):
        train(model, optimizer, step, step + 1, rank, world, micro)
        ema.update(model, step + 1)


def whole(state: dict) -> dict[str, torch.Tensor]:
    """A state dict with every DTensor gathered whole (every process calls it)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def ema_saved_and_resumed(out: Path, dist: Dist) -> None:
    """The EMA beside sharded training: STEPS steps saving at SAVE_AT, then the state of SAVE_AT
    loaded into a fresh model, optimizer and EMA and the rest run. Written: both EMAs gathered
    whole, the model's state gathered with the EMA swapped in and after it, and the logits of a
    forward under `gathered` (the evaluators' path) with the EMA swapped in."""
    model, optimizer = sharded(0, dist)
    ema = WeightEma(model, EMA)  # before the first forward, as the loop makes it
    train_with_ema(model, optimizer, ema, 0, SAVE_AT, dist.rank, dist.world_size, MICRO_BATCHES)
    extra = {"step": SAVE_AT, "recipe": {"run": {"strategy": "fsdp"}}}
    manager.save(out / "ema_run", extra, model, optimizer, dist, keep=2, sharded=True, ema=ema)
    train_with_ema(model, optimizer, ema, SAVE_AT, STEPS, dist.rank, dist.world_size, MICRO_BATCHES)
    straight = whole(ema.state_dict())
    with ema.swapped(model):
        swapped = parallelize.full_model_state(model)
        with parallelize.gathered(model), torch.no_grad():
            logits = model(global_batch(0)[0])
    after, params = parallelize.full_model_state(model), full_params(model)
    model, optimizer = sharded(1, dist)
    fresh = WeightEma(model, EMA)
    sharded_format.load(out / "ema_run" / f"state-{SAVE_AT}", model, optimizer, dist.control,
                        states={"ema": fresh.state_dict()})
    train_with_ema(model, optimizer, fresh, SAVE_AT, STEPS, dist.rank, dist.world_size, MICRO_BATCHES)
    resumed = whole(fresh.state_dict())
    if dist.is_main:
        for name, tensors in (("straight", straight), ("swapped", swapped), ("after", after),
                              ("params", params), ("resumed", resumed), ("logits", {"logits": logits})):
            save_file(tensors, str(out / f"ema_{name}.safetensors"))


def checkpointed_grads(out: Path, dist: Dist) -> None:
    """One backward with and without activation checkpointing; dropout and drop-path on, so the
    recomputation must replay the same random draws."""
    cfg = ModelConfig(**{**TINY.__dict__, "dropout": 0.1, "drop_path": 0.1})
    for ac in (False, True):
        model, _ = sharded(0, dist, ac, cfg)
        x, y = global_batch(0)
        torch.manual_seed(7 + dist.rank)
        F.cross_entropy(model(x[dist.rank::dist.world_size]), y[dist.rank::dist.world_size]).backward()
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                 for n, p in model.named_parameters()}
        if dist.is_main:
            save_file(grads, str(out / f"grads_ac_{ac}.safetensors"))


if __name__ == "__main__":
    outdir = Path(sys.argv[1])
    rank_dist = setup("cpu")
    straight_and_saved(outdir, rank_dist)
    resumed(outdir, rank_dist)
    ema_saved_and_resumed(outdir, rank_dist)
    checkpointed_grads(outdir, rank_dist)
    # every rank done with its last collective before any tears the group down: a rank that destroys
    # it while the other still finishes (rank 0 writing its files) now and then aborted at exit
    # (SIGABRT, ~1 run in 10)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
