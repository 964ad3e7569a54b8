"""Few-shot preprocessing is big_vision's `decode|resize(R)|central_crop(S)|value_range(-1,1)` by
default.

big_vision resizes with tf.image.resize(method="bilinear", antialias=False): half-pixel centres, no
low-pass prefilter, cast back to the decoded uint8 (clip, truncate); R = int(256 / 224 * S); the
crop margin is floored; it is the one few-shot resize (`fewshot.resize_method=big_vision`).
"""

import io

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from helpers import tiny_vit
from vitcli.data.augmentation.augment import finish, tf_bilinear
from vitcli.data.augmentation.transforms import build_transform, central_crop_offsets
from vitcli.data.decoding.decode import Encoded
from vitcli.errors import RecipeError
from vitcli.fewshot import features
from vitcli.fewshot.evaluate import preprocessing
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.dist import Dist

TOL = 1e-5  # in [-1, 1] units (1.3e-3 of a grey level): float32 interpolation against a float64 reference


def half_pixel_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """TF2 bilinear without antialias, written out in float64: output pixel i samples the input at
    (i + 0.5) * in / out - 0.5; floor and ceil neighbours clamped into the image; linear weights
    between."""

    def axis(out_n: int, in_n: int):
        src = (np.arange(out_n) + 0.5) * (in_n / out_n) - 0.5
        lo_f = np.floor(src)
        lo = np.clip(lo_f, 0, in_n - 1).astype(int)
        hi = np.clip(np.ceil(src), 0, in_n - 1).astype(int)
        return lo, hi, src - lo_f

    y0, y1, wy = axis(out_h, img.shape[0])
    x0, x1, wx = axis(out_w, img.shape[1])
    img = img.astype(np.float64)
    rows = img[y0] * (1 - wy)[:, None, None] + img[y1] * wy[:, None, None]  # (out_h, W, C)
    return rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]  # (out_h, out_w, C)


def big_vision_resize_crop(img: Image.Image, resize: int, img_size: int) -> torch.Tensor:
    """The few-shot path as the workers run it: PNG -> uint8 -> resize(R) | central_crop(S) -> [-1,
    1]."""
    buf = io.BytesIO()
    img.save(buf, "PNG")
    fewshot_pp = build_transform(DataConfig(), img_size, train=False, resize=resize)
    pixels = fewshot_pp([Encoded(buf.getvalue())], 0)
    return finish(pixels, torch.device("cpu"))[0]  # (3, S, S)


def float_pipeline(img: Image.Image, resize: int, img_size: int) -> torch.Tensor:
    """The float32 PIL pipeline the uint8 one replaced (vitcli 0.1), kept as its reference."""
    x = torch.from_numpy(np.asarray(img.convert("RGB"), dtype=np.float32).transpose(2, 0, 1).copy())
    x = tf_bilinear(x, resize).clamp_(0.0, 255.0).floor_()  # (3, R, R)
    top, left = central_crop_offsets(resize, resize, img_size)
    x = x[:, top : top + img_size, left : left + img_size]  # (3, S, S)
    return (x / np.float32(127.5) - np.float32(1.0)).contiguous()


@pytest.mark.parametrize("shape,resize,size", [((45, 45), 36, 32), ((50, 71), 36, 32), ((17, 23), 40, 32),
                                               ((91, 91), 91, 80)])
def test_the_uint8_path_equals_the_float_pipeline_exactly(shape, resize, size):
    img = Image.fromarray(np.random.default_rng(sum(shape)).integers(0, 256, (*shape, 3), dtype=np.uint8))
    assert torch.equal(big_vision_resize_crop(img, resize, size), float_pipeline(img, resize, size))


def checkerboard(h: int, w: int) -> np.ndarray:
    """1-pixel black/white cells, coloured per channel:
    antialiasing averages it to grey, bilinear does not."""
    cells = ((np.arange(h)[:, None] + np.arange(w)[None, :]) % 2).astype(np.float64)
    return (np.stack([cells, 1 - cells, cells * 0.5], axis=-1) * 255).astype(np.uint8)  # (h, w, 3)


@pytest.mark.parametrize("shape,size", [((40, 40), 36), ((30, 50), 36), ((17, 11), 36)],
                         ids=["down", "down-non-square", "up"])
def test_resize_is_tf_half_pixel_bilinear(shape, size):
    img = checkerboard(*shape)
    got = tf_bilinear(torch.from_numpy(img.transpose(2, 0, 1).astype(np.float32)), size).numpy()
    want = half_pixel_bilinear(img, size, size).transpose(2, 0, 1)
    np.testing.assert_allclose(got / 127.5, want / 127.5, rtol=0, atol=TOL)


def test_big_vision_pipeline_matches_the_reference_and_differs_from_antialiasing():
    img = checkerboard(45, 45)
    got = big_vision_resize_crop(Image.fromarray(img), resize=36, img_size=32).numpy()  # (3, 32, 32)
    resized = np.clip(half_pixel_bilinear(img, 36, 36), 0, 255)  # big_vision's cast back to uint8: truncate
    want = (np.floor(resized) / 127.5 - 1.0)[2:34, 2:34].transpose(2, 0, 1)
    # float32 one ulp under an integer would truncate a level lower; this image has no value near
    # one
    assert (np.abs(resized - np.round(resized)) > 1e-3).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    pil = T.Compose([T.Resize((36, 36), T.InterpolationMode.BILINEAR), T.CenterCrop(32), T.ToTensor(),
                     T.Normalize((0.5,) * 3, (0.5,) * 3)])  # PIL's antialiased resize
    differs = np.abs(pil(Image.fromarray(img)).numpy() - got) > 0.1
    assert differs.mean() > 0.5, "the image must tell antialiasing apart from plain bilinear"


