"""`vit prepare-data` measured: how fast it writes the copy (images/s), how much faster today's map-style
training loader (batches.train_batches, img_size 224, data.num_workers=0) reads the copy than the original,
and what each JPEG quality costs in error and bytes. On real-size photographs: N JPEGs (quality 90) of
375-640 px cut at random from the photographs in PHOTOS (an image folder of 3 classes), and on the built-in
synthetic data.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/prepare_data.py --photos /tmp/skw/skimage/data [--n 200]

The loader is timed within the first epoch, before it caches decoded images, so every image is decoded, in
--rounds alternating rounds (original, prepared) whose median is reported.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
from PIL import Image

from vitcli.data.batching import batches, streams
from vitcli.data.rows import prepare, sources
from vitcli.recipe.schema import DataConfig, SyntheticConfig

PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "ihc.png", "motorcycle_left.png",
          "motorcycle_right.png", "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg", "color.png")


def make_photos(photos: Path, root: Path, n: int) -> Path:
    """An image folder of `n` JPEGs (quality 90, sides 375-640 px) cut from the photographs, 3 classes."""
    rng = np.random.default_rng(0)
    sources_ = [Image.open(photos / name).convert("RGB") for name in PHOTOS if (photos / name).is_file()]
    for i in range(n):
        img = sources_[i % len(sources_)]
        w, h = (int(v) for v in rng.integers(375, 641, 2))
        scale = max(1.0, 640 / min(img.size))  # the smaller photographs are enlarged so that any crop fits
        img = img.resize((round(img.width * scale), round(img.height * scale)), Image.Resampling.BICUBIC)
        x, y = int(rng.integers(0, img.width - w + 1)), int(rng.integers(0, img.height - h + 1))
        (root / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        img.crop((x, y, x + w, y + h)).save(root / f"class{i % 3}" / f"{i:04d}.jpg", quality=90)
    return root


def time_prepare(cfg: DataConfig, out: Path, opts: prepare.Options) -> float:
    """Images/s of writing the copy (every split)."""
    t0 = time.perf_counter()
    written = prepare.prepare(cfg, out, None, opts)
    return sum(s["rows"] for s in written["splits"].values()) / (time.perf_counter() - t0)


def loader_rate(source: str, n_batches: int, batch: int) -> float:
    """Images/s of the map-style training stream at 224 px, after one warm-up batch."""
    cfg = DataConfig(source=source, num_workers=0)
    stream = batches.train_batches(sources.load_split(cfg, "train"), cfg, 224, batch, seed=0)
    return streams.throughput(stream, n_batches)


def quality_costs(folder: Path, max_size: int) -> None:
    """Per JPEG quality: RMS error (grey levels) of the stored image against the exact resize, and bytes."""
    images = sorted(folder.rglob("*.jpg"))[:50]
    for quality in (90, 95, 100):
        errors, sizes = [], []
        for path in images:
            img = Image.open(path).convert("RGB")
            exact = img.resize(prepare.target_size(*img.size, max_size), Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            exact.save(buf, "JPEG", quality=quality)
            stored = np.asarray(Image.open(buf), np.float64)
            errors.append(np.sqrt(np.mean((stored - np.asarray(exact, np.float64)) ** 2)))
            sizes.append(buf.tell())
        kb = np.mean(sizes) / 1e3
        print(f"quality {quality}: RMS error {np.mean(errors):.2f} grey levels, {kb:.1f} kB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=Path, required=True)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_photos(args.photos, root / "photos", args.n)
        rate = time_prepare(DataConfig(source=str(folder)), root / "prepared", prepare.Options())
        print(f"photographs: prepare-data --max-size 256: {rate:.0f} images/s")
        rates = {"original": [], "prepared": []}
        for _ in range(args.rounds):  # alternated, so that both see the same load on a shared machine
            for name, source in (("original", folder), ("prepared", root / "prepared")):
                rates[name].append(loader_rate(str(source), args.batches, args.batch))
        for name, measured in rates.items():
            print(f"photographs, {name}: train_batches at 224 px: {np.median(measured):.0f} images/s "
                  f"(median of {', '.join(f'{r:.0f}' for r in measured)})")
        quality_costs(folder, 256)
        synthetic = DataConfig(synthetic=SyntheticConfig())
        for max_size in (256, 24):
            out = root / f"synthetic-{max_size}"
            rate = time_prepare(synthetic, out, prepare.Options(max_size=max_size))
            print(f"synthetic 32 px: prepare-data --max-size {max_size}: {rate:.0f} images/s")


if __name__ == "__main__":
    main()
