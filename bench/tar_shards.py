"""`vit pretrain` on WebDataset tar shards against the parquet copy of the same images, as users type it.

Two copies of the built-in data drawn at 64 px (10,000 train images), both written by `vit prepare-data
--max-size 32` (so the same 32 px JPEGs), one `--shards parquet`, one `--shards tar`; then the quickstart
recipe (32 px, batch 128) trains `--steps` steps on each, in `--rounds` alternating rounds: the parquet copy
map-style (its default), the parquet copy streamed (data.streaming=true), the tar copy (which streams). The
JSON on stdout holds each one's median `train/img_per_s` from its summary.json (the rate after the first
logging window) and the commands; and how fast each copy's raw stream is read (sources.load_stream, one
epoch, nothing decoded): the reading the training process does itself, between steps.

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/tar_shards.py [--steps 150] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = ["data.synthetic.img_size=64", "data.synthetic.train_size=10000", "data.synthetic.val_size=0",
        "data.synthetic.test_size=0"]
TRAIN = ["schedule.epochs=0", "schedule.warmup_steps=10", "data.val_split=", "data.test_split=",
         "run.eval_every=0", "run.ckpt_every=100000"]
RUNS = {"parquet_mapped": ("parquet", []), "parquet_streamed": ("parquet", ["data.streaming=true"]),
        "tar_streamed": ("tar", [])}


def vit(args: list[str], env: dict) -> None:
    """`vit ARGS` as a process of its own; its stderr on failure."""
    proc = subprocess.run([sys.executable, "-m", "vitcli.cli", *args], cwd=REPO, env=env, check=False,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"vit {' '.join(args)} exited {proc.returncode}: {proc.stderr[-2000:]}")


def read_rate(source: str) -> float:
    """Examples/s of one epoch of the copy's raw train stream, in this process (the median of 3)."""
    from vitcli.data.rows import sources
    from vitcli.recipe.schema import DataConfig

    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        n = sum(1 for _ in sources.load_stream(DataConfig(source=source, streaming=True)))
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="copies and runs here (default: a temp dir)")
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})  # read_rate, in this process
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        commands, rates = {}, {name: [] for name in RUNS}
        for shards in ("parquet", "tar"):
            cmd = ["prepare-data", "synthetic", "--out", str(root / shards), "--max-size", "32", "--shards",
                   shards, "--overwrite", *DATA]
            vit(cmd, env)
            commands[f"prepare_{shards}"] = "vit " + " ".join(cmd)
        reads = {shards: round(read_rate(str(root / shards))) for shards in ("parquet", "tar")}
        for r in range(args.rounds):
            for name, (copy, extra) in RUNS.items():
                workdir = root / "runs" / f"{name}-{r}"
                cmd = ["pretrain", "-r", "recipes/quickstart/pretrain.yaml", "--workdir", str(workdir),
                       f"data.source={root / copy}", f"schedule.steps={args.steps}", *TRAIN, *extra]
                vit(cmd, env)
                rates[name].append(json.loads((workdir / "summary.json").read_text())["train/img_per_s"])
                commands[name] = "vit " + " ".join(cmd)
                print(f"round {r} {name}: {rates[name][-1]:.0f} img/s", file=sys.stderr)
    print(json.dumps({"steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(),
                      "img_per_s_median": {k: round(statistics.median(v), 1) for k, v in rates.items()},
                      "img_per_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
                      "stream_read_examples_per_s": reads,
                      "commands": commands}, indent=2))


if __name__ == "__main__":
    main()
