"""Mixed precision: bf16 autocast for matmuls; weights, optimizer state and the loss stay fp32."""

from __future__ import annotations

import contextlib

import torch


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CPU or CUDA when asked for, a no-op context for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
