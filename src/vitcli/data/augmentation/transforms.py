"""Preprocessing of a batch of images (decode.Encoded or decode.Decoded) into uint8 augment.Pixels,
as the loader workers run it: the paper's Inception crop + flip (+ the recipe's augmentation, drawn
here) for training, resize + centre crop for eval, big_vision's square resize for few-shot features,
each resize as data.interpolation says but the few-shot one (fewshot.resize_method). augment.finish
normalises (data.mean, data.std) on the model's device.

The worker resizes and flips each training crop itself (augment.resize_each) and applies the uint8
part of the augmentation (RandAugment or 3-Augment); erasing, on normalised pixels, is left to
finish, on the model's device. With batches.RESIZE_IN_WORKERS off (gpu_check's comparison) crops
leave not yet resized, and augment.finish resizes (bilinear: other interpolations always resize in
the worker) and augments the whole batch there with the same functions.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch
from torchvision.transforms.v2 import functional as TF

from vitcli.data.augmentation import augmentations
from vitcli.data.augmentation.augment import Pixels, draws, pack, per_shape, resize_each, tf_bilinear_clamped
from vitcli.data.augmentation.augmentations import Augmentation
from vitcli.data.decoding.bad_images import Undecodable
from vitcli.errors import DataError
from vitcli.recipe.choices import FEWSHOT_RESIZE_METHODS
from vitcli.recipe.schema import DataConfig


def central_crop_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """(top, left) of big_vision's `central_crop`: margins floored, (h - size) // 2. torchvision's
    CenterCrop rounds half to even instead, one pixel further when the margin is 3 mod 4 (91 -> 80:
    5 vs 6)."""
    return (height - size) // 2, (width - size) // 2


def _sizes(images: list) -> list[tuple[int, int]]:
    """Each image's (height, width) from its header; a header that does not parse names its position
    (Undecodable), as a failed decode does."""
    sizes = []
    for i, img in enumerate(images):
        try:
            sizes.append(img.size)
        except Exception as e:  # noqa: BLE001 - PIL's errors for unknown bytes: UnidentifiedImageError, OSError
            raise Undecodable(i, e) from None
    return sizes


def _crops(images: list, boxes, out: int) -> list[torch.Tensor]:
    """Each image's crop (boxes (B, 4), or None for whole images) as uint8 (3, h, w); a failure
    names its position (Undecodable), for the batch to put a stand-in there or leave it out."""
    crops = []
    for i, img in enumerate(images):
        try:
            crops.append(img.pixels(None if boxes is None else boxes[i], out))
        except Exception as e:  # noqa: BLE001 - decoders fail on corrupt data as OSError, RuntimeError...
            raise Undecodable(i, e) from None
    return crops


def _square(x: torch.Tensor, size: int, aug: augmentations.Drawn | None = None) -> Pixels:
    """uint8 (B, 3, size, size) -> Pixels that finish only normalises (and erases, as `aug`
    says)."""
    sizes = torch.full((len(x), 2), size, dtype=torch.int64)
    return Pixels(x, sizes, torch.zeros(len(x), dtype=torch.bool), size, aug)


def _train(images: list, seed: int, cfg: DataConfig, size: int, aug: Augmentation | None, resize_here: bool):
    """Inception crop (data.crop_min_area..1 of the area; the whole image when data.inception_crop
    is off), flip (data.hflip), drawn from one numpy Generator seeded by the micro-batch, and the
    draws of the recipe's augmentation `aug` from a stream of their own. The crops leave as they
    are, for augment.finish to resize and augment on the model's device, unless `resize_here`: then
    they are resized, flipped and given their uint8 augmentation here."""
    hw = np.array(_sizes(images), dtype=np.int64).reshape(-1, 2)  # (B, 2), headers only
    area = (cfg.crop_min_area, 1.0) if cfg.inception_crop else None
    boxes, flips = draws(hw, seed, area, cfg.hflip)
    drawn = augmentations.draw(aug, len(images), size, seed) if aug is not None else None
    crops = _crops(images, boxes, size)
    if not resize_here:
        return pack(crops, flips, size, drawn)
    x = resize_each(crops, flips, size, cfg.interpolation)  # (B, 3, S, S) uint8, flipped
    if drawn is not None and drawn.on_levels:
        x, drawn = augmentations.apply_levels(x, aug, drawn)
    return _square(x, size, drawn)


def _eval(images: list, seed, size: int, crop_pct: float, interpolation: str = "bilinear",
          crop_mode: str = "center") -> Pixels:
    """timm's eval resize: short side (crop_mode center; both sides: squash) to floor(size /
    crop_pct), then torchvision's CenterCrop(size).
    torchvision's antialiased bilinear and bicubic resizes of uint8 tensors are PIL's algorithms
    (same support, same filters), equal to them within a level or two of rounding; nearest-exact is
    PIL's nearest. Images of one shape in one call."""
    short = math.floor(size / crop_pct)
    mode = TF.InterpolationMode("nearest-exact" if interpolation == "nearest" else interpolation)

    def resize_crop(x: torch.Tensor) -> torch.Tensor:
        sides = [short] if crop_mode == "center" else [short, short]
        return TF.center_crop(TF.resize(x, sides, interpolation=mode, antialias=True), [size, size])

    out = per_shape(_crops(images, None, 0), resize_crop, (0, 3, size, size))
    return _square(out, size)


