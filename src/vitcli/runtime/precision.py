"""Mixed precision: bf16 autocast for matmuls; weights, optimizer state and the loss stay fp32. And
the other per-device choice a recipe may leave to `auto`, run.compile.

`run.precision: auto` is resolved once per run, when the device is known (`resolved`): bf16 where
the device runs it natively, fp32 where bf16 would be emulated. Everything downstream (the trainer's
autocast, the evaluators, few-shot extraction and its cache key, the resume check, the checkpoints'
recipe) reads the resolved recipe, so it only ever sees `fp32` or `bf16`. `run.compile: auto` is
resolved beside it (`resolved_compile`) to true or false.

Inference (predict, evaluate, eval-fewshot) resolves by `resolved_for`: there `auto` is fp32 on a
CPU, as timm's and transformers' inference run, and only an explicit run.precision=bf16 gives bf16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable

import torch

from vitcli.recipe.schema import Recipe

# device -> (runs bf16 natively, what was detected)
Detect = Callable[[torch.device], tuple[bool, str]]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on CPU or CUDA when asked for, a no-op context for fp32."""
    # `auto` reaching here would silently mean fp32: resolve it first
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r}: pass the resolved one (precision.resolved), fp32 or bf16")
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _cpu_features() -> dict:
    # torch's own cpuinfo read ({'avx512_bf16': True, 'amx_bf16': False, ...}); private,
    # so tolerate its absence
    probe = getattr(torch._C._cpu, "_get_cpu_capability", None)
    features = dict(probe()) if probe else {}
    tile = getattr(torch._C._cpu, "_is_amx_tile_supported", None)  # in some torch versions only
    features["amx_bf16"] = bool(features.get("amx_bf16") or (tile and tile()))
    return features


def cpu_bf16(features: dict, onednn_bf16: bool, isa: str) -> tuple[bool, str]:
    """(native bf16, what was detected) for a CPU with cpuinfo `features`, oneDNN's own bf16 test
    and the vector ISA torch dispatches to (`AVX2`, `AVX512`, ...)."""
    if features.get("amx_bf16"):
        return True, "CPU has AMX"
    if onednn_bf16:  # AVX-512 cores; the avx512_bf16 instructions make it fast, not only possible
        return True, ("CPU has AVX-512 bf16" if features.get("avx512_bf16")
                      else "CPU has AVX-512 (oneDNN bf16)")
    return False, f"CPU has only {isa}: bf16 would be emulated"


def confirmed(native: bool, found: str, speedup: float | None) -> tuple[bool, str]:
    """A CPU's flags say bf16 is native; `speedup` (bf16 matmul FLOP/s over fp32's, measured here)
    says whether it pays. Measured because the flags are not enough: a 2-core AVX-512 bf16 Xeon of
    ours ran bf16 matmuls at 0.54x fp32 (163 vs 303 GFLOP/s) and ViT-Ti training at 0.6x, since
    oneDNN takes no bf16 fast path there."""
    if not native or speedup is None:
        return native, found
    if speedup < 1.0:
        return False, f"{found}, but bf16 matmuls measured {speedup:.2f}x fp32 here"
    return True, f"{found} (bf16 matmuls measured {speedup:.1f}x fp32)"


