"""The augmentation a recipe asks for, on top of the crop and flip: per image, RandAugment or DeiT
III's 3-Augment on uint8 pixels at the output size, then random erasing on the normalised batch; per
micro-batch, Mixup and CutMix of images and labels in the training loop (`mix`).

Every choice is drawn in the loader worker with the crop boxes, from the micro-batch's seed
(`draw`), and travels with the batch as small tensors (`Drawn`, pinned like the pixels); the uint8
work runs batched in the worker, which resizes there (batches.resize_in_workers), erasing on the
model's device (augment.finish). With batches.RESIZE_IN_WORKERS off (gpu_check's comparison) the
uint8 work runs on the device too: the same functions, so a batch is the same function of (seed,
step, micro-batch) on either route, within the rounding of the resize that precedes them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vitcli.data.augmentation import erasing, mixing, randaugment, three_augment
from vitcli.recipe.schema import DataConfig

# the draws' own numpy stream beside the crop boxes' (augment.draws), so the boxes stay as they were
AUGMENT_STREAM = 1


@dataclass(frozen=True)
class Augmentation:
    """What a recipe's data section asks for beyond crop and flip; built once per stream (`of`)."""

    randaugment: randaugment.RandSpec | None = None
    color_jitter: float | None = None  # not None: 3-Augment, with this jitter strength
    erasing: erasing.ErasingSpec | None = None


def of(cfg: DataConfig, img_size: int) -> Augmentation | None:
    """The recipe's augmentation, or None when it asks for none (the plain crop + flip route)."""
    aug = Augmentation(
        randaugment.parse(cfg.randaugment, img_size) if cfg.randaugment else None,
        cfg.color_jitter if cfg.three_augment else None,
        erasing.ErasingSpec(prob=cfg.erasing, mode=cfg.erasing_mode, max_count=cfg.erasing_count)
        if cfg.erasing > 0 else None,
    )
    return aug if aug != Augmentation() else None


@dataclass
class Drawn:
    """A micro-batch's augmentation draws, CPU tensors until `to`; a part is None once applied (the
    worker's uint8 ops) or when the recipe has none."""

    rand: randaugment.RandDraws | None = None
    three: three_augment.ThreeDraws | None = None
    erasing: erasing.ErasingDraws | None = None

    def _map(self, fn) -> Drawn:
        return Drawn(*(None if d is None else fn(d) for d in (self.rand, self.three, self.erasing)))

    def pin_memory(self) -> Drawn:
        return self._map(lambda d: d.pin_memory())

    def to(self, device: torch.device) -> Drawn:
        return self._map(lambda d: d.to(device))

    @property
    def on_levels(self) -> bool:
        """Whether uint8 work (RandAugment, 3-Augment) is still to be done."""
        return self.rand is not None or self.three is not None


def draw(aug: Augmentation, n: int, size: int, seed: int) -> Drawn:
    """The draws of `n` images of side `size` for the micro-batch of `seed`, from a numpy stream of
    their own: RandAugment's or 3-Augment's, then erasing's."""
    rng = np.random.default_rng([seed, AUGMENT_STREAM])
    return Drawn(
        randaugment.draw(aug.randaugment, n, rng) if aug.randaugment is not None else None,
        three_augment.draw(n, rng, aug.color_jitter) if aug.color_jitter is not None else None,
        erasing.draw(aug.erasing, n, size, size, rng) if aug.erasing is not None else None,
    )


def apply_levels(x: torch.Tensor, aug: Augmentation, drawn: Drawn) -> tuple[torch.Tensor, Drawn]:
    """uint8 (B, 3, S, S) -> the same after RandAugment or 3-Augment (draws on x's device), and the
    draws left for later (erasing)."""
    if drawn.rand is not None:
        x = randaugment.apply(x, drawn.rand, aug.randaugment)
    if drawn.three is not None:
        x = three_augment.apply(x, drawn.three)
    return x, replace(drawn, rand=None, three=None)


def apply_normalised(x: torch.Tensor, aug: Augmentation, drawn: Drawn) -> torch.Tensor:
    """The normalised float batch after random erasing, in place (draws on x's device)."""
    if drawn.erasing is None:
        return x
    return erasing.apply(x, drawn.erasing, aug.erasing)


def mixing_of(cfg: DataConfig, num_classes: int, label_smoothing: float) -> mixing.MixSpec | None:
    """The recipe's Mixup / CutMix, or None when it mixes nothing."""
    spec = mixing.MixSpec(mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, prob=cfg.mix_prob,
                          switch_prob=cfg.mix_switch_prob, mode=cfg.mix_mode,
                          label_smoothing=label_smoothing, num_classes=num_classes)
    return spec if spec.active else None


def mix(spec: mixing.MixSpec, x: torch.Tensor, y: torch.Tensor,
        seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch (x (B, 3, H, W), labels y (B,)) mixed as `spec` says, with draws from `seed`
    (its own micro-batch seed): the mixed images and soft targets (B, K), on x's device."""
    drawn = mixing.draw(spec, len(x), x.shape[-2], x.shape[-1], np.random.default_rng(seed))
    return mixing.apply(x, y, drawn.to(x.device), spec)
