"""FSDP2 for the one loop (run.strategy: fsdp): shard a model block by block, checkpoint activations, and save
and load sharded training state.

`fully_shard` turns each parameter into a DTensor split on dim 0 over the processes; a block's full weights are
all-gathered just before its forward (and again before its backward) and freed after, and its gradients are
reduce-scattered, averaged over processes as DDP averages them. So a process keeps 1/N of the weights,
gradients and Adam slots plus one block at full size. The root is sharded last and owns what no block does
(patch embedding, position tables, class token, head).

A sharded checkpoint is the directory `WORKDIR/state-<step>/` (layout and discovery in checkpoints.state).
Each process writes its own shard with torch.distributed.checkpoint (DCP), which also reads them back into any
number of processes, sharded or not, so a run may resume on another process count.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from vitcli.checkpoints import state
from vitcli.errors import CheckpointError, ModelError
from vitcli.runtime import files
from vitcli.runtime.dist import Dist, barrier


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of any of our models, in order: the children of each nn.Sequential named `blocks`
    whose children have an `attn` (timm's and our ViT, T2T-ViT, an MppModel's backbone). The `attn` test leaves
    out the bottleneck `blocks` of a hybrid's ResNet stages."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "blocks" and isinstance(module, nn.Sequential):
            found += [block for block in module if hasattr(block, "attn")]
    return found


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing on every transformer block: its inputs are kept, its activations recomputed in
    the backward pass (same gradients; dropout and drop-path replay the same draws, the RNG state is restored).

    The composable `torch.distributed._composable.checkpoint` rather than `checkpoint_wrapper` or timm's
    `set_grad_checkpointing`: it works through hooks, so parameter names and state-dict keys stay those of the
    plain model (checkpoints, no-decay names and model.safetensors are unchanged); it composes with fully_shard
    applied after it on the same module (torch's own FSDP2 tests do exactly that); and timm's flag would miss
    the blocks that MppModel and T2T-ViT run themselves."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ModelError(f"run.activation_checkpointing: {type(model).__name__} has no transformer blocks (no "
                         "nn.Sequential `blocks` of attention blocks); set run.activation_checkpointing=false")
    for block in blocks:
        checkpoint_activations(block)
    return model


def shard(model: nn.Module, dist: Dist, activation_checkpointing: bool = False) -> nn.Module:
    """FSDP2 on each transformer block, then on the root; activation checkpointing first, if asked.

    Call it after model.to(dist.device) and before building the optimizer: fully_shard replaces the parameters
    by sharded DTensors, which the optimizer must hold. With one process there is nothing to shard over, and
    the model comes back unsharded (checkpoints are still directories: sharding.save works on any model).
    A model without blocks (a ResNet) is sharded as one unit at the root.
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
    """Inside, backward reduces gradients across processes (`sync`) or only accumulates them locally (the
    micro-batches before the last): FSDP2's set_requires_gradient_sync and DDP's no_sync behind one switch."""
    if sync:
        yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)  # the gradients are kept unsharded until the syncing backward
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    else:
        yield


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm to `max_norm` (<= 0: only measure it); return it as a 0-d tensor, not read
    (no host-device sync). Sharded gradients give a DTensor norm whose local value is a partial result, so it is
    gathered to the global one first."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Inside, a sharded model holds its whole weights on every rank and its forward passes are local.

    A sharded forward is collective (each block all-gathers its weights), so ranks with different numbers of
    evaluation batches would wait on each other forever; unsharded once for the whole evaluation, each rank runs
    its own rows. Costs one full copy of the weights per process for the duration. No-op on other models."""
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
        model.set_reshard_after_forward(True)  # fully_shard's defaults: blocks reshard after forward,
        model.set_reshard_after_forward(False, recurse=False)  # the root keeps its weights for the backward


def save(workdir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, dist: Dist,
         keep: int) -> Path:
    """Write WORKDIR/state-<extra["step"]>/ and keep the `keep` newest checkpoints; return its path. Every
    process calls it (each writes its shard); `extra` is the non-tensor part, rank 0's copy is written.

    Into a temporary directory first; after a barrier (every shard written) rank 0 adds `extra` and seals it
    (SHA256SUMS, fsync, one rename, files.atomic_dir), so `state-<step>/` exists only whole. Save after an
    optimizer step: an optimizer without state would get one from torch's step at lr 0 (Adam's count at 1).
    """
    step = int(extra["step"])
    if dist.is_main:
        state.discard_from(workdir, step)
    sealing = files.atomic_dir(state.checkpoint_dir(workdir, step)) if dist.is_main else contextlib.nullcontext()
    with sealing as tmp:
        tmp = _rank0_path(tmp, dist)
        model_state, optim_state = get_state_dict(model, optimizer)
        with _single_process_is_intended():
            dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp, no_dist=dist.world_size == 1)
        barrier(dist)
        if dist.is_main:
            state.write_extra(tmp, extra)
    if dist.is_main:
        state.keep_newest(workdir, keep)
    barrier(dist)  # no process moves on (or reads it) before the checkpoint is in place
    return state.checkpoint_dir(workdir, step)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without DCP's warning on each save and load of a one-process run ("assuming the intent is to save in a
    single process"): it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rank0_path(path: Path | None, dist: Dist) -> Path:
    """Rank 0's temporary directory, made known to every process."""
    if dist.world_size == 1:
        return path
    box = [str(path) if dist.is_main else None]
    torch_dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Read the checkpoint directory `path` into the live model and optimizer (already sharded as they will
    train, on any number of processes); return its extra part. Every process calls it.

    The manifest is verified first, so no damaged byte is read; DCP's own index (.metadata) is a pickle, read
    only once its checksum matches. The tensors load in place through DCP, which reshards them as needed.
    """
    extra = state.verified_extra(path)
    # the layout to fill; an optimizer without state (a fresh one) first gets it from a step at lr 0
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optimizer": optim_state}
    try:
        with _single_process_is_intended():
            dcp.load(loaded, checkpoint_id=path, no_dist=not torch_dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException
        raise CheckpointError(f"{path}: does not fit this model and optimizer ({_first_failure(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    return extra


def _first_failure(error: BaseException) -> str:
    """`Type: message` of the first rank's error that a CheckpointException carries (its str is a traceback
    per rank), or of the error itself; first line only."""
    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU, with the plain model's keys, on rank 0 ({} elsewhere), for
    model.safetensors. Every process calls it: the shards are gathered."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