def test_central_crop_floors_the_margin():
    assert [central_crop_offsets(n, n, 80) for n in (80, 81, 83, 91)] == [(0, 0), (0, 0), (1, 1), (5, 5)]
    assert central_crop_offsets(438, 440, 384) == (27, 28)
    # torchvision rounds half to even (91 - 80 = 11: 5.5 -> 6), one pixel off big_vision's 11 // 2 =
    # 5
    img = np.random.default_rng(0).integers(0, 256, (91, 91, 3), dtype=np.uint8)
    tv = T.CenterCrop(80)(Image.fromarray(img))
    np.testing.assert_array_equal(np.asarray(tv), img[6:86, 6:86])
    got = big_vision_resize_crop(Image.fromarray(img), resize=91, img_size=80)  # same size: no resampling
    np.testing.assert_allclose(got.numpy(), img[5:85, 5:85].transpose(2, 0, 1) / 127.5 - 1.0,
                               rtol=0, atol=TOL)


@pytest.mark.parametrize("img_size,big_vision", [(32, 36), (224, 256), (384, 438), (80, 91)])
def test_resize_side_is_big_visions(img_size, big_vision):
    base = ["model.patch_size=8", f"model.img_size={img_size}"]
    recipe = resolve("pretrain", None, base, inputs=False)
    assert preprocessing(recipe) == (img_size, big_vision, "big_vision")
    assert int(256 / 224 * img_size) == big_vision  # big_vision configs/proj/cappa/pretrain.py


def test_gray_and_rgba_images_become_three_equal_or_rgb_channels():
    gray = Image.fromarray(np.arange(400, dtype=np.uint8).reshape(20, 20))
    x = big_vision_resize_crop(gray, resize=36, img_size=32)
    assert x.shape == (3, 32, 32) and torch.equal(x[0], x[2])
    assert big_vision_resize_crop(gray.convert("RGBA"), resize=36, img_size=32).shape == (3, 32, 32)


def test_the_method_is_checked_keyed_and_dumped():
    for gone in ("bicubic", "pil_antialias"):  # pil_antialias, vitcli's pre-0.1.0 resize, is gone
        with pytest.raises(RecipeError, match=rf"^fewshot.resize_method: '{gone}' is not one of big_vision$"):
            resolve("pretrain", None, [f"fewshot.resize_method={gone}"])
    assert "resize_method: big_vision" in to_yaml(resolve("pretrain", None, [], inputs=False))
    pre = {"img_size": 32, "resize": 36, "precision": "fp32"}
    keys = {features.cache_key("w", "t", "train", {**pre, "resize_method": m})
            for m in ("big_vision", "another")}
    assert len(keys) == 2


def test_a_batch_of_mixed_shapes_equals_each_image_alone():
    """The workers resize images of one shape in one call (augment.per_shape): a batch with repeated
    and distinct shapes gives, row by row and in order, what the float pipeline gives each image
    alone."""
    rng = np.random.default_rng(5)
    shapes = [(45, 45), (50, 71), (45, 45), (32, 32), (50, 71), (45, 45)]
    images = [Image.fromarray(rng.integers(0, 256, (*s, 3), dtype=np.uint8)) for s in shapes]
    encoded = []
    for img in images:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        encoded.append(Encoded(buf.getvalue()))
    got = finish(build_transform(DataConfig(), 32, train=False, resize=36)(encoded, 0), torch.device("cpu"))
    assert torch.equal(got, torch.stack([float_pipeline(img, 36, 32) for img in images]))


def _png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("workers", [0, 1])
def test_extracted_features_equal_a_plain_loop_over_the_reference_pipeline_bit_for_bit(workers):
    """features.extract (loader, per-shape batching, workers, finish, gather back into row order)
    gives exactly, bit for bit on the CPU in fp32, what a plain loop gives: the batches of
    eval_batch_size rows in row order less the rows that do not decode, each image through the float
    pipeline alone, the network's pre-logits. Mixed shapes, an undecodable row, a short last
    batch."""
    rng = np.random.default_rng(3)
    shapes = [(45, 45), (50, 71), (45, 45), None, (32, 32), (17, 23), (45, 45), (50, 71), (60, 40), (45, 45)]
    images = [None if s is None else rng.integers(0, 256, (*s, 3), dtype=np.uint8) for s in shapes]
    rows = [{"bytes": b"not an image" if x is None else _png(x), "path": None} for x in images]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    ds = datasets.Dataset.from_dict({"image": rows, "label": list(range(10))}, features=feats)
    model, batch = tiny_vit(img_size=32), 4
    cfg = DataConfig(num_workers=workers, eval_batch_size=batch)
    got, labels = features.extract(model, ds, cfg, 32, 36, Dist(0, 1, 0, torch.device("cpu")), "fp32")
    want = []
    with torch.inference_mode():
        for start in range(0, len(ds), batch):
            x = [float_pipeline(Image.fromarray(images[i]), 36, 32) for i in range(start, start + batch)
                 if i < len(ds) and images[i] is not None]
            want.append(features.pre_logits(model, torch.stack(x)))
    assert labels.tolist() == [i for i, x in enumerate(images) if x is not None]
    assert got.dtype == np.float32 and np.array_equal(got, torch.cat(want).numpy())


def test_intra_op_threads_are_restored_on_the_way_out_even_by_an_error():
    from vitcli.evaluators.inference import intra_op_threads

    before = torch.get_num_threads()
    with pytest.raises(KeyError), intra_op_threads(1):
        assert torch.get_num_threads() == 1
        raise KeyError
    assert torch.get_num_threads() == before
