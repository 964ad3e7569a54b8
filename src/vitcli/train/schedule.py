"""The learning-rate schedule: a pure function of the step, as big_vision and nanoGPT write it."""

from __future__ import annotations

import math


def learning_rate(
    step: int, *, peak_lr: float, total_steps: int, warmup_steps: int, decay: str, end_lr: float = 0.0
) -> float:
    """Learning rate for optimizer step `step` (0-based).

    1. Linear warmup from 0: lr = peak * step / warmup (big_vision's convention, so step 0 has lr
    0).
    2. Then decay over the remaining steps with progress p = (step - warmup) / (total - warmup) in
    [0, 1]:
       linear: end + (peak - end) * (1 - p); cosine: end + (peak - end) * (1 + cos(pi p)) / 2;
       constant: peak.
    """
    if warmup_steps and step < warmup_steps:
        return peak_lr * step / warmup_steps
    if decay == "constant":
        return peak_lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return end_lr + (peak_lr - end_lr) * (1.0 - progress)
    if decay == "cosine":
        return end_lr + (peak_lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown decay {decay!r}")


def total_steps(steps: int, epochs: float, train_size: int, batch_size: int) -> int:
    """Optimizer steps for the run: `steps` if set, else ceil(epochs x train_size / global
    batch)."""
    if steps:
        return steps
    return max(1, math.ceil(epochs * train_size / batch_size))
