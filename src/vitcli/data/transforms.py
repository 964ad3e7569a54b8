"""Image preprocessing: the paper's Inception crop + flip (+ RandAugment) for training, resize + centre crop
for eval, big_vision's square resize for few-shot features. Outputs: (3, img_size, img_size) in [-1, 1].

Built from timm's pieces so the semantics (crop sampling, RandAugment hyper-parameters) are timm's own.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform
from timm.data.auto_augment import rand_augment_transform
from timm.data.transforms import RandomResizedCropAndInterpolation, str_to_interp_mode
from torchvision import transforms

from vitcli.errors import DataError
from vitcli.recipe.choices import FEWSHOT_RESIZE_METHODS
from vitcli.recipe.data_checks import check_randaugment
from vitcli.recipe.schema import DataConfig

MEAN = (0.5, 0.5, 0.5)  # the ViT paper feeds pixels scaled to [-1, 1], not ImageNet-normalised ones
INTERPOLATION = "bilinear"  # big_vision's inception_crop and resize use bilinear


def to_rgb(img: Image.Image) -> Image.Image:
    """Grayscale, palette and RGBA images become 3-channel RGB; RGB passes through untouched."""
    return img if img.mode == "RGB" else img.convert("RGB")


def _randaugment(spec: str, img_size: int):
    """timm RandAugment from a spec like `rand-m9-mstd0.5`, with timm's own defaults for our mean and size."""
    check_randaugment(spec)
    hparams = {
        "translate_const": int(img_size * 0.45),
        "img_mean": tuple(round(255 * m) for m in MEAN),
        "interpolation": Image.BILINEAR,
    }
    try:
        return rand_augment_transform(spec, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        raise DataError(
            f"data.randaugment: cannot parse '{spec}' ({e!r}); use a timm spec like rand-m9-mstd0.5"
        ) from None


def to_signed_tensor(img: Image.Image) -> torch.Tensor:
    """uint8 (H, W, 3) PIL -> float32 (3, H, W) in [-1, 1]; equals ToTensor + Normalize(0.5, 0.5) at a fifth
    of the cost (measured ~25 vs ~200 us at 32 px, where they dominated the whole pipeline)."""
    x = np.asarray(img, dtype=np.float32) / np.float32(127.5) - np.float32(1.0)  # (H, W, 3)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


def central_crop_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """(top, left) of big_vision's `central_crop`: margins floored, (h - size) // 2. torchvision's CenterCrop
    rounds half to even instead, one pixel further when the margin is 3 mod 4 (91 -> 80: 5 vs 6)."""
    return (height - size) // 2, (width - size) // 2


def tf_bilinear(x: torch.Tensor, size: int) -> torch.Tensor:
    """(3, H, W) float -> (3, size, size): tf.image.resize(method="bilinear", antialias=False), the TF2
    half-pixel-centre sampling (source = (dst + 0.5) * in / out - 0.5, clamped at the edges), no prefilter."""
    return F.interpolate(x[None], size=(size, size), mode="bilinear", align_corners=False, antialias=False)[0]


def big_vision_resize_crop(img: Image.Image, resize: int, img_size: int) -> torch.Tensor:
    """big_vision's few-shot pp `decode|resize(R)|central_crop(S)|value_range(-1,1)` on a PIL image."""
    x = torch.from_numpy(np.asarray(to_rgb(img), dtype=np.float32).transpose(2, 0, 1).copy())  # (3, H, W)
    # its `resize` op casts back to the decoded dtype: clip to [0, 255], then tf.cast truncates to uint8
    x = tf_bilinear(x, resize).clamp_(0.0, 255.0).floor_()  # (3, R, R)
    top, left = central_crop_offsets(resize, resize, img_size)
    x = x[:, top : top + img_size, left : left + img_size]  # (3, S, S)
    return (x / np.float32(127.5) - np.float32(1.0)).contiguous()


def _fewshot_transform(img_size: int, resize: int, method: str):
    """Squash to resize x resize, centre crop img_size, [-1, 1]; `method` names whose resampling."""
    if method not in FEWSHOT_RESIZE_METHODS:
        raise DataError(f"fewshot.resize_method: '{method}' is not one of "
                        f"{', '.join(FEWSHOT_RESIZE_METHODS)}")
    if resize < img_size:
        raise DataError(f"fewshot.resize={resize} is smaller than the crop img_size={img_size}")
    return partial(big_vision_resize_crop, resize=resize, img_size=img_size)  # picklable for workers


def build_transform(cfg: DataConfig, img_size: int, train: bool, resize: int = 0,
                    resize_method: str = "big_vision"):
    """PIL image -> float tensor (3, img_size, img_size) in [-1, 1]; random for train, deterministic for eval.

    train: Inception crop over `crop_min_area`..100% of the area (or a plain resize when `inception_crop` is
    off), optional horizontal flip and RandAugment. eval: resize the short side to img_size / eval_crop_pct,
    centre crop. `resize` > 0 (few-shot): squash to resize x resize, centre crop img_size, resampled as
    `resize_method` says (FEWSHOT_RESIZE_METHODS).
    """
    interp = str_to_interp_mode(INTERPOLATION)
    if train:
        if cfg.inception_crop:
            scale = (cfg.crop_min_area, 1.0)
            crop = RandomResizedCropAndInterpolation(img_size, scale=scale, interpolation=INTERPOLATION)
        else:
            crop = transforms.Resize((img_size, img_size), interpolation=interp)
        steps = [to_rgb, crop]
        if cfg.hflip:
            steps.append(transforms.RandomHorizontalFlip())
        if cfg.randaugment:
            steps.append(_randaugment(cfg.randaugment, img_size))
        return transforms.Compose([*steps, to_signed_tensor])
    if resize > 0:
        return _fewshot_transform(img_size, resize, resize_method)
    # timm's eval resize: short side to floor(img_size / crop_pct), then CenterCrop(img_size)
    base = create_transform(img_size, crop_pct=cfg.eval_crop_pct, interpolation=INTERPOLATION)  # eval mode
    resize_crop = [t for t in base.transforms if isinstance(t, (transforms.Resize, transforms.CenterCrop))]
    return transforms.Compose([to_rgb, *resize_crop, to_signed_tensor])


@contextmanager
def seeded(seed: int | None):
    """Pin the global RNGs augmentation draws from (timm crops: `random`; RandAugment: numpy; flips: torch) to
    `seed` for the block, then restore them so the caller's own streams are untouched. None: do nothing."""
    if seed is None:
        yield
        return
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
