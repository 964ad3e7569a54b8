"""run.precision: `auto` becomes bf16 where the device runs it natively and fp32 where it would be
emulated, judged by the CPU's flags, then by a measured matmul (the runs that announce and record
it: integration/test_precision_runs.py). run.compile: `auto` compiles on CUDA, not on a CPU; TF32 is
turned on for CUDA devices and announced."""

import pytest
import torch

from helpers import machine
from vitcli.recipe.resolve import resolve
from vitcli.run import build as run_build
from vitcli.runtime import dist, precision

CPU = torch.device("cpu")
AVX512_BF16 = {"avx512_bf16": True, "avx512_f": True, "amx_bf16": False}
AVX2 = {"avx2": True, "avx512_bf16": False, "amx_bf16": False}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("native,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_takes_bf16_only_where_it_is_native(native, expected):
    chosen, why = precision.choose("auto", CPU, machine(native))
    assert chosen == expected and ("AVX-512 bf16" if native else "emulated") in why
    for pinned in ("fp32", "bf16"):  # an explicit choice is kept on either machine
        assert precision.choose(pinned, CPU, machine(native))[0] == pinned


@pytest.mark.parametrize("features,onednn,isa,expected", [
    (AVX512_BF16, True, "AVX512", (True, "CPU has AVX-512 bf16")),
    ({**AVX2, "amx_bf16": True}, True, "AVX512", (True, "CPU has AMX")),
    (AVX2, False, "AVX2", (False, "CPU has only AVX2: bf16 would be emulated")),
])
def test_the_cpu_verdict_names_what_it_found(features, onednn, isa, expected):
    assert precision.cpu_bf16(features, onednn, isa) == expected


def test_this_machine_is_judged_by_its_flags_then_by_a_measured_matmul():
    native, found = precision.detect_bf16(CPU)
    flags = torch.ops.mkldnn._is_mkldnn_bf16_supported() or precision._cpu_features()["amx_bf16"]
    assert native <= flags  # never bf16 without the instructions
    assert ("measured" in found) == flags  # with them, the probe had the last word and says so


@pytest.mark.parametrize("speedup,expected", [
    (None, (True, "CPU has AVX-512 bf16")),  # not measured: the flags stand
    (0.54, (False, "CPU has AVX-512 bf16, but bf16 matmuls measured 0.54x fp32 here")),
    (3.9, (True, "CPU has AVX-512 bf16 (bf16 matmuls measured 3.9x fp32)")),
])
def test_a_measured_bf16_slowdown_overrules_the_flags(speedup, expected):
    assert precision.confirmed(True, "CPU has AVX-512 bf16", speedup) == expected
    assert precision.confirmed(False, "CPU has only AVX2", speedup) == (False, "CPU has only AVX2")


def test_the_matmul_probe_times_both_precisions():
    ratio = precision.bf16_speedup(n=64, seconds=0.01)
    assert 0.01 < ratio < 100  # a ratio of two positive rates, whatever this CPU is


def test_explicit_bf16_warns_only_on_an_emulating_cpu():
    assert "emulated" in precision.bf16_warning(CPU, machine(False))
    assert precision.bf16_warning(CPU, machine(True)) is None


def test_unresolved_auto_cannot_reach_autocast():
    with pytest.raises(ValueError, match="resolved"):
        precision.autocast(CPU, "auto")


# ---------------------------------------------------------------- run.compile: auto, and TF32 on
# CUDA

CUDA = torch.device("cuda", 0)  # a device object only: no GPU is touched


@pytest.mark.parametrize(("capability", "expected"), [((9, 0), True), ((7, 0), True), ((6, 1), False)])
def test_auto_compiles_on_a_cuda_device_triton_can_compile_for(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    chosen, why = precision.choose_compile("auto", CUDA)
    assert chosen is expected and why.startswith("auto: ")
    assert ("~3x" in why) if expected else ("7.0" in why)


def test_auto_stays_eager_on_a_cpu_and_a_setting_is_kept(monkeypatch):
    chosen, why = precision.choose_compile("auto", CPU)
    assert chosen is False and "0.89x" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for device in (CPU, CUDA):
        assert precision.choose_compile(True, device) == (True, "run.compile")
        assert precision.choose_compile(False, device) == (False, "run.compile")


def test_the_resolved_recipe_holds_the_choice_and_the_dry_run_lines_say_it(monkeypatch):
    r = resolve("pretrain", None, ["run.precision=auto"], inputs=False)
    assert r.run.compile == "auto"  # the default
    assert precision.resolved_compile(r, CPU)[0].run.compile is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert precision.resolved_compile(r, CUDA)[0].run.compile is True
    monkeypatch.setattr(precision, "detect_bf16", machine(False))
    assert precision.auto_choices(r, CPU) == [
        "run.precision: auto -> fp32 (auto: CPU has only AVX2: bf16 would be emulated)",
        "run.compile: auto -> false (auto: the CPU gains nothing, measured 0.89x at ViT-Ti/16 on 2 cores)"]
    fewshot = resolve("eval-fewshot", None, [], inputs=False)
    assert precision.auto_choices(fewshot, CPU)[1:] == []  # it trains nothing: no compile to choose


@pytest.mark.parametrize("device", [CUDA, CPU])
def test_tf32_is_turned_on_where_the_run_sets_up_a_cuda_device_only(monkeypatch, device):
    calls = []
    monkeypatch.setattr(dist, "pick_device", lambda pref, local_rank=0: device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    assert dist.setup("auto").device == device
    assert calls == (["high"] if device.type == "cuda" else [])


@pytest.mark.parametrize(("device", "setting", "run_precision", "noted"), [
    (CUDA, "high", "fp32", True), (CUDA, "highest", "fp32", False), (CUDA, "high", "bf16", False),
    (CPU, "high", "fp32", False),
])
def test_the_run_announces_tf32_where_fp32_matmuls_use_it(monkeypatch, device, setting, run_precision, noted):
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: setting)
    r = resolve("pretrain", None, [f"run.precision={run_precision}"], inputs=False)
    assert (run_build.tf32(r, dist.Dist(0, 1, 0, device)) == " with TF32 matmuls") is noted


@pytest.mark.parametrize("stage,pref,device,trained,native,expected", [
    # inference on a CPU: fp32 whatever the CPU (timm's and transformers' inference run fp32)
    ("predict", "auto", CPU, None, True, ("fp32", "run.precision=auto on cpu")),
    ("evaluate", "auto", CPU, "bf16", True, ("fp32", "run.precision=auto on cpu")),
    ("eval-fewshot", "auto", CPU, None, True, ("fp32", "run.precision=auto on cpu")),
    # asked for: kept, on any device, for any stage
    ("predict", "bf16", CPU, None, False, ("bf16", "run.precision=bf16")),
    ("evaluate", "fp32", CUDA, "bf16", True, ("fp32", "run.precision=fp32")),
    # on CUDA as before: our checkpoint's own precision, else auto's choice
    ("evaluate", "auto", CUDA, "fp32", True,
     ("fp32", "run.precision=auto on cuda: the checkpoint's own, as it trained")),
    ("predict", "auto", CUDA, None, True, ("bf16", "run.precision=auto on cuda: CPU has AVX-512 bf16")),
    # training keeps auto's choice on a CPU
    ("pretrain", "auto", CPU, None, True, ("bf16", "auto: CPU has AVX-512 bf16")),
    ("finetune", "auto", CPU, None, False, ("fp32", "auto: CPU has only AVX2: bf16 would be emulated")),
])
def test_inference_computes_in_fp32_on_a_cpu_unless_asked(stage, pref, device, trained, native, expected):
    assert precision.choose_for(stage, pref, device, trained, machine(native)) == expected


def test_an_inference_recipe_resolves_to_fp32_on_a_cpu_that_trains_in_bf16(monkeypatch):
    monkeypatch.setattr(precision, "detect_bf16", machine(True))
    r = resolve("eval-fewshot", None, [], inputs=False)
    assert precision.resolved_for(r, CPU)[0].run.precision == "fp32"
    assert precision.auto_choices(r, CPU) == ["run.precision: auto -> fp32 (run.precision=auto on cpu)"]
    on_gpu = "run.precision: auto -> bf16 (run.precision=auto on cuda: CPU has AVX-512 bf16"
    assert precision.auto_choices(r, CUDA) == [f"{on_gpu})"]
    evaluate = resolve("evaluate", None, [], inputs=False)  # it reads our checkpoint's precision
    assert precision.auto_choices(evaluate, CUDA) == [
        f"{on_gpu}; a vitcli checkpoint keeps the precision it trained at)"]
    asked = resolve("eval-fewshot", None, ["run.precision=bf16"], inputs=False)
    assert precision.resolved_for(asked, CPU) == (asked, "run.precision=bf16")
    assert precision.resolved_for(resolve("pretrain", None, [], inputs=False), CPU)[0].run.precision == "bf16"
