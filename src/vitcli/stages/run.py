"""`vit pretrain`: join the process group, then one training run, built and trained by run.build
(which every stage that trains shares: fine-tuning is the same run with starting weights,
checkpoints.transfer; the sweep and VTAB drivers call it once per setting with the Dist their
command created)."""

from __future__ import annotations

from pathlib import Path

from vitcli.recipe.schema import Recipe
from vitcli.run.build import run_training
from vitcli.runtime.dist import setup


def one_run(recipe: Recipe, workdir: Path, resume: bool | None = None,
            overwrite: bool = False) -> dict:
    """`vit pretrain`: join the process group, then one training run; returns what summary.json
    holds."""
    return run_training(recipe, workdir, setup(recipe.run.device), resume, overwrite)