def _fewshot(images: list, seed, size: int, resize: int) -> Pixels:
    """big_vision's few-shot pp `decode|resize(R)|central_crop(S)`: its resize casts back to the
    decoded dtype (clip to [0, 255], then tf.cast truncates to uint8). Images of one shape in one
    F.interpolate call, bit-identical to the per-image float pipeline this replaced. Stacked
    channels-last, cropped in float and truncated in per_shape's one copy into uint8: 13 against 20
    us an image before (256 PNGs of 32 px to 37, one thread)."""
    top, left = central_crop_offsets(resize, resize, size)
    out = per_shape(_crops(images, None, 0), lambda x: tf_bilinear_clamped(x, resize)
                    [:, :, top : top + size, left : left + size], (0, 3, size, size), channels_last=True)
    return _square(out, size)  # (B, 3, S, S) uint8


def build_transform(cfg: DataConfig, img_size: int, train: bool, resize: int = 0,
                    resize_method: str = "big_vision", resize_here: bool = False):
    """transform(images, seed) -> augment.Pixels of img_size: random for train (seeded by the
    micro-batch), deterministic for eval; picklable, for the loader workers. `resize_here`: training
    crops are resized and given their uint8 augmentation in the worker (batches.resize_in_workers:
    on every device since the H100 measurements), which ships S x S, not crops.

    train: Inception crop over `crop_min_area`..100% of the area (or a plain resize when
    `inception_crop` is off), optional horizontal flip and the recipe's augmentation
    (augmentations.of). eval: resize the short side (data.eval_crop_mode squash: both sides) to
    img_size / eval_crop_pct, centre crop. Both resize as data.interpolation says. `resize` > 0
    (few-shot): squash to resize x resize, centre crop img_size, resampled as `resize_method` says
    (FEWSHOT_RESIZE_METHODS).
    """
    if train:
        aug = augmentations.of(cfg, img_size)
        # augment.levels, the resize on the model's device, is bilinear only
        here = resize_here or cfg.interpolation != "bilinear"
        return partial(_train, cfg=cfg, size=img_size, aug=aug, resize_here=here)
    if resize > 0:
        if resize_method not in FEWSHOT_RESIZE_METHODS:
            raise DataError(f"fewshot.resize_method: '{resize_method}' is not one of "
                            f"{', '.join(FEWSHOT_RESIZE_METHODS)}")
        if resize < img_size:
            raise DataError(f"fewshot.resize={resize} is smaller than the crop img_size={img_size}")
        return partial(_fewshot, size=img_size, resize=resize)
    return partial(_eval, size=img_size, crop_pct=cfg.eval_crop_pct, interpolation=cfg.interpolation,
                   crop_mode=cfg.eval_crop_mode)
