"""Supervised classification: the recipe's loss (train.losses.loss_fn) on the labels, Mixup or
CutMix if the recipe mixes, beside a frozen teacher if it names one (train.distill); scored by
held-out top-1 and loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from vitcli.data.augmentation.augmentations import mix, mixing_of
from vitcli.objectives.objective import Objective
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist
from vitcli.train import distill
from vitcli.train.loop import MIXUP_STREAM, Draws
from vitcli.train.losses import loss_fn

if TYPE_CHECKING:  # the evaluators import datasets: a micro-batch trial needs none (run.trial)
    from vitcli.evaluators.heldout import ClassificationEvaluator


class Supervised(Objective):
    """A classifier trained on labels; its teacher, if any, is loaded with the network (`build`)."""

    def __init__(self, r: Recipe, num_classes: int, device: torch.device):
        super().__init__(r, num_classes, device)
        self.mixup = mixing_of(r.data, num_classes, r.optim.label_smoothing)
        self.teacher: nn.Module | None = None
        self.criterion = distill.criterion(loss_fn(r.optim), None, r.distill)

    @classmethod
    def head_width(cls, r: Recipe, train: Callable[[], object]) -> int:
        """The recipe's model.num_classes, else the data's."""
        from vitcli.data.rows.sources import num_classes  # datasets: see evaluator

        return r.model.num_classes or num_classes(r.data, train())

    def build(self, network: nn.Module, fresh: bool) -> nn.Module:
        """The network itself; the teacher distill.teacher names loaded, and a DeiT student's
        distillation token set training on it."""
        r = self.recipe
        self.teacher = distill.load_teacher(r, self.num_classes, self.device)
        self.criterion = distill.criterion(loss_fn(r.optim), self.teacher, r.distill)
        distill.use_distillation_token(network, r.distill)
        return network

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, draws: Draws):
        if self.mixup is not None:
            x, y = mix(self.mixup, x, y, draws(MIXUP_STREAM))
        return self.criterion(model(x), y, x), None  # x: the teacher's input too (train.distill)

    def evaluator(self, name: str, ds, dist: Dist) -> ClassificationEvaluator:
        # imported here: the evaluators import datasets, which a micro-batch trial has no use for
        from vitcli.evaluators.heldout import ClassificationEvaluator

        r = self.recipe
        return ClassificationEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision,
                                       loss=loss_fn(r.optim))

    def learns(self) -> str:
        d = self.recipe.distill
        taught = f" taught by {d.teacher} ({d.type} distillation, alpha {d.alpha:g})" if d.teacher else ""
        return f"{self.num_classes} classes{taught}"

    def exported(self, model: nn.Module) -> nn.Module:
        return model
