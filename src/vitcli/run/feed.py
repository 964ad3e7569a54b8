"""The run's train micro-batches for the loop (map-style or streamed), and the check that every
train label has a logit: the whole split's before anything is written, a streamed split's as each
batch arrives."""

from __future__ import annotations

from vitcli.data.augmentation.multicrop import MultiCrop
from vitcli.data.batching import batches, streams
from vitcli.errors import RecipeError
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist
from vitcli.train.loop import Feed


def check_labels(train_ds, r: Recipe, num_classes: int) -> None:
    """Every train label must have a logit: a head smaller than the labels would fail deep in the
    loss."""
    check_label(int(batches.labels(train_ds, r.data.label_column).max()), r, num_classes)


def check_label(top: int, r: Recipe, num_classes: int) -> None:
    """The largest train label seen so far against the head's width (0: mpp or mae, no head to
    check)."""
    if num_classes and top >= num_classes:
        key = "model.num_classes" if r.model.num_classes else "data.num_classes"
        raise RecipeError(f"{key}={num_classes}, but the train split '{r.data.train_split}' of "
                          f"{r.data.source} has label {top}; set {key}={top + 1} or more "
                          "(model.num_classes=0 takes the data's own count)")


class LabelChecked:
    """A streamed train split's batches, each one's labels checked against the head as it arrives
    (one max over a (B,) CPU tensor, before it goes to the device): no scan of a stream can run
    ahead of training. The tally of skipped images and the state a checkpoint keeps are the
    stream's."""

    def __init__(self, stream: streams.TrainStream, r: Recipe, num_classes: int):
        self.stream, self.recipe, self.num_classes = stream, r, num_classes
        self.skipped = stream.skipped

    def __iter__(self) -> LabelChecked:
        return self

    def __next__(self):
        x, y = next(self.stream)
        if len(y):
            check_label(int(y.max()), self.recipe, self.num_classes)
        return x, y

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)

    def seek(self, micro_batch: int) -> None:
        self.stream.seek(micro_batch)

    def skip(self, skips: tuple) -> None:
        self.stream.skip(skips)

    def rewind(self) -> None:
        self.stream.rewind()


def train_feed(r: Recipe, train_ds, num_classes: int = 0, views: MultiCrop | None = None) -> Feed:
    """The loop's train micro-batches: map-style (data.batches) or streamed (data.streams, its
    labels checked against a `num_classes` head as they come), as data.streaming says; both from the
    run's first micro-batch until the CheckpointManager places them where a checkpoint left them.
    `views`: DINO's multi-crop, x = (globals (2B, 3, S, S), locals (nB, 3, s, s)) (multicrop.py)."""

    def mapped(micro: int, accum: int, dist: Dist):
        return batches.train_batches(train_ds, r.data, r.model.img_size, micro, r.run.seed, 0, dist.rank,
                                     dist.world_size, accum, device=dist.device, views=views)

    def streamed(micro: int, accum: int, dist: Dist):
        stream = streams.stream_train_batches(train_ds, r.data, r.model.img_size, micro, r.run.seed, 0,
                                              dist.rank, dist.world_size, accum=accum,
                                              device=dist.device, views=views)
        return LabelChecked(stream, r, num_classes)

    return streamed if r.data.streaming else mapped
