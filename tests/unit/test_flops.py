"""MFU's two halves: a ViT's analytic FLOPs (against PyTorch's own counter) and a device's peak
FLOP/s (the datasheet table for a known GPU, a measured matmul otherwise), and their ratio."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitcli.models import zoo
from vitcli.models.flops import counted, forward_flops, train_flops_per_image
from vitcli.recipe.resolve import resolve
from vitcli.runtime import peak

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(img, patch, dim, depth, mlp, *extra):
    return resolve("pretrain", None, [f"model.img_size={img}", f"model.patch_size={patch}",
                                      f"model.embed_dim={dim}", f"model.depth={depth}", "model.num_heads=2",
                                      f"model.mlp_dim={mlp}", "model.num_classes=7", "model.name=custom",
                                      *extra], inputs=False).model


@pytest.mark.parametrize("size", [(32, 8, 32, 2, 64), (48, 16, 24, 1, 96)])
@pytest.mark.parametrize("extra", [[], ["model.pool=gap"], ["model.representation_size=16"]])
def test_analytic_flops_match_pytorchs_counter(size, extra):
    """Exact for the patch convolution and the linear layers, the only ops FlopCounterMode counts
    here (it counts no norm, softmax or GELU, and neither does our count). CPU SDPA is not counted
    either, so the two N x N products are checked against their own formula."""
    m = _model(*size, *extra)
    img, patch, dim, depth, _ = size
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        zoo.build_model(m, 7)(torch.randn(3, 3, img, img))
    assert counter.get_total_flops() / 3 == forward_flops(m, attention=False)
    tokens = (img // patch) ** 2 + (m.pool == "token")
    attention = 2 * depth * 2 * tokens * tokens * dim  # q k^T and attn v: 2 FLOPs per multiply-add each
    assert forward_flops(m) - forward_flops(m, attention=False) == attention
    assert train_flops_per_image(m) == 3 * forward_flops(m)
    assert forward_flops(m, num_classes=0) < forward_flops(m)  # the head's width is the run's


def test_only_plain_vits_are_counted():
    assert counted(_model(32, 8, 32, 1, 64)) == ""
    for name in ("T2T-ViT-14", "R50+ViT-B/16", "resnet18"):
        m = _model(32, 8, 32, 1, 64)
        assert name in counted(type(m)(**{**m.__dict__, "name": name}))


@pytest.mark.parametrize(("name", "col", "tflops"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
    ("NVIDIA H100 PCIe", "bf16", 756), ("NVIDIA H200", "tf32", 494.5), ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156), ("NVIDIA L4", "bf16", 121), ("NVIDIA A10", "fp32", 31.2),
    ("Tesla V100-SXM2-16GB", "fp32", 15.7), ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
])
def test_a_known_gpu_is_read_off_its_datasheet(name, col, tflops):
    assert peak.table_peak(name, col) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(("name", "col"), [
    ("Tesla V100-SXM2-16GB", "bf16"),  # no bf16 on Volta: measured, not guessed
    ("NVIDIA A10G", "bf16"),  # an A10 relative with other clocks: not the A10's figure
    ("NVIDIA H100 NVL", "bf16"),  # another H100 part
    ("NVIDIA H200 NVL", "bf16"),
    ("Tesla V100-PCIE-32GB", "fp32"),  # lower clocks than the SXM2 part
    ("NVIDIA L40S", "bf16"), ("Some Future GPU", "bf16"),
])
def test_an_unlisted_gpu_or_precision_is_left_to_the_measurement(name, col):
    assert peak.table_peak(name, col) is None


def test_a_cuda_device_takes_the_table_and_tf32_when_it_is_on(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak.peak_flops.cache_clear()
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak.peak_flops(cuda, "fp32") == (494.5e12, "table: NVIDIA H100 80GB HBM3 tf32")
    assert peak.peak_flops(cuda, "bf16") == (989e12, "table: NVIDIA H100 80GB HBM3 bf16")
    peak.peak_flops.cache_clear()
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert peak.peak_flops(cuda, "fp32") == (67e12, "table: NVIDIA H100 80GB HBM3 fp32")
    peak.peak_flops.cache_clear()


def test_a_cpu_peak_is_a_measured_matmul_at_the_runs_precision():
    cpu = torch.device("cpu")
    flops, source = peak.peak_flops(cpu, "fp32")
    assert source == "measured 2048^2 fp32 matmul"
    # an independent timing of the same product: within 3x (a shared 2-core machine's noise, not a
    # bound)
    again = peak.matmul_flops("fp32", 1024, 3)
    assert again / 3 < flops < again * 3


def test_mfu_is_model_flops_over_peak():
    m = _model(32, 8, 32, 2, 64)
    img_per_s, peak_flops = 1000.0, 1e12
    by_hand = img_per_s * 3 * forward_flops(m) / peak_flops
    assert peak.mfu(img_per_s, train_flops_per_image(m), peak_flops) == pytest.approx(by_hand)
