"""The denominator of MFU: the peak FLOP/s of the device a run trained on, and where that figure
came from.

A known GPU's peak is read from its datasheet (dense tensor-core figures, not the 2x "with sparsity"
ones); an unknown GPU's, and a CPU's, is measured: the FLOP/s of one large matmul at the run's
precision, the most this device attains on the operation a ViT spends its time in.
"""

from __future__ import annotations

import functools
import re
import time

import torch

# Dense TFLOP/s per precision, NVIDIA datasheets (H100/H200 SXM and PCIe, A100, L4, A10, V100) and
# the Ada whitepaper (RTX 4090): tf32 is fp32 matmuls on tensor cores (runtime.dist turns it on),
# fp32 the plain CUDA cores. Patterns, first match wins, are searched in
# torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe
# one; other H100/H200 variants (NVL) are left to the measurement rather than given a wrong figure.
# V100 has no bf16 (emulated): none listed, so it is measured. fp32 on CUDA is counted as tf32 when
# TF32 is on (`column`).
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100 (80GB HBM3|SXM)", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    # the H100 SXM's compute, more memory
    (r"H200(?! NVL)", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),  # not A100, not A10G
    (r"V100-SXM", {"fp32": 15.7}),  # the PCIe cards run lower clocks (14): measured
    (r"RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
)


def table_peak(device_name: str, column: str) -> float | None:
    """FLOP/s the datasheet gives `device_name` at `column` (bf16, tf32 or fp32); None when not
    listed."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks[column] * 1e12 if column in peaks else None
    return None


def column(precision: str, device: torch.device) -> str:
    """The datasheet column a run's matmuls use: bf16, or for fp32 on CUDA tf32 when TF32 is on."""
    if precision == "bf16":
        return "bf16"
    tf32 = device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
    return "tf32" if tf32 else "fp32"


def matmul_flops(precision: str, n: int, reps: int, device: torch.device | None = None) -> float:
    """FLOP/s of an (n x n) @ (n x n) matmul in `precision` on `device` (the CPU by default), after
    one warm-up product (oneDNN and cuBLAS pick and cache their kernel)."""
    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def peak_flops(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s of one `device` at `precision`, where the figure came from): the datasheet's for
    a listed GPU, else a measured (n x n) matmul, 2048 on a CPU and 8192 on a GPU, repeated for
    about a quarter second; once per process."""
    col = column(precision, device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        listed = table_peak(name, col)
        if listed:
            return listed, f"table: {name} {col}"
    n = 8192 if device.type == "cuda" else 2048
    first = matmul_flops(precision, n, 1, device)
    # about a quarter second, emulated bf16 too
    reps = min(20, max(1, round(0.25 * first / (2 * n**3))))
    return matmul_flops(precision, n, reps, device), f"measured {n}^2 {col} matmul"


def mfu(img_per_s: float, flops_per_image: float, peak: float) -> float:
    """Model FLOPs utilisation: the model's FLOP/s (images/s x FLOPs per image) over the peak
    FLOP/s."""
    return img_per_s * flops_per_image / peak
