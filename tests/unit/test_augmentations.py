"""The recipe's augmentation on the one route: drawn in the worker from the micro-batch's seed
beside the crop boxes (which it leaves as they were), applied where the pixels are, the same
functions in a loader worker (a model on the CPU) and in augment.finish (the model's device), and
the mixing in the loop."""

import io
import random

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.data.augmentation import augmentations
from vitcli.data.augmentation.augment import finish
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.batching import batches
from vitcli.data.decoding.decode import Encoded
from vitcli.recipe.schema import DataConfig

CPU = torch.device("cpu")
LEVEL = 2 / 255  # one uint8 level in [-1, 1]
DEIT = {"randaugment": "rand-m9-mstd0.5-inc1", "erasing": 0.25}
THREE = {"three_augment": True, "color_jitter": 0.3, "erasing": 0.25}


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _photos(n: int = 8) -> list[bytes]:
    """Smooth images with edges, of 40..90 px a side, as PNG files."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(40, 90, 2))
        y, x = np.mgrid[0:h, 0:w]
        out.append(_png(np.stack([x * 255 // w, y * 255 // h, ((x // 7 + y // 5) % 2) * 200 + i], -1)))
    return out


def _batch(cfg: DataConfig, seed: int, resize_here: bool, size: int = 32) -> torch.Tensor:
    """One micro-batch of _photos as the stream hands it over: the worker's transform, then
    finish."""
    pixels = build_transform(cfg, size, train=True, resize_here=resize_here)(
        [Encoded(f) for f in _photos()], seed)
    return finish(pixels, CPU, augmentations.of(cfg, size))


def test_no_augmentation_keys_is_the_plain_route():
    assert augmentations.of(DataConfig(), 32) is None
    aug = augmentations.of(DataConfig(**DEIT), 32)
    assert aug.randaugment is not None and aug.erasing.prob == 0.25 and aug.color_jitter is None
    assert augmentations.of(DataConfig(**THREE), 32).color_jitter == 0.3


@pytest.mark.parametrize("keys", [DEIT, THREE], ids=["deit", "3-augment"])
def test_the_augmentation_leaves_the_crops_and_flips_as_they_were(keys):
    """Its draws come from a stream of their own: with erasing alone, every pixel outside an erased
    box is the plain batch's, bit for bit; with the whole policy, the batch changes."""
    plain = _batch(DataConfig(crop_min_area=0.3), 5, resize_here=True)
    erased = _batch(DataConfig(crop_min_area=0.3, erasing=1.0, erasing_mode="const"), 5, resize_here=True)
    kept = erased != 0
    assert torch.equal(erased[kept], plain[kept]) and (~kept).float().mean() > 0.01
    augmented = _batch(DataConfig(crop_min_area=0.3, **keys), 5, resize_here=True)
    assert (augmented - plain).abs().amax((1, 2, 3)).gt(LEVEL).sum() >= 4  # most images changed


@pytest.mark.parametrize("keys", [DEIT, THREE], ids=["deit", "3-augment"])
def test_a_worker_and_the_models_device_give_the_same_batch(keys):
    """resize_here (a model on the CPU: the worker resizes and runs the uint8 ops) against the
    device route (augment.finish resizes, runs the same ops, erases): the two resizes round alike
    within a level (augment.levels), which an op with a threshold (solarize, posterize) can turn
    into a large difference for the few pixels at its edge. Measured over seeds 0-4: mean
    0.005-0.044 levels, at most 0.03% of pixels more than 4 levels apart (one pixel 48 levels apart,
    a solarize edge); held to 0.1 level and 0.5%."""
    cfg = DataConfig(crop_min_area=0.3, **keys)
    for seed in range(3):
        worker, device = _batch(cfg, seed, resize_here=True), _batch(cfg, seed, resize_here=False)
        diff = (worker - device).abs()
        assert diff.mean() < 0.1 * LEVEL and (diff > 4 * LEVEL).float().mean() < 0.005, (seed, diff.mean())


def test_a_batch_is_a_function_of_its_seed():
    cfg = DataConfig(crop_min_area=0.3, **DEIT)
    a, b, other = _batch(cfg, 3, True), _batch(cfg, 3, True), _batch(cfg, 4, True)
    assert torch.equal(a, b) and not torch.equal(a, other)


def test_mixing_draws_from_its_seed_alone():
    spec = augmentations.mixing_of(DataConfig(mixup_alpha=0.8, cutmix_alpha=1.0), 5, 0.1)
    assert augmentations.mixing_of(DataConfig(), 5, 0.1) is None
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 5
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    (xa, ta), (xb, tb) = (augmentations.mix(spec, x, y, 11) for _ in range(2))
    assert torch.equal(xa, xb) and torch.equal(ta, tb) and ta.shape == (8, 5)
    assert torch.allclose(ta.sum(1), torch.ones(8))
    assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


def test_the_stream_applies_what_the_worker_drew():
    """train_batches on the CPU: the batches carry the augmentation (not the plain crops)."""
    ds = _dataset()
    plain = next(iter(batches.train_batches(ds, DataConfig(num_workers=0), 32, 8, seed=1)))[0]
    deit = next(iter(batches.train_batches(ds, DataConfig(num_workers=0, **DEIT), 32, 8, seed=1)))[0]
    assert plain.shape == deit.shape and not torch.equal(plain, deit)


def _dataset() -> datasets.Dataset:
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    rows = [{"bytes": f, "path": None} for f in _photos()]
    return datasets.Dataset.from_dict({"image": rows, "label": list(range(8))}, features=features)
