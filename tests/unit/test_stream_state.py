"""The train stream as a checkpointed part: its `state_dict()` is json, and a fresh stream given it
back (`load_state_dict`) yields exactly the batches the original goes on to yield, map-style and
streamed."""

import json

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.data.batching import batches, streams
from vitcli.errors import CheckpointError
from vitcli.recipe.schema import DataConfig

N, B = 20, 4  # an epoch of 5 micro-batches


def _rows() -> datasets.Dataset:
    """Random 8 px images whose label is their row, so a batch's labels say which rows it holds."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)) for _ in range(N)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": list(range(N))}, features=features)


def _mapped(world_size: int = 1):
    cfg = DataConfig(num_workers=0, crop_min_area=0.3)
    return batches.train_batches(_rows(), cfg, 8, B // world_size, seed=1, world_size=world_size, accum=1)


def _streamed(world_size: int = 1):
    cfg = DataConfig(num_workers=0, crop_min_area=0.3, streaming=True, shuffle_buffer=8)
    ids = _rows().cast_column("image", datasets.Image(decode=False)).to_iterable_dataset(num_shards=2)
    return streams.stream_train_batches(ids, cfg, 8, B, seed=1, world_size=world_size)


def _take(stream, k: int) -> list:
    return [next(stream) for _ in range(k)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb)
                                    in zip(a, b))


@pytest.mark.parametrize("make, saved", [
    (_mapped, {"kind": "mapped", "world_size": 1, "micro_batches": 3}),
    (_streamed, {"kind": "streamed", "world_size": 1, "micro_batches": 3, "epoch": 0, "examples": 12}),
])
def test_a_fresh_stream_given_the_saved_state_goes_on_with_the_same_batches(make, saved):
    original = make()
    _take(original, 3)
    state = json.loads(json.dumps(original.state_dict()))  # as a checkpoint keeps it
    assert state == saved
    ahead = _take(original, 6)  # into the next epoch
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    assert _same(ahead, _take(resumed, 6))
    assert resumed.state_dict() == original.state_dict()


@pytest.mark.parametrize("make", [_mapped, _streamed])
def test_seeking_a_micro_batch_without_a_state_lands_where_the_state_would(make):
    original = make()
    _take(original, 7)
    sought = make()
    sought.seek(7)
    assert sought.state_dict() == original.state_dict()
    assert _same(_take(original, 2), _take(sought, 2))


@pytest.mark.parametrize("make", [_mapped, _streamed])
def test_a_state_of_another_world_size_or_kind_is_refused(make):
    state = make().state_dict()
    with pytest.raises(CheckpointError, match="written by 1 process"):
        make(world_size=2).load_state_dict(state)
    other = {"kind": "other", "world_size": 1, "micro_batches": 0}
    with pytest.raises(CheckpointError, match="is not a"):
        make().load_state_dict(other)


@pytest.mark.parametrize("make", [_mapped, _streamed])
def test_a_stream_is_placed_before_its_first_batch_only(make):
    stream = make()
    next(stream)
    with pytest.raises(RuntimeError, match="before its first batch"):
        stream.load_state_dict(stream.state_dict())


def test_an_older_checkpoints_stream_position_is_taken():
    """Checkpoints before the stream was a part saved {step, epoch, examples}, step counting
    micro-batches."""
    original = _streamed()
    _take(original, 3)
    ahead = _take(original, 2)
    resumed = _streamed()
    resumed.load_state_dict({"step": 3, "epoch": 0, "examples": 12})
    assert _same(ahead, _take(resumed, 2))
