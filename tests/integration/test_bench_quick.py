"""`make bench --quick` prints one JSON object with every key (the FLOP counts:
unit/test_bench.py)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

MODEL_KEYS = {"precision", "img_size", "batch", "steps", "num_workers", "loader_img_s", "bare_img_s",
              "ours_img_s", "ours_compile_img_s", "train_flops_per_img", "peak_rss_mb", "children_rss_mb",
              "ratio", "ratio_compile", "best_ratio", "loader_vs_model", "mfu", "mfu_compile", "best_mfu"}
FEWSHOT_KEYS = {"images", "img_size", "batch", "num_workers", "torch_threads", "extract_ours_img_s",
                "extract_bare_img_s", "extract_forward_img_s", "extract_ratio", "extract_vs_forward"}
MAE_KEYS = {"batch", "precision", "supervised_img_s", "mae_img_s", "ratio", "flop_ratio", "of_flop_bound"}
PREFLIGHT_KEYS = {"eta_s", "run_s", "eta_ratio", "eta_closeness", "mem_mb", "run_mem_mb", "mem_ratio",
                  "mem_closeness", "eta_parts_s", "run_parts_s", "load_1min"}

SPEC = importlib.util.spec_from_file_location("bench_run", REPO / "bench/run.py")
bench = importlib.util.module_from_spec(SPEC)


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
    for m in results["models"].values():
        assert FEWSHOT_KEYS == set(m["fewshot"]), FEWSHOT_KEYS ^ set(m["fewshot"])
    assert set(results["models"]["vit_ti16_224"]["ema"]) == {"step_s", "update_s", "cost", "step_share"}
    for name in ("vit_l16_224", "vit_b16_224"):  # an MAE step against a supervised one of the same ViT
        assert MAE_KEYS <= set(results["mae"][name]), MAE_KEYS - set(results["mae"][name])
    dino = results["dino"]["quick"]  # a DINO step against a supervised one (bench/dino.py)
    assert {"dino_gflop_s", "supervised_gflop_s", "flop_rate_ratio", "flop_ratio"} <= set(dino), sorted(dino)
    assert set(results["transfer"]["protocols"]) == {"fewshot", "knn", "linear", "ridge"}
    stall = results["ckpt_stall"]["quickstart"]  # the checkpoint stall, both writers (ckpt_stall.py)
    assert {"async", "sync", "step_share", "stall_async_vs_sync"} <= set(stall), sorted(stall)
    assert set(results["preflight"]) == {"pretrain", "finetune"}  # `--preflight` against the runs
    for run in results["preflight"].values():
        assert PREFLIGHT_KEYS <= set(run), PREFLIGHT_KEYS - set(run)
    assert 0 < results["transfer"]["extraction_share"] <= 1
    assert all(set(t) == {"target", "value", "met"} for t in results["targets"].values())
