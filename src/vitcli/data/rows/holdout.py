"""data.holdout: a seeded, class-balanced share of the train split held out for validation.

big_vision's ImageNet configs validate on `minival`, `train[99%:]` of TFDS's ImageNet, whose files
are shuffled, so its last 1% holds every class. The rows of an image folder are sorted by class: its
last 1% is its last ~10 classes. Here each class gives the same share instead, drawn with a fixed
seed, so the held-out rows are the same for every run.seed and every run of the recipe, as
big_vision's slice is.

`split_rows` is the draw (labels in, row indices out); `take` applies it to a loaded split at
sources.load_split's seam: the recipe's train split reads the rows kept, the split `holdout` the
others.
"""

from __future__ import annotations

import math

import datasets
import numpy as np

from vitcli.errors import DataError
from vitcli.recipe.choices import HOLDOUT
from vitcli.recipe.schema import DataConfig

SEED = 0  # fixed, not run.seed: every run of a recipe validates on the same rows


def quotas(counts: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Rows each class holds out (K,): round(fraction x N) in all (halves up), each class floor or
    ceil of fraction x its rows; the ceilings go to the largest remainders (Hamilton's
    apportionment), ties broken in a seeded order."""
    exact = fraction * counts.astype(np.float64)
    base = np.floor(exact).astype(np.int64)
    extra = math.floor(fraction * int(counts.sum()) + 0.5) - int(base.sum())  # 0 <= extra <= K
    order = np.lexsort((rng.permutation(len(counts)), -(exact - base)))  # largest remainder first
    base[order[:extra]] += 1
    return base


def split_rows(labels: np.ndarray, fraction: float, seed: int = SEED
               ) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, rows held out), both ascending: `quotas` of each class's rows, drawn uniformly
    within the class from `seed` alone. labels: (N,) integers, any values."""
    rng = np.random.default_rng(seed)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    wanted = quotas(counts, fraction, rng)
    # the rows grouped by class, each class in a random order; a row's rank: its place in its class
    order = np.lexsort((rng.random(len(labels)), inverse))
    rank = np.empty(len(labels), dtype=np.int64)
    rank[order] = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
    held = rank < wanted[inverse]
    return np.flatnonzero(~held), np.flatnonzero(held)


def part(cfg: DataConfig, split: str) -> str:
    """Which part of the train split `split` reads under data.holdout: "kept", "held" or "" (all of
    it). The train split gives only the rows kept while a split of the same settings reads the
    others: settings whose splits a caller swapped for other data (the ImageNet suite, a VTAB task)
    read theirs whole. Without data.holdout, `holdout` is a split name like any other."""
    if not cfg.holdout:
        return ""
    if split == HOLDOUT:
        return "held"
    read = HOLDOUT in (cfg.val_split, cfg.test_split)
    return "kept" if split == cfg.train_split and read else ""


def take(train: datasets.Dataset, cfg: DataConfig, which: str) -> datasets.Dataset:
    """The `which` part ("kept" or "held") of the recipe's whole train split `train`."""
    column = "label" if cfg.label_rule else cfg.label_column  # a label rule writes `label`
    labels = train.select_columns([column]).with_format("arrow")[:][column].to_numpy()  # (N,)
    kept, held = split_rows(labels, cfg.holdout)
    where = f"{cfg.source} split '{cfg.train_split}'"
    for rows, name in ((kept, "keeps"), (held, "holds out")):
        if not len(rows):
            raise DataError(f"data.holdout={cfg.holdout} of the {len(labels)} rows of {where} "
                            f"{name} none; give it a fraction that leaves rows on both sides")
    ds = train.select(kept if which == "kept" else held)
    how = "rows kept by" if which == "kept" else "rows held out by"
    ds.info.description = f"{where}, {how} data.holdout"
    return ds
