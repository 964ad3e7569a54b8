"""Write offline stand-ins for VTAB-1k tasks under OUT_DIR/<task>, laid out as `--data-root` reads them.

Each stand-in has the task's own columns and class count and splits long enough for its VTAB slices
(train800 = `train[:800]`, val200 = `validation[:200]`), so `vit eval-fewshot --tasks vtab/<task>
--data-root OUT_DIR` exercises the real protocol end to end: 1,000 shot-pool images whose labels are drawn
uniformly, as a class-balanced dataset's first 1,000 would be, so SUN397's 397 classes leave about 30 empty
and most short of 5 examples. The images are random 32 px noise: the accuracies are chance; the point is
the protocol (every shot count filled, short classes marked), not the numbers.

    python scripts/vtab_standin.py /tmp/vtab --tasks sun397,dtd,flowers102,dmlab
"""

from __future__ import annotations

import argparse
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from vitcli.data.rows import tasks

TRAIN, VAL = 800, 200  # what train800val200 reads: train[:800] + validation[:200]


def standin(task: tasks.Task, test_size: int, seed: int) -> datasets.DatasetDict:
    """Random images with uniformly drawn labels in the task's columns and splits."""
    if task.splits["val200"] != "validation[:200]" or task.label_rule:
        raise SystemExit(f"{task.name}: only tasks with a validation split and a plain label column "
                         "are supported")
    rng = np.random.default_rng(seed)
    features = datasets.Features({task.image_column: datasets.Image(),
                                  task.label_column: datasets.Value("int64")})

    def split(n: int) -> datasets.Dataset:
        images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
        labels = rng.integers(0, task.num_classes, n).tolist()
        return datasets.Dataset.from_dict({task.image_column: images, task.label_column: labels},
                                          features=features)

    return datasets.DatasetDict({"train": split(TRAIN), "validation": split(VAL), "test": split(test_size)})


def main() -> None:
    """Parse the command line and write one stand-in per task."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tasks", default="sun397,dtd,flowers102,dmlab", help="VTAB names without vtab/")
    parser.add_argument("--test-size", type=int, default=500)
    args = parser.parse_args()
    for i, name in enumerate(args.tasks.split(",")):
        task = tasks.REGISTRY[f"vtab/{name}"]
        standin(task, args.test_size, seed=i).save_to_disk(str(args.out_dir / name))
        print(f"{args.out_dir / name}: {task.num_classes} classes")


if __name__ == "__main__":
    main()
