"""`make bench`: its FLOP count agrees with PyTorch's counter, and `--quick` writes every key of the
schema."""

import importlib.util

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import REPO
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve

SPEC = importlib.util.spec_from_file_location("bench_run", REPO / "bench/run.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("size", [(32, 8, 32, 2, 64), (48, 16, 24, 1, 96)])
def test_analytic_flops_match_pytorchs_counter(size):
    img, patch, dim, depth, mlp = size
    r = resolve("pretrain", None, [f"model.img_size={img}", f"model.patch_size={patch}",
                                   f"model.embed_dim={dim}", f"model.depth={depth}", "model.num_heads=2",
                                   f"model.mlp_dim={mlp}", "model.num_classes=7", "model.name=custom"],
                inputs=False)
    model = zoo.build_model(r.model, 7)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randn(3, 3, img, img))
    # FlopCounterMode counts the patch convolution and the linear layers, but not CPU SDPA: compare those
    assert counter.get_total_flops() / 3 == bench.forward_flops(r.model, attention=False)
    tokens = (img // patch) ** 2 + 1
    attention = 2 * depth * 2 * tokens * tokens * dim  # q k^T and attn v: 2 FLOPs per multiply-add each
    assert bench.forward_flops(r.model) - bench.forward_flops(r.model, attention=False) == attention
