"""run.precision: `auto` becomes bf16 where the device runs it natively and fp32 where it would be emulated,
judged by the CPU's flags, then by a measured matmul (the runs that announce and record it:
integration/test_precision_runs.py)."""

import pytest
import torch

from helpers import machine
from vitcli.runtime import precision

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
