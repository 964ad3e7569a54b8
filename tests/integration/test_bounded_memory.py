"""Memory bounded by construction: a folder larger than the decoded-image cache trains with the
cache off and its loader worker's memory flat over an epoch and a half; the same measurement sees
the growth when the images are kept. And what summary.json's figures see: a child that lives for
less than a logging window (a held-out pass's loader worker) is counted, by its own memory."""

import io
import subprocess
import sys

import numpy as np
from PIL import Image

from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.memory import PeakMemory, own_peak_mb, refreshed

ROWS, BATCH, SIZE = 96, 16, (320, 400)  # 6 micro-batches an epoch
DECODED_MB = ROWS * SIZE[0] * SIZE[1] * 3 / 2**20  # 35 MiB if every image were kept decoded


def _photos(root):
    """ROWS noise JPEGs of 320 x 400 (noise barely compresses: 14 MiB on disk) in two classes."""
    rng = np.random.default_rng(0)
    for i in range(ROWS):
        path = root / f"c{i % 2}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (*SIZE, 3), dtype=np.uint8)).save(buf, "JPEG", quality=95)
        path.write_bytes(buf.getvalue())


def _worker_growth(root, cache_mb: int) -> tuple[object, float]:
    """(the stream's cache, how many MiB its one worker's peak grew from half an epoch to an epoch
    and a half)."""
    cfg = DataConfig(source=str(root), num_workers=1, cache_mb=cache_mb, crop_min_area=0.5)
    stream = batches.train_batches(sources.load_split(cfg, "train"), cfg, 32, BATCH, seed=0)
    memory, epoch = PeakMemory(), ROWS // BATCH
    for _ in range(epoch // 2):
        next(stream)
    memory.sample()
    (before,) = memory.workers.values()
    for _ in range(epoch):
        next(stream)
    memory.sample()
    (after,) = memory.workers.values()
    return stream.cache, after - before


def test_a_folder_larger_than_the_cache_is_not_kept_and_memory_stays_flat(tmp_path):
    _photos(tmp_path)
    cache, growth = _worker_growth(tmp_path, cache_mb=8)  # 14 MiB on disk > 8 MiB: off
    assert cache is None
    assert growth < 8, f"the worker grew {growth:.1f} MiB over an epoch with no cache"
    # the same folder kept: half of it is decoded and kept before the first reading (17.6 MiB), all
    # of it by the second (measured: 19.9 MiB of growth), so the measurement can see what a cache
    # takes
    kept, kept_growth = _worker_growth(tmp_path, cache_mb=1024)
    assert kept is not None and kept_growth > DECODED_MB / 3, kept_growth


CHILD_MB = 64


def test_a_short_lived_child_is_counted_by_its_own_memory():
    """A child that allocates CHILD_MB of its own and exits a moment later, between any two of the
    loop's samples: the sampling thread still sees it, and the run's peak adds what it held."""
    memory = PeakMemory(every_s=0.05)
    grow = f"import time; held = b'x' * {CHILD_MB} * 2**20; time.sleep(0.6)"  # every page written
    subprocess.run([sys.executable, "-c", grow], check=True)
    memory.stop()
    before = own_peak_mb()
    found = memory.metrics()
    after = own_peak_mb()
    assert found["mem/worker_peak_mb"] >= CHILD_MB, found
    assert found["mem/run_peak_mb"] - found["mem/main_peak_mb"] >= CHILD_MB, found
    # the main figure is the kernel's high-water mark, read when asked (within 1 MiB: the kernel
    # batches its per-thread counts of resident pages, so two threads may read a few kB apart)
    assert before - 1 <= found["mem/main_peak_mb"] <= after + 1


def test_the_summary_figures_are_raised_to_the_high_water_mark_at_its_writing():
    """summary.json is written after the loop gathered its figures (the FLOP count, the curves): the
    main process's peak is read again then, and the run's rises with it."""
    summary = {"mem/main_peak_mb": 1.0, "mem/run_peak_mb": 5.0}
    before = own_peak_mb()
    now = refreshed(summary)
    assert before - 1 <= now["mem/main_peak_mb"] <= own_peak_mb() + 1 and before > 1.0
    assert now["mem/run_peak_mb"] == now["mem/main_peak_mb"] + 4.0
    assert refreshed({"steps": 3}) == {"steps": 3}  # a summary without figures is left as it is
