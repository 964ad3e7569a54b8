"""`make bench`: its FLOP count agrees with PyTorch's counter, and `--quick` writes every key of the schema."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from vitcli.models import zoo
from vitcli.recipe.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("bench_run", REPO / "bench/run.py")
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL_KEYS = {"precision", "img_size", "batch", "steps", "num_workers", "loader_img_s", "bare_img_s", "ours_img_s",
              "ours_compile_img_s", "train_flops_per_img", "peak_rss_mb", "children_rss_mb", "ratio",
              "ratio_compile", "best_ratio", "loader_vs_model", "mfu", "mfu_compile", "best_mfu"}


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


@pytest.mark.skipif(os.environ.get("VITCLI_BENCH_TEST") != "1",
                    reason="~1 min warm, ~2 min with a cold inductor cache: VITCLI_BENCH_TEST=1 runs it")
def test_quick_bench_prints_one_json_object_with_every_key():
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, str(REPO / "bench/run.py"), "--quick"], env=env, check=True,
                         capture_output=True, text=True).stdout
    results = json.loads(out)  # the whole of stdout: progress went to stderr
    assert {"machine", "auto_precision", "torch", "matmul_flops", "models", "targets"} <= set(results)
    assert set(results["models"]) == {"quickstart", "vit_ti16_224"}
    for m in results["models"].values():
        assert MODEL_KEYS <= set(m), MODEL_KEYS - set(m)
    assert set(results["models"]["quickstart"]["fewshot"]) == {"extract_ours_img_s", "extract_bare_img_s",
                                                              "extract_ratio"}
    assert all(set(t) == {"target", "value", "met"} for t in results["targets"].values())
