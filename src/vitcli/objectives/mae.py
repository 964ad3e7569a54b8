"""Masked autoencoders (He et al. 2022; models.mae holds the maths and the network): no labels, no
head; each image's mask a function of (run seed, its index in the run), so it does not change with
the micro-batch; scored by the same reconstruction loss on held-out images."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from vitcli.models.flops import train_flops_per_image
from vitcli.models.mae import MaeModel, mae_step
from vitcli.objectives.objective import Objective
from vitcli.runtime.dist import Dist
from vitcli.train.loop import Draws

if TYPE_CHECKING:  # the evaluators import datasets: see Supervised.evaluator
    from vitcli.evaluators.heldout import PretextEvaluator


class MaskedAutoencoder(Objective):
    """The ViT as MAE's encoder inside an MaeModel, whose decoder trains with it (and stays in the
    training state); a fresh network takes MAE's initialisation, starting weights only the decoder
    does."""

    def build(self, network: nn.Module, fresh: bool) -> MaeModel:
        r = self.recipe
        return MaeModel(network, r.mae, r.model.patch_size, fresh=fresh)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, draws: Draws):
        r = self.recipe
        first = draws.first_sample(len(x))
        return mae_step(model, x, r.run.seed, first, r.mae, r.model.patch_size), None

    def evaluator(self, name: str, ds, dist: Dist) -> PretextEvaluator:
        """The reconstruction loss, the same masks every run: image p of batch i is this rank's
        image i x eval_batch_size + p, masked with seed 0 (mae.mask_noise); every image has as many
        removed patches, so the mean over images is the loss's."""
        from vitcli.evaluators.heldout import PretextEvaluator  # datasets: see Supervised.evaluator

        r = self.recipe

        def measure(model, i, x):
            return (mae_step(model, x, 0, i * r.data.eval_batch_size, r.mae, r.model.patch_size),)

        return PretextEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision,
                                names=("mae_loss",), measure=measure)

    def flops_per_image(self) -> float:
        """The MAE step's: the encoder on the kept patches and the decoder on all (models.flops)."""
        return train_flops_per_image(self.recipe.model, self.num_classes, self.recipe.mae)

    def learns(self) -> str:
        return f"a masked autoencoder ({self.recipe.mae.mask_ratio:g} of the patches removed)"