def bf16_speedup(n: int = 1024, seconds: float = 0.05) -> float:
    """bf16 over fp32 FLOP/s of an (n x n) matmul on this CPU: the best of two interleaved rounds of
    about `seconds` each per dtype, so neither side pays alone for the thread pool's or oneDNN's
    first use."""
    pairs = {dtype: (torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(pairs, 0.0)
    for _ in range(2):
        for dtype, (a, b) in pairs.items():
            a @ b  # oneDNN picks and caches its kernel
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a @ b
                reps += 1
            best[dtype] = max(best[dtype], reps / (time.perf_counter() - t0))
    return best[torch.bfloat16] / best[torch.float32]


@functools.cache
def detect_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` runs bf16 matmuls natively and faster than fp32, and what was detected (for
    the run's announce line). On a CPU whose flags say yes, a 0.2 s matmul probe confirms it (once
    per process)."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"{torch.cuda.get_device_name(device)} {'has' if native else 'lacks'} native bf16"
    if device.type != "cpu":
        return False, f"{device.type}: native bf16 not known"
    native, found = cpu_bf16(_cpu_features(), torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                             torch.backends.cpu.get_cpu_capability())
    return confirmed(native, found, bf16_speedup() if native else None)


def choose(pref: str, device: torch.device, detect: Detect | None = None) -> tuple[str, str]:
    """(precision, why): `auto` takes bf16 where `device` runs it natively, else fp32; fp32/bf16 are
    kept.

    `detect` defaults to detect_bf16, looked up at call time so tests can stand in for either
    machine."""
    if pref != "auto":
        return pref, "run.precision"
    native, found = (detect or detect_bf16)(device)
    return ("bf16" if native else "fp32"), f"auto: {found}"


def resolved(recipe: Recipe, device: torch.device, detect: Detect | None = None) -> tuple[Recipe, str]:
    """The recipe with run.precision chosen for `device` (never `auto`), and why."""
    precision, why = choose(recipe.run.precision, device, detect)
    return dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, precision=precision)), why


# the commands that only run a network forward. timm's inference.py and validate.py and transformers'
# pipeline compute these in fp32 unless asked: bf16 put a photograph's probabilities 9.9e-3 from
# transformers' pipeline where fp32 sits at 2.1e-6 (issue 47), so on a CPU `auto` means fp32 here
INFERENCE = ("predict", "evaluate", "eval-fewshot")


def choose_for(stage: str, pref: str, device: torch.device, trained: str | None = None,
               detect: Detect | None = None) -> tuple[str, str]:
    """(precision, why) `stage` computes in on `device` when the recipe says `pref`: an explicit
    fp32/bf16 always; for training, `auto` as `choose` decides; for inference (INFERENCE), `auto`
    is fp32 on a CPU and elsewhere the precision our own checkpoint `trained` at (its resolved
    run.precision, None for a foreign file), else `choose`'s."""
    if pref != "auto":
        return pref, f"run.precision={pref}"
    if stage not in INFERENCE:
        return choose(pref, device, detect)
    if device.type == "cpu":
        return "fp32", "run.precision=auto on cpu"
    if trained in ("fp32", "bf16"):
        return trained, f"run.precision=auto on {device.type}: the checkpoint's own, as it trained"
    chosen, found = choose(pref, device, detect)
    return chosen, f"run.precision=auto on {device.type}: {found.removeprefix('auto: ')}"


def resolved_for(recipe: Recipe, device: torch.device, trained: str | None = None,
                 detect: Detect | None = None) -> tuple[Recipe, str]:
    """The recipe with run.precision chosen for its stage on `device` (choose_for), and why."""
    precision, why = choose_for(recipe.stage, recipe.run.precision, device, trained, detect)
    return dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, precision=precision)), why


def choose_compile(setting: bool | str, device: torch.device) -> tuple[bool, str]:
    """(compile, why): `auto` compiles where the device gains from it, CUDA with a GPU Triton
    compiles for; true/false are kept."""
    if setting != "auto":
        return bool(setting), "run.compile"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 0):  # inductor generates Triton kernels, which need Volta or newer
            return False, f"auto: Triton needs compute capability 7.0+, this GPU has {major}.{minor}"
        # published ViT figures: a 22M-parameter ViT on one H100 trains at 1,608 img/s eager, 5,560
        # compiled
        return True, "auto: CUDA gains ~3x"
    # bench/run.py, ours_compile_img_s over ours_img_s, ViT-Ti/16 at 224 px
    if device.type == "cpu":
        return False, "auto: the CPU gains nothing, measured 0.89x at ViT-Ti/16 on 2 cores"
    return False, f"auto: {device.type}: no gain known"


def resolved_compile(recipe: Recipe, device: torch.device) -> tuple[Recipe, str]:
    """The recipe with run.compile chosen for `device` (never `auto`), and why."""
    compile_, why = choose_compile(recipe.run.compile, device)
    return dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, compile=compile_)), why


def auto_choices(recipe: Recipe, device: torch.device) -> list[str]:
    """What `auto` in run.precision and (for a training stage) run.compile becomes on `device`, and
    why: the lines `--dry-run` prints."""
    lines = []
    if recipe.run.precision == "auto":
        chosen, why = choose_for(recipe.stage, "auto", device)
        # the stages that pass `trained` (it is read with the checkpoint, when the run starts)
        if recipe.stage in ("predict", "evaluate") and device.type != "cpu":
            why += "; a vitcli checkpoint keeps the precision it trained at"
        lines.append(f"run.precision: auto -> {chosen} ({why})")
    if recipe.run.compile == "auto" and recipe.stage in ("pretrain", "finetune"):
        chosen, why = choose_compile("auto", device)
        lines.append(f"run.compile: auto -> {str(chosen).lower()} ({why})")
    return lines


def bf16_warning(device: torch.device, detect: Detect | None = None) -> str | None:
    """Why bf16 would be slow here, or None. A CPU without AVX-512 bf16 emulates it
    (we measured ~13x slower)."""
    native, found = (detect or detect_bf16)(device)
    if device.type == "cpu" and not native:
        return f"{found}: run.precision=bf16 is much slower here; use fp32 or auto"
    return None
