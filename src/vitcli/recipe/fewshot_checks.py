"""Checks of the fewshot section (frozen-feature evaluation: few-shot and the all-data protocols)
beyond the ranges every number key gets (checks.RANGES): shot counts, the resize, a custom task's
source, the ridge strength, the protocols named and what they need."""

from __future__ import annotations

import math

from vitcli.errors import RecipeError
from vitcli.recipe.choices import TRANSFER_PROTOCOLS
from vitcli.recipe.schema import Recipe


def check_fewshot(recipe: Recipe) -> None:
    """The fewshot section's values that its ranges (checks.RANGES) do not cover."""
    f = recipe.fewshot
    if f.tasks and not f.shots:
        raise RecipeError("fewshot.shots is empty: give the shot counts, e.g. fewshot.shots=1,5,10,25")
    # a size at 224 px: resize / 224 * img_size could never hold the img_size crop
    if f.resize < 224:
        raise RecipeError(f"fewshot.resize={f.resize} is below 224: "
                          "it is the resize before a 224 px centre crop "
                          "(big_vision's 256), scaled to the model's img_size; 224 means no crop")
    if f.custom.name and not f.custom.source:
        raise RecipeError(f"fewshot.custom.source is empty: say where task '{f.custom.name}' reads its data")
    bad = [k for k in f.shots if k < 1]
    if bad:
        raise RecipeError(f"fewshot.shots must be >= 1 per class, got {bad[0]} in {f.shots}")
    unknown = [p for p in f.protocols if p not in TRANSFER_PROTOCOLS]
    if unknown:
        raise RecipeError(f"fewshot.protocols: '{unknown[0]}' is not one of {', '.join(TRANSFER_PROTOCOLS)}")
    if not f.protocols:
        raise RecipeError(f"fewshot.protocols is empty: name some of {', '.join(TRANSFER_PROTOCOLS)}")
    if f.probe_holdout == 0 and "linear" in f.protocols:
        raise RecipeError("fewshot.probe_holdout=0 holds nothing out to choose the linear probe's λ on: "
                          "give a fraction of train in (0, 1), e.g. 0.2")
    if f.l2_reg != "auto":
        try:
            ok = float(f.l2_reg) > 0 and math.isfinite(float(f.l2_reg))
        except ValueError:
            ok = False
        if not ok:
            raise RecipeError(f"fewshot.l2_reg: expected a positive number or 'auto', got {f.l2_reg!r}")
