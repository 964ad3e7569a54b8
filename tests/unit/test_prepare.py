"""The resize of `vit prepare-data`: the shorter side becomes min(original, max) with the aspect
kept, the pixels stay close to an exact antialiased resize (torchvision's, an independent
implementation), small images are copied byte for byte and images that do not decode are reported,
not rewritten."""

import io

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from vitcli.data.rows import prepare
from vitcli.errors import DataError
from vitcli.recipe.schema import DataConfig


def _encoded(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _smooth(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A photograph-like (H, W, 3) uint8 image: a few random low frequencies, so resizing has work
    to do but no content at the Nyquist limit, where any two resamplers would rightly disagree."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    img = sum(rng.uniform(0, 1, 3) * np.sin(2 * np.pi * (rng.uniform(0, 4) * x + rng.uniform(0, 4) * y)
                                             + rng.uniform(0, 6))[..., None] for _ in range(4))
    return np.clip(127 + 30 * img, 0, 255).astype(np.uint8)


@pytest.mark.parametrize(("w", "h", "m"), [(500, 375, 256), (375, 500, 256), (640, 427, 256), (301, 300, 256),
                                           (1000, 17, 16), (256, 900, 256), (100, 80, 256), (33, 32, 24)])
def test_the_shorter_side_becomes_min_of_original_and_max_and_the_aspect_is_kept_within_a_pixel(w, h, m):
    nw, nh = prepare.target_size(w, h, m)
    assert min(nw, nh) == min(w, h, m)
    assert (nw <= w) and (nh <= h), "never upscaled"
    # the longer side is the shorter side times the original aspect, to within one pixel
    long_, short = (nh, nw) if w <= h else (nw, nh)
    assert abs(long_ - short * max(w, h) / min(w, h)) <= 1


def _exact(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """torchvision's antialiased bicubic resize of (H, W, 3) pixels to (height, width), as float."""
    chw = torch.from_numpy(pixels.copy()).permute(2, 0, 1)
    out = TF.resize(chw, list(size), antialias=True, interpolation=TF.InterpolationMode.BICUBIC)
    return out.permute(1, 2, 0).double().numpy()


@pytest.mark.parametrize("source_fmt", ["PNG", "JPEG"])  # a JPEG source also takes the DCT-scaled draft path
def test_pixels_are_close_to_an_exact_antialiased_resize(source_fmt):
    """Against torchvision's antialiased bicubic resize of the decoded original. PIL's and
    torchvision's kernels agree (a = -0.5), so png output from a PNG source is within rounding (1
    grey level); the rest is JPEG loss: quality 95 storage ~1 level mean here (6 max, at the sine
    crests), the draft decode of a JPEG source ~0.5 more. Tolerances: mean 2, max 10 levels for jpeg
    output; mean 1, max 4 for png."""
    pixels = _smooth(150, 200)
    source = _encoded(pixels, source_fmt)
    exact = _exact(np.asarray(Image.open(io.BytesIO(source)).convert("RGB")), (60, 80))
    bounds = {"jpeg": (2.0, 10), "png": (1.0, 4) if source_fmt == "JPEG" else (0.01, 1)}
    for fmt, (mean, most) in bounds.items():
        out = prepare.resize_image(source, prepare.Options(max_size=60, format=fmt))
        got = np.asarray(Image.open(io.BytesIO(out)).convert("RGB"), np.float64)
        assert got.shape == (60, 80, 3)
        diff = np.abs(got - exact)
        assert diff.mean() < mean and diff.max() <= most, (fmt, diff.mean(), diff.max())


def test_a_small_image_is_copied_byte_for_byte_and_a_broken_one_is_none():
    data = _encoded(_smooth(20, 30))
    assert prepare.resize_image(data, prepare.Options(max_size=24)) is data
    assert prepare.resize_image(b"not an image", prepare.Options()) is None
    truncated = _encoded(_smooth(64, 64))[:-200]  # a good header over a cut body
    assert prepare.resize_image(truncated, prepare.Options(max_size=256)) is None


def test_grey_stays_grey_and_alpha_is_dropped_only_in_jpeg():
    grey = prepare.resize_image(_encoded(_smooth(40, 40)[..., 0]), prepare.Options(max_size=20))
    assert Image.open(io.BytesIO(grey)).mode == "L"
    rgba = np.dstack([_smooth(40, 40), np.full((40, 40), 200, np.uint8)])
    modes = {f: Image.open(io.BytesIO(prepare.resize_image(_encoded(rgba), prepare.Options(max_size=20,
                                                                                             format=f)))).mode
             for f in ("jpeg", "png")}
    assert modes == {"jpeg": "RGB", "png": "RGBA"}


@pytest.mark.parametrize(("kw", "culprit"), [
    ({"max_size": 15}, "--max-size 15"), ({"format": "raw"}, "--format"), ({"quality": 0}, "--quality 0"),
    ({"workers": -1}, "--workers"), ({"format": "wds"}, "--format wds: .* give --shards tar"),
    ({"shards": "wds"}, "--shards wds")])
def test_bad_options_name_their_flag(kw, culprit):
    with pytest.raises(DataError, match=culprit):
        prepare.Options(**kw)


def _split(labels, feature):
    feats = datasets.Features({"image": datasets.Image(), "label": feature})
    return datasets.Dataset.from_dict({"image": [None] * len(labels), "label": labels}, features=feats)


def test_label_names_come_from_the_classlabel_else_are_the_indices():
    named = datasets.ClassLabel(names=["cat", "dog"])
    assert prepare.label_names({"train": _split([0, 1], named)}, DataConfig()) == ["cat", "dog"]
    ints = {"train": _split([0, 3], datasets.Value("int64")), "test": _split([5], datasets.Value("int64"))}
    assert prepare.label_names(ints, DataConfig()) == [str(k) for k in range(6)]
    assert prepare.label_names(ints, DataConfig(num_classes=8)) == [str(k) for k in range(8)]
    with pytest.raises(DataError, match="data.num_classes=4"):
        prepare.label_names(ints, DataConfig(num_classes=4))
    assert prepare.label_names(ints, DataConfig(label_column="")) == []
