"""Masked patch prediction (the ViT paper's App. B.1.2; models.mpp holds its maths and network): no
labels, no head; scored by the same masked-patch loss on held-out images."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vitcli.models.mpp import MppModel, mpp_step
from vitcli.objectives.objective import Objective
from vitcli.runtime.dist import Dist
from vitcli.train.loop import MPP_STREAM, Draws

if TYPE_CHECKING:  # the evaluators import datasets: see Supervised.evaluator
    from vitcli.evaluators.heldout import PretextEvaluator


class MaskedPatches(Objective):
    """The ViT inside an MppModel: its [mask] embedding and per-patch head train with it."""

    def build(self, network: nn.Module, fresh: bool) -> MppModel:
        r = self.recipe
        return MppModel(network, r.mpp, r.model.patch_size, r.data.mean, r.data.std)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, draws: Draws):
        r = self.recipe
        return mpp_step(model, x, draws(MPP_STREAM), r.mpp, r.model.patch_size)

    def evaluator(self, name: str, ds, dist: Dist) -> PretextEvaluator:
        """Mean loss and mean-colour accuracy; batch i corrupted with seed i, the same every run."""
        from vitcli.evaluators.heldout import PretextEvaluator  # datasets: see Supervised.evaluator

        r = self.recipe

        def measure(model, i, x):
            return mpp_step(model, x, i, r.mpp, r.model.patch_size)

        return PretextEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision,
                                names=("mpp_loss", "mpp_accuracy"), measure=measure)

    def learns(self) -> str:
        return f"masked patch prediction ({self.recipe.mpp.target})"
