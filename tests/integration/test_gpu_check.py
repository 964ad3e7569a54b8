"""`make gpu-check` where CI can run it: `bench/gpu_check.py --quick` (a tiny model at 32 px on this
CPU) prints one JSON object holding every section, its runs pass their checks, its data are real
JPEGs, and its arguments are checked. The GPU half (tests/cuda, the real sizes) runs only on a GPU
machine."""

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from helpers import REPO

SCRIPT = REPO / "bench/gpu_check.py"
RUN_KEYS = {"pretrain", "resume", "activation_checkpointing", "mpp", "deit", "dino"}


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False,
                          env={**os.environ, **env}, timeout=600)


def test_quick_gpu_check_prints_every_section_and_its_runs_pass(tmp_path):
    done = gpu_check("--quick", "--keep", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(done.stdout)  # the whole of stdout: progress went to stderr
    sections = {"device", "cuda_tests", "data", "runs", "augmentation", "throughput", "targets", "seconds"}
    assert sections <= set(out)
    cuda_tests = len(list((REPO / "tests/cuda").glob("test_*.py")))
    assert out["cuda_tests"]["ok"] and out["cuda_tests"]["skipped"] >= cuda_tests  # no GPU: every one skips
    assert set(out["runs"]) == RUN_KEYS and all(r["ok"] for r in out["runs"].values())
    first, last = out["runs"]["pretrain"]["loss_first_last"]
    assert last < first
    resume = out["runs"]["resume"]
    assert resume["first_rc"] == 143 and resume["second_rc"] == 0  # stopped by SIGTERM, then went on
    assert resume["steps_logged_after_resume"][0] > resume["checkpoint_step"]
    assert out["runs"]["mpp"]["summary"]["train/loss"] > 0
    assert out["runs"]["dino"]["summary"]["train/flops_per_img"] > 0  # DINO's step, compiled on a GPU
    row = out["throughput"]["tiny"]
    assert all(row[feed]["img_per_s"] > 0 for feed in ("device", "jpeg", "bare"))
    assert row["jpeg_vs_device"] > 0 and row["device_vs_bare"] > 0
    timed = out["augmentation"]["tiny"]  # each recipe's augmentation against the tiny model's step
    assert timed["step_ms"] > 0
    assert all(timed[k][route]["ms"] > 0 for k in ("plain", "deit", "three_augment")
               for route in ("workers", "shipped"))
    assert set(out["targets"]) == {"vit_b16_mfu", "vit_s16_img_s", "vit_b16_jpeg_vs_device",
                                   "vit_s16_jpeg_vs_device", "deit_augmentation_vs_vit_s16_step",
                                   "three_augment_vs_vit_s16_step"}
    assert not any(t["met"] for t in out["targets"].values())  # the GPU models are not measured --quick
    files = sorted((tmp_path / "jpegs/train").rglob("*.jpg"))
    assert len(files) == out["data"]["images"] > 0
    with Image.open(files[0]) as img:
        assert img.format == "JPEG" and 375 <= max(img.size) <= 640


def test_an_unknown_section_or_part_is_refused_with_the_known_ones():
    done = gpu_check("--only", "device,runz")
    assert done.returncode == 2 and "no section runz" in done.stderr and "throughput" in done.stderr
    done = gpu_check("--only", "runs.mpq")
    assert done.returncode == 2 and "runs has no mpq" in done.stderr and "mpp" in done.stderr
    done = gpu_check("--quick", "--only", "throughput.ViT-B/16")  # --quick measures its tiny model only
    assert done.returncode == 2 and "throughput has no ViT-B/16" in done.stderr and "tiny" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_and_how_to_check_the_script():
    done = gpu_check("--only", "device")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--quick" in done.stderr
