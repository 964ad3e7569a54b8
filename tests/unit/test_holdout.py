"""data.holdout's draw: a class-balanced share of the train split, the same rows for the same
labels, the two sides disjoint and together the whole split, and round(fraction x N) rows held out
exactly."""

import math

import numpy as np
import pytest

from vitcli.data.rows.holdout import part, quotas, split_rows
from vitcli.recipe.schema import DataConfig


def sorted_labels(counts) -> np.ndarray:
    """Labels as an image folder lists them: class by class."""
    return np.repeat(np.arange(len(counts)), counts)


@pytest.mark.parametrize("counts, fraction", [([100] * 10, 0.1), ([3, 3, 3, 3], 0.5),
                                              ([7, 1, 13, 2], 0.3), ([1300, 732, 1000, 999], 0.01)])
def test_each_class_gives_its_share_and_the_total_is_the_rounded_fraction(counts, fraction):
    labels = sorted_labels(counts)
    _, held = split_rows(labels, fraction)
    per_class = np.bincount(labels[held], minlength=len(counts))
    for c, n in enumerate(counts):
        assert per_class[c] in (math.floor(fraction * n), math.ceil(fraction * n)), (c, per_class)
    assert len(held) == math.floor(fraction * len(labels) + 0.5)


def test_an_imagenet_sized_split_holds_out_the_rows_big_visions_slice_would():
    """1,281,167 rows (ImageNet-1k's train) in 1,000 classes of about 1,281: train[99%:] is 12,812
    rows; here the same count, 12 or 13 of each class, where the tail of a class-sorted folder is
    its last 10 classes."""
    lost = np.random.default_rng(1).integers(0, 1000, 1_300_000 - 1_281_167)
    counts = 1300 - np.bincount(lost, minlength=1000)  # sums to the 1,281,167 ImageNet has
    labels = sorted_labels(counts)
    kept, held = split_rows(labels, 0.01)
    assert len(held) == len(labels) - round(len(labels) * 0.99) == 12_812
    assert set(np.bincount(labels[held], minlength=1000)) <= {12, 13}
    assert len(np.unique(labels[-12_812:])) < 20  # what a plain slice of the folder validates on
    assert len(kept) + len(held) == len(labels)


def test_the_sides_are_disjoint_ascending_and_cover_the_split():
    labels = np.random.default_rng(0).integers(0, 7, 500)  # shuffled, as a Hub copy may be
    kept, held = split_rows(labels, 0.2)
    assert not set(kept) & set(held)
    assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(500))
    assert np.all(np.diff(kept) > 0) and np.all(np.diff(held) > 0)


def test_the_same_labels_give_the_same_rows_and_another_seed_others():
    labels = sorted_labels([50] * 8)
    first, again = split_rows(labels, 0.1), split_rows(labels.copy(), 0.1)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[1], split_rows(labels, 0.1, seed=1)[1])


def test_a_class_gives_rows_from_all_over_it_not_its_tail():
    labels = sorted_labels([200] * 5)
    _, held = split_rows(labels, 0.1)
    place = held % 200  # the row's place in its class
    assert place.min() < 100 < place.max()


def test_labels_need_not_be_0_to_k():
    labels = np.array([7, 7, 7, 7, -1, -1, -1, -1, 1000, 1000])
    _, held = split_rows(labels, 0.5)
    assert sorted(labels[held].tolist()) == [-1, -1, 7, 7, 1000]


def test_quotas_give_the_ceilings_to_the_largest_remainders():
    rng = np.random.default_rng(0)
    # 0.25 x (4, 6, 7, 3) = 1, 1.5, 1.75, 0.75: round(5.0) = 5 in all, floors 1 + 1 + 1 + 0 = 3, so
    # the two largest remainders (1.75, 0.75) get their ceilings and 1.5 stays down
    assert quotas(np.array([4, 6, 7, 3]), 0.25, rng).tolist() == [1, 1, 2, 1]


def test_the_train_split_is_cut_only_while_a_split_reads_the_held_out_rows():
    """A caller that points the same settings at other data and swaps the splits (the ImageNet suite
    sets test_split to the folder's `train`, val_split to "") reads that split whole."""
    ours = DataConfig(holdout=0.01, val_split="holdout", test_split="validation")
    assert [part(ours, s) for s in ("train", "holdout", "validation")] == ["kept", "held", ""]
    suite = DataConfig(holdout=0.01, val_split="", test_split="train")
    assert part(suite, "train") == ""
    assert part(DataConfig(val_split="holdout"), "holdout") == ""  # no data.holdout: a plain name
