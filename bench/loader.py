"""Loader throughput: images/s of the training batch stream alone (read, decode, augment; no model), for the
map-style loader (batches.train_batches) and the streaming one (streams.stream_train_batches, data.streaming),
on the same 32 px PNG images written as 4 parquet files, with data.num_workers 0 and 2.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/loader.py [--batches 30] [--batch 128]

Timed within the first epoch (5,000 images), where the map-style loader has not cached decoded images yet,
so both pay for decoding every image.

With `--photos DIR`, per core on ImageNet-sized JPEGs instead: random crops of the photos in DIR (e.g.
scikit-image's data directory) re-encoded at 375-640 px, quality 90, as an imagefolder; train_batches at 224
px (num_workers=0, its decoded cache off, as for a dataset of ImageNet's size) against timm's
create_transform(224, is_training=True) on PIL (decode, transform, stack) and torchvision's bare uint8 path
(decode_jpeg, v2.RandomResizedCrop, stack). The x leaves train_batches finished (resized, flipped, in
[-1, 1]) on the CPU, so its time includes what a GPU run does on the device.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/loader.py --photos /tmp/skw/skimage/data
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
import torch
from PIL import Image
from timm.data import create_transform
from torchvision.io import decode_jpeg
from torchvision.transforms import v2

from vitcli.data.batching import batches, streams
from vitcli.data.rows import sources
from vitcli.data.rows.synthetic import make_synthetic
from vitcli.recipe.schema import DataConfig, SyntheticConfig

FILES = 4


def write_parquet(root: Path) -> str:
    """The synthetic train split (5,000 PNGs at 32 px) as FILES parquet files; their glob."""
    ds = make_synthetic(SyntheticConfig(), "train")
    for k in range(FILES):
        ds.shard(FILES, k, contiguous=True).to_parquet(str(root / f"part-{k}.parquet"))
    return str(root / "part-*.parquet")


def measure(source: str, streaming: bool, workers: int, n_batches: int, batch: int) -> float:
    """Images/s of one loader, after one warm-up batch."""
    cfg = DataConfig(source=source, streaming=streaming, num_workers=workers)
    if streaming:
        stream = streams.stream_train_batches(sources.load_stream(cfg), cfg, 32, batch, seed=0)
    else:
        stream = batches.train_batches(sources.load_split(cfg, "train"), cfg, 32, batch, seed=0)
    return streams.throughput(stream, n_batches)


def write_jpegs(photos: Path, root: Path, n: int = 200) -> list[Path]:
    """n random crops of the photos (>= 375 px per side) re-encoded as JPEGs of 375..640 px in an
    imagefolder (two classes: HF drops the label of a single one); their paths."""
    rng = np.random.default_rng(0)
    images = [Image.open(p).convert("RGB") for p in sorted(photos.glob("*.[pj][np]g"))]
    images = [img for img in images if min(img.size) >= 375]
    for name in ("a", "b"):
        (root / "train" / name).mkdir(parents=True)
    paths = []
    for i in range(n):
        img = images[i % len(images)]
        w, h = (int(rng.integers(375, min(641, s + 1))) for s in img.size)
        x, y = int(rng.integers(0, img.width - w + 1)), int(rng.integers(0, img.height - h + 1))
        paths.append(root / "train" / "ab"[i % 2] / f"{i:04d}.jpg")
        img.crop((x, y, x + w, y + h)).save(paths[-1], "JPEG", quality=90)
    return paths


def per_image(step, files: list[bytes], batch: int, rounds: int) -> float:
    """Images/s of step(encoded bytes) -> (3, 224, 224) over `rounds` passes of the files, in stacked
    batches."""
    t0, images = time.perf_counter(), 0
    for _ in range(rounds):
        for k in range(0, len(files), batch):
            torch.stack([step(data) for data in files[k : k + batch]])
            images += len(files[k : k + batch])
    return images / (time.perf_counter() - t0)


def compare_jpegs(photos: Path, batch: int, rounds: int = 3) -> None:
    """Per-core images/s on ImageNet-sized JPEGs: ours, timm's PIL path, torchvision's bare uint8 path, each
    measured `rounds` times in turn (a shared machine's load drifts), the median reported."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_jpegs(photos, Path(tmp))
        files = [p.read_bytes() for p in paths]
        cfg = DataConfig(source=tmp, num_workers=0, val_split="", cache_mb=0)  # as ImageNet: never cached
        ds = sources.load_split(cfg, "train")
        n = 2 * len(files) // batch
        timm_pp = create_transform(224, is_training=True)
        crop = v2.RandomResizedCrop(224, antialias=True)
        # a stream for a CUDA device ships crops and leaves the resize to augment.finish there: _shipped
        # takes its batches as a loader worker makes them (decode, crop, pack uint8), never finishing them
        gpu = torch.device("cuda")
        ways = {
            "vitcli worker (GPU finishes)": lambda: streams.throughput(
                _shipped(batches.train_batches(ds, cfg, 224, batch, seed=0, device=gpu)), n),
            "vitcli worker + finish on the CPU": lambda: streams.throughput(
                batches.train_batches(ds, cfg, 224, batch, seed=0), n),
            "timm PIL": lambda: per_image(
                lambda d: timm_pp(Image.open(io.BytesIO(d)).convert("RGB")), files, batch, 1),
            "torchvision uint8": lambda: per_image(
                lambda d: crop(decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8))), files, batch,
                1),
        }
        runs: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):  # in turn, so a change of load hits every way alike
            for name, way in ways.items():
                runs[name].append(way())
        rates = {name: sorted(r)[rounds // 2] for name, r in runs.items()}
    timm_rate = rates["timm PIL"]
    print("JPEGs 375-640 px -> 224, images/s on 1 thread (median of rounds):")
    for name, rate in rates.items():
        print(f"  {name:34s} {rate:6.0f}  ({rate / timm_rate:.2f}x timm)")


def _shipped(stream: batches.BatchStream):
    """The (uint8 Pixels, y) batches as the loader ships them, before augment.finish."""
    for x, y, _ in stream.batches:
        yield x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--photos", type=Path, help="a directory of photos: compare on JPEGs made from them")
    args = parser.parse_args()
    if args.photos:
        compare_jpegs(args.photos, 32)
        return
    with tempfile.TemporaryDirectory() as tmp:
        source = write_parquet(Path(tmp))
        for streaming in (False, True):
            for workers in (0, 2):
                rate = measure(source, streaming, workers, args.batches, args.batch)
                name = "streaming" if streaming else "map-style"
                print(f"{name:10s} num_workers={workers}: {rate:7.0f} images/s")


if __name__ == "__main__":
    main()
