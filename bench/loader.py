"""Loader throughput: images/s of the training batch stream alone (read, decode, augment; no model), for the
map-style loader (batches.train_batches) and the streaming one (streams.stream_train_batches, data.streaming),
on the same 32 px PNG images written as 4 parquet files, with data.num_workers 0 and 2.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/loader.py [--batches 30] [--batch 128]

Timed within the first epoch (5,000 images), where the map-style loader has not cached decoded images yet,
so both pay for decoding every image.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from vitcli.data import batches, sources, streams
from vitcli.data.synthetic import make_synthetic
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = write_parquet(Path(tmp))
        for streaming in (False, True):
            for workers in (0, 2):
                rate = measure(source, streaming, workers, args.batches, args.batch)
                name = "streaming" if streaming else "map-style"
                print(f"{name:10s} num_workers={workers}: {rate:7.0f} images/s")


if __name__ == "__main__":
    main()
