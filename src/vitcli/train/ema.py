"""Weight EMA with timm's ModelEmaV3 semantics: an exponential moving average of the model's
floating-point state (parameters and buffers, as ModelEmaV3 averages its state dict), updated after
each optimizer step.

    decay_t = ema_decay(t)                       t: optimizer steps done, 1 after the first (timm's train.py
    ema <- ema + (1 - decay_t) * (live - ema)    calls update(model, step=num_updates) after the step)

Written here rather than taken from timm, whose ModelEmaV3 keeps a deepcopy of the module: a copy of
an FSDP2-sharded module is not a module FSDP can gather, and evaluating or exporting the copy would
need the strategy's machinery twice. Here the average is a dict of tensors in the model's own layout
(a sharded model's EMA is sharded like it, DTensor for DTensor, so checkpoints.sharded saves it as
shards), and the model itself is evaluated and exported with the EMA swapped in
(`WeightEma.swapped`). The update is ModelEmaV3's: one `torch._foreach_lerp_` over every tensor (mul
and add where dtypes differ), its weight a host float, so nothing is read back from the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vitcli.errors import CheckpointError
from vitcli.recipe.schema import EmaConfig


def ema_decay(step: int, cfg: EmaConfig) -> float:
    """The decay of the update after optimizer step `step` (1 for the first): timm
    ModelEmaV3.get_decay.

    0 (a copy of the weights) for the first update_after_step + 1 steps; then ema.decay, or with
    ema.warmup 1 - (1 + t / gamma) ** -power for the t-th averaging step, capped at ema.decay and
    floored at ema.min_decay, so the average forgets the random initial weights at first and
    steadies later."""
    t = max(0, step - cfg.update_after_step - 1)
    if t <= 0:
        return 0.0
    if not cfg.warmup:
        return cfg.decay
    warm = 1 - (1 + t / cfg.warmup_gamma) ** -cfg.warmup_power
    return max(min(warm, cfg.decay), cfg.min_decay)


def ema_metric(name: str) -> str:
    """The name of a metric measured on the EMA weights: `val/top1` -> `val_ema/top1`,
    `fewshot/cifar100/5shot` -> `fewshot_ema/cifar100/5shot`."""
    split, _, rest = name.partition("/")
    return f"{split}_ema/{rest}"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (in place ops on it change the DTensor), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class WeightEma:
    """The EMA of `model`'s floating-point state dict entries, in fp32, on the model's device and in
    its layout. The model is passed to each call rather than held, its tensors looked up afresh each
    time (a state-dict walk): whatever replaces a parameter (load_state_dict(assign=True),
    module._apply, FSDP2 re-padding such a one at its first forward) cannot leave the EMA reading a
    stale tensor."""

    def __init__(self, model: nn.Module, cfg: EmaConfig):
        self.cfg = cfg
        live = _floating(model)
        # the initial value matters only before the first update, which copies the weights (decay 0)
        self.shadow = {k: v.detach().to(torch.float32, copy=True) for k, v in live.items()}
        self._averages = [_local(v) for v in self.shadow.values()]

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Average in the weights after optimizer step `step` (1 for the first): no host-device
        sync."""
        weight = 1.0 - ema_decay(step, self.cfg)
        live = [_local(v) for v in _floating(model).values()]
        if all(a.dtype == v.dtype for a, v in zip(self._averages, live, strict=True)):
            torch._foreach_lerp_(self._averages, live, weight)
        # ModelEmaV3's way for mixed dtypes: add promotes in its kernel, no cast copy of the model
        else:
            torch._foreach_mul_(self._averages, 1.0 - weight)
            torch._foreach_add_(self._averages, live, alpha=weight)

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self, model: nn.Module) -> Iterator[None]:
        """Inside, `model` holds the EMA weights, so evaluating or exporting it is evaluating or
        exporting the EMA; its own come back after, bit for bit. Costs one copy of the weights for
        the duration."""
        live = [_local(v) for v in _floating(model).values()]
        kept = [v.clone() for v in live]
        torch._foreach_copy_(live, self._averages)
        try:
            yield
        finally:
            torch._foreach_copy_(live, kept)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA tensors by the model's state-dict names (DTensors for a sharded model), not
        copied."""
        return dict(self.shadow)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a saved EMA in place (a checkpoint's: checkpoints.manager); a CheckpointError names
        the first tensor that this model lacks or that the saved EMA lacks."""
        odd = sorted(set(state) ^ set(self.shadow))
        if odd:
            raise CheckpointError(f"its EMA weights do not fit this model ({odd[0]} is in one only)")
        for k, v in self.shadow.items():
            v.copy_(state[k])


def _floating(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's floating-point state dict entries (what ModelEmaV3 averages; it copies the
    others, which the model's own then stand for)."""
    return {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
