"""The network a run trains, built once for the run (run.build) and for a micro-batch's trial
(run.trial): the recipe's model with its head, its starting weights, inside what its objective
trains around it."""

from __future__ import annotations

import torch
from torch import nn

from vitcli.checkpoints.transfer import load_init
from vitcli.models import zoo
from vitcli.objectives import registry
from vitcli.objectives.objective import Objective
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist


def network(r: Recipe, width: int, device: torch.device,
            dist: Dist | None = None) -> tuple[nn.Module, Objective]:
    """(the module trained, the objective training it) for a head `width` wide (0: none) on
    `device`. With `dist`, init.checkpoint's weights are loaded (checkpoints.transfer); a trial
    passes none: the memory its steps take does not depend on the weights' values."""
    objective = registry.build(r, width, device)
    model = zoo.build_model(r.model, width)
    loaded = dist is not None and bool(r.init.checkpoint)
    if loaded:
        load_init(model, r, width, dist)
    return objective.build(model, fresh=not loaded), objective
