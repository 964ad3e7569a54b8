"""Mixed precision: bf16 autocast for matmuls; weights, optimizer state and the loss stay fp32."""

from __future__ import annotations

import contextlib
import functools

import torch


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CPU or CUDA when asked for, a no-op context for fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@functools.cache
def bf16_warning(device_type: str) -> str | None:
    """Why bf16 would be slow here, or None. A CPU without AVX-512 bf16 emulates it (we measured ~13x slower)."""
    if device_type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this CPU has no native bf16: run.precision=bf16 is emulated and much slower; use fp32"
    return None
