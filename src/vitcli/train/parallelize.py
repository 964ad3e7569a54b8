"""Parallelism, applied once before the loop (`apply`, torchtitan's parallelize): DDP or FSDP2
(run.strategy), activation checkpointing, torch.compile; and the few operations that differ between
them, behind one call each (gradient sync, clipping, evaluation, the full weights), so the loop
never asks which strategy it runs under.

`fully_shard` turns each parameter into a DTensor split on dim 0 over the processes; a block's full
weights are all-gathered just before its forward (and again before its backward) and freed after,
and its gradients are reduce-scattered, averaged over processes as DDP averages them. So a process
keeps 1/N of the weights, gradients and Adam slots plus one block at full size. The root is sharded
last and owns what no block does (patch embedding, position tables, class token, head).

A sharded model is checkpointed as shards (checkpoints.sharded, through checkpoints.manager).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from vitcli.errors import ModelError
from vitcli.recipe.schema import RunConfig
from vitcli.runtime.dist import Dist, wrap


@dataclass
class Parallel:
    """A model as the loop trains it (`apply`).

    `train`: what runs forward and backward (DDP-wrapped, and compiled if asked); `model`: the
    module whose parameters the optimizer holds and whose state is saved, evaluated and exported
    (sharded with FSDP, never compiled, so its state dict has the plain names); `sharded`: its state
    is sharded over the processes, so it is checkpointed as shards (checkpoints.sharded); `synced`:
    `train` before torch.compile (the DDP wrapper, or the sharded model), the module whose gradient
    sync the micro-batches switch."""

    train: nn.Module
    model: nn.Module
    sharded: bool
    synced: nn.Module

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        """`gradient_sync` of the strategy's own module: a compiled one (torch's OptimizedModule) is
        neither an FSDPModule nor a DDP, so FSDP asked through it would reduce-scatter at every
        micro-batch."""
        return gradient_sync(self.synced, sync)

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole state dict of `module` (self.model or a part of it), the same whatever the
        strategy: a sharded one's shards are gathered onto rank 0's CPU ({} on other ranks). Every
        process calls it."""
        return full_model_state(module) if self.sharded else module.state_dict()


def apply(model: nn.Module, run: RunConfig, dist: Dist) -> Parallel:
    """The model (already on dist.device) as it trains: activation checkpointing
    (run.activation_checkpointing), then FSDP2 (run.strategy fsdp) or DDP, then torch.compile
    (run.compile). Call it before building the optimizer, on `.model`: sharding replaces the
    parameters."""
    # "auto" would read as true here: resolve it for the device first
    if not isinstance(run.compile, bool):
        raise TypeError(f"run.compile {run.compile!r}: pass the resolved one (precision.resolved_compile)")
    sharded = run.strategy == "fsdp"
    if sharded:
        model = shard(model, dist, run.activation_checkpointing)
    elif run.activation_checkpointing:
        model = checkpoint_blocks(model)
    synced = model if sharded else wrap(model, dist)
    return Parallel(torch.compile(synced) if run.compile else synced, model, sharded, synced)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of any of our models, in order: the children of each nn.Sequential
    named `blocks` whose children have an `attn` (timm's and our ViT, T2T-ViT, an MppModel's
    backbone). The `attn` test leaves out the bottleneck `blocks` of a hybrid's ResNet stages."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(module, nn.Sequential):
            found += [block for block in module if hasattr(block, "attn")]
    return found


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing on every transformer block: its inputs are kept, its activations
    recomputed in the backward pass (same gradients; dropout and drop-path replay the same draws,
    the RNG state is restored).

    Each block's own `forward` runs inside torch.utils.checkpoint.checkpoint (non-reentrant), set on
    the instance: parameter names and state-dict keys stay those of the plain model (checkpoints,
    no-decay names and model.safetensors are unchanged), unlike `checkpoint_wrapper`; fully_shard
    applied after it composes (its hooks gather the weights around the block's call, and again
    before the backward that recomputes); timm's `set_grad_checkpointing` would miss the blocks that
    MppModel and T2T-ViT run themselves. Not the hook-based
    torch.distributed._composable.checkpoint: torch.compile cannot trace its hooks, and the
    whole-model compile of `apply` then failed at the first backward (CheckpointError: the forward
    had saved the compiled graph's tensors, the recomputation ran the eager block; first seen on an
    H100 by make gpu-check). A checkpoint call inside forward is traced as one region, which the
    compiled backward recomputes itself."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ModelError(f"run.activation_checkpointing: {type(model).__name__} has no transformer blocks "
                         "(no nn.Sequential `blocks` of attention blocks); "
                         "set run.activation_checkpointing=false")
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def shard(model: nn.Module, dist: Dist, activation_checkpointing: bool = False) -> nn.Module:
    """FSDP2 on each transformer block, then on the root; activation checkpointing first, if asked.

    Call it after model.to(dist.device) and before building the optimizer: fully_shard replaces the
    parameters by sharded DTensors, which the optimizer must hold. With one process there is nothing
    to shard over, and the model comes back unsharded (checkpoints are still directories:
    checkpoints.sharded works on any model). A model without blocks (a ResNet) is sharded as one
    unit at the root.
    """
    if activation_checkpointing:
        checkpoint_blocks(model)
    if dist.world_size == 1:
        return model
    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside, backward reduces gradients across processes (`sync`) or only accumulates them locally
    (the micro-batches before the last): FSDP2's set_requires_gradient_sync and DDP's no_sync behind
    one switch. `model` is never a compiled module: Parallel.gradient_sync passes the one
    beneath."""
    if _compiled(model):
        raise TypeError(f"gradient_sync of a compiled {type(model._orig_mod).__name__}: pass the module "
                        "torch.compile wrapped (Parallel.gradient_sync does), or every micro-batch syncs")
    if sync:
        yield
    elif isinstance(model, FSDPModule):
        # the gradients are kept unsharded until the syncing backward
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def _compiled(model: nn.Module) -> bool:
    """Whether `model` is torch.compile's wrapper (an OptimizedModule, whose `_orig_mod` is the
    module), told without importing torch._dynamo (~0.5 s) into every stage that imports this
    module."""
    return isinstance(getattr(model, "_orig_mod", None), nn.Module)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to `max_norm` (<= 0: only measure it); return it as a 0-d
    tensor, not read (no host-device sync). Sharded gradients give a DTensor norm whose local value
    is a partial result, so it is gathered to the global one first."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside, a sharded model holds its whole weights on every rank and its forward passes are
    local.

    A sharded forward is collective (each block all-gathers its weights), so ranks with different
    numbers of evaluation batches would wait on each other forever; unsharded once for the whole
    evaluation, each rank runs its own rows. Costs one full copy of the weights per process for the
    duration. No-op on other models."""
    if not isinstance(model, FSDPModule):
        yield
        return
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)
    for m in fsdp_modules:
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()
        # fully_shard's defaults: blocks reshard after forward,
        model.set_reshard_after_forward(True)
        # the root keeps its weights for the backward
        model.set_reshard_after_forward(False, recurse=False)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU, with the plain model's keys, on rank 0 ({}
    elsewhere), for model.safetensors. Every process calls it: the shards are gathered."""
    # torch.distributed.checkpoint, here and not above: importing it takes seconds that an unsharded
    # run (this is asked only of a sharded one) would spend for nothing
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
