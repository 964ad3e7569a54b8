"""What an objective gives a run, in one interface: the builder (run.build) and the micro-batch
trial (run.trial) ask it, the loop (train.loop) calls its loss per micro-batch and never asks which
it is.

An objective is made once per run, for the recipe and the head's width, and may keep state of its
own (a frozen teacher, say): the loop calls `after_step` after every optimizer step, so one whose
state moves with the weights (DINO's momentum teacher) updates it there. Its trained parts belong in
the module `build` returns, so checkpoints hold them with the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitcli.models.flops import train_flops_per_image
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist
from vitcli.train.loop import Draws

if TYPE_CHECKING:  # the evaluators import datasets: a micro-batch trial needs none (run.trial)
    from vitcli.evaluators.heldout import SplitEvaluator


class Objective:
    """One objective's part in a run of recipe `r` with a head `num_classes` wide, on `device`."""

    # the loop hands `before_step` the step's micro-batches before the first one's loss (DINO's
    # teacher runs over the whole step first, to centre its outputs over the global batch)
    whole_step = False

    def __init__(self, r: Recipe, num_classes: int, device: torch.device):
        self.recipe, self.num_classes, self.device = r, num_classes, device

    @classmethod
    def head_width(cls, r: Recipe, train: Callable[[], object]) -> int:
        """The classifier's width the run builds, 0 for none; `train()` gives the train split, read
        only where the width is the data's."""
        return 0

    def build(self, network: nn.Module, fresh: bool) -> nn.Module:
        """The module the run trains around `network` (with a pretext's own parts); `fresh`: the
        network has no starting weights."""
        return network

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, draws: Draws):
        """(loss, accuracy or None) of one micro-batch of `model` (build's, maybe wrapped: DDP,
        compile), every random draw from `draws`; as 0-d tensors, nothing read back on the host."""
        raise NotImplementedError

    def plan(self, total_steps: int, epoch_steps: float) -> None:
        """The run's length in optimizer steps and an epoch's, for schedules of the objective's own
        (DINO's teacher momentum and temperature); nothing for most."""

    def views(self):
        """What each image becomes in a train batch, for the feed: None for one crop (the recipe's
        augmentation); DINO's multi-crop (data.augmentation.multicrop.MultiCrop)."""

    def example(self, images: int, device: torch.device):
        """A micro-batch of `images` random images as the feed gives it (the micro-batch trial's):
        (B, 3, S, S) at model.img_size."""
        size = self.recipe.model.img_size
        return torch.randn(images, 3, size, size, device=device)

    def before_step(self, xs: list, draws: list[Draws]) -> None:
        """With `whole_step`: the step's micro-batches (this process's), before the first loss."""

    def before_update(self, model: nn.Module, step: int) -> None:
        """After the gradients of step `step` are clipped, before the optimizer's update: nothing,
        for most (DINO drops its frozen last layer's gradients here)."""

    def after_step(self, model: nn.Module, done: int) -> None:
        """After optimizer step `done`: nothing, for an objective without state of its own."""

    def logged(self, dist: Dist) -> dict[str, float]:
        """Metrics of the objective's own for a metrics.jsonl train row (`train/...`), averaged over
        the processes: none for most."""
        return {}

    def why_diverged(self) -> str:
        """What the objective can say about a loss that became non-finite ("": nothing more)."""
        return ""

    def evaluator(self, name: str, ds, dist: Dist) -> SplitEvaluator:
        """The held-out evaluator of split `ds`, its metrics named `name/...`."""
        raise NotImplementedError

    def flops_per_image(self) -> float:
        """Training FLOPs per image (forward and backward), for MFU."""
        return train_flops_per_image(self.recipe.model, self.num_classes)

    def learns(self) -> str:
        """What the run learns, as its announce line says it."""
        raise NotImplementedError

    def exported(self, model: nn.Module) -> nn.Module:
        """The network model.safetensors holds: the ViT alone, whatever pretext parts trained it."""
        return model.backbone
