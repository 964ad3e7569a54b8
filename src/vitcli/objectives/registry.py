"""The objectives by name: the recipe's `objective` picks one here, once (recipe.objective_checks
has already refused a name it does not list). A new objective is a module of its own and one line
below."""

from __future__ import annotations

import torch

from vitcli.objectives.dino import Dino
from vitcli.objectives.mae import MaskedAutoencoder
from vitcli.objectives.mpp import MaskedPatches
from vitcli.objectives.objective import Objective
from vitcli.objectives.supervised import Supervised
from vitcli.recipe.schema import Recipe

OBJECTIVES: dict[str, type[Objective]] = {"supervised": Supervised, "mpp": MaskedPatches,
                                          "mae": MaskedAutoencoder, "dino": Dino}


def named(r: Recipe) -> type[Objective]:
    """The recipe's objective, not yet made: what it asks before the run is built (its head's
    width)."""
    return OBJECTIVES[r.objective]


def build(r: Recipe, num_classes: int, device: torch.device) -> Objective:
    """The recipe's objective, made for a head `num_classes` wide on `device`."""
    return named(r)(r, num_classes, device)
