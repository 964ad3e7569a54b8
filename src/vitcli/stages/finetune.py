"""`vit finetune`: one run, a sweep (`--sweep`), a learning-rate sweep picked on the dev split, or
the VTAB-1k protocol."""

from __future__ import annotations

from pathlib import Path

from vitcli.errors import RecipeError
from vitcli.recipe.checks import check_sweep, parse_lrs
from vitcli.recipe.grid import Grid
from vitcli.recipe.schema import Recipe
from vitcli.recipe.space import Search
from vitcli.run.build import run_training
from vitcli.runtime.dist import setup
from vitcli.runtime.metrics import console
from vitcli.stages.search import search_study
from vitcli.stages.sweep import lr_sweep, sweep_grid
from vitcli.stages.vtab import run_vtab, vtab_tasks


def check_flags(lr_sweep: str | None, task: str | None, recipe: Recipe,
                swept: bool = False) -> tuple[list[float] | None, list | None]:
    """(learning rates, VTAB tasks) the flags name for this recipe, or a one-line error; None where
    a flag is not given. `swept`: --sweep is given, which runs one recipe's points, and so neither
    of the two."""
    if swept and (lr_sweep or task):
        raise RecipeError("--sweep with --lr-sweep: pass one (--sweep optim.lr=... is the sweep --lr-sweep "
                          "chooses on dev from)" if lr_sweep else
                          "--sweep with --task: the VTAB protocol runs its own recipe per task; sweep one "
                          "task's recipe with data.source, or its learning rate with --lr-sweep")
    lrs = parse_lrs(lr_sweep) if lr_sweep else None
    if lrs:
        check_sweep(recipe)
    return lrs, vtab_tasks(task) if task else None


def finetune(recipe: Recipe, workdir: Path, *, resume: bool | None = None, overwrite: bool = False,
             lrs: list[float] | None = None, chosen: list | None = None, sweep: Grid | None = None,
             search: Search | None = None) -> dict:
    """Join the process group once and run what the flags (as check_flags read them) ask for: the
    VTAB tasks `chosen`, a sweep over `lrs`, the points of `sweep`, the trials of `search`, or one
    run. Returns what its results file (vtab.json, sweep.json or summary.json) holds."""
    dist = setup(recipe.run.device)
    if not recipe.init.checkpoint and dist.is_main:
        console.log("no --init: fine-tuning from random initialisation (a baseline, not transfer)")
    if chosen:
        return run_vtab(recipe, workdir, chosen, dist, resume, lrs, overwrite)
    if lrs:
        return lr_sweep(recipe, workdir, lrs, dist, resume, overwrite)
    if sweep:
        return sweep_grid(sweep, workdir, dist, resume, overwrite)
    if search:
        return search_study(search, workdir, dist, resume)
    return run_training(recipe, workdir, dist, resume, overwrite)
