"""The scale rehearsal, small: `vit pretrain` as a user types it on an ImageNet-shaped folder of
1,000 classes x 8 hard links (bench/rehearse.py's tree and watcher): its decoded-image cache is
decided by the bytes on disk (8,000 files of ~100 KB: off, though the folder's table holds only
paths) and every process stays within bounds."""

import importlib
import io
import os

import numpy as np
from PIL import Image

from helpers import REPO

PEAK_MB = 1536  # every process: the bound (1.5 GB) over a quickstart network's needs, here in all


def _photos(where, n=20):
    """`n` textured JPEGs at ImageNet's sizes (noise keeps them ~100 KB, as photographs are)."""
    rng, paths = np.random.default_rng(0), []
    where.mkdir()
    for i in range(n):
        h, w = rng.integers(300, 480, 2)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=75)
        (where / f"{i}.jpg").write_bytes(buf.getvalue())
        paths.append(where / f"{i}.jpg")
    return paths


def test_a_thousand_class_folder_trains_with_the_cache_off_and_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # bench/rehearse.py, and the jpegs.py it imports
    rehearse = importlib.import_module("rehearse")
    photos = _photos(tmp_path / "photos")
    tree = rehearse.build_tree(tmp_path / "imagenet", photos, classes=1000, per_class=8, val_per_class=0)
    assert tree["entries"] == 8000 and tree["apparent_gb"] > 0.5  # past any cache's 192 MiB
    workdir, log = tmp_path / "run", tmp_path / "vit.log"
    cmd = rehearse.vit_side(tmp_path / "imagenet", workdir, workers=1, deit=False, steps=3, val=False)
    env = {**os.environ, "VITCLI_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    watched = rehearse.watch(cmd, env, rehearse.vit_steps(workdir), 3, timeout=600, log=log)
    seen = watched.result(batch=128, warmup=1)
    text = " ".join(log.read_text().split())  # rich wraps its lines
    assert sorted(watched.steps) == [1, 2, 3], text
    assert "decoded-image cache: off: the train images take more than 192 MiB on disk" in text
    assert seen["main_peak_mb"] < PEAK_MB and len(seen["worker_peak_mb"]) == 1
    assert seen["worker_peak_mb"][0] < PEAK_MB, seen
