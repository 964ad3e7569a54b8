"""One step from the command line to the recipe that runs: (stage, recipe file, overrides, flags) -> Recipe.

Layers, later wins: defaults < the stage's defaults < the VTAB protocol (`--task`) < the recipe file <
`KEY=VALUE` overrides < command flags (`--res`, `--init`, `--shots`, ...). Then the model is filled in:
a model name's sizes, and for `finetune` / `eval-fewshot` the starting checkpoint's architecture (and, to
evaluate it, its native resolution and head). Then every value is checked once (vitcli.recipe.checks). Nothing
downstream edits the result: `--dry-run` prints it and the run writes exactly it to WORKDIR/recipe.yaml.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.read import read_checkpoint
from vitcli.errors import RecipeError
from vitcli.models.zoo import resolve_name
from vitcli.recipe.checks import STAGES, check
from vitcli.recipe.schema import ModelConfig, Recipe, merge, nest, parse_overrides, read_yaml

# The paper's transfer protocol (Sec. 4.1, App. B.1.1) is the finetune stage's default, below the recipe file:
# SGD momentum 0.9, global batch 512, global-norm clip 1, no weight decay, dropout 0, cosine decay after a
# short linear warmup, 384 px. A finetune recipe then only says what differs (dataset, steps, lr).
STAGE_DEFAULTS: dict[str, dict] = {
    "pretrain": {},
    "finetune": {
        "model": {"img_size": 384, "dropout": 0.0, "drop_path": 0.0},
        "data": {"batch_size": 512, "randaugment": "", "mixup_alpha": 0.0},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "clip_grad_norm": 1.0},
        "schedule": {"warmup_steps": 500, "decay": "cosine"},
    },
    "eval-fewshot": {},
}
# VTAB-1k (Zhai et al. 2019; ViT paper App. B.1.1): 2,500 steps at lr 0.01, batch 512, 384 px, per task.
VTAB_PROTOCOL = {"schedule": {"steps": 2500, "warmup_steps": 200}, "optim": {"lr": 0.01},
                 "data": {"batch_size": 512}, "model": {"img_size": 384}}


def resolve(
    stage: str,
    recipe_file: str | Path | None = None,
    overrides: list[str] = (),
    flags: dict | None = None,
    *,
    vtab: bool = False,
    world_size: int = 1,
) -> Recipe:
    """The complete, checked recipe a command runs. `flags` maps dotted keys to values (None: not given)."""
    if stage not in STAGES:
        raise RecipeError(f"stage: '{stage}' is not one of {', '.join(STAGES)}")
    file_layer = read_yaml(recipe_file) if recipe_file else {}
    _check_stage(stage, file_layer, recipe_file)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    user = [VTAB_PROTOCOL if vtab else {}, file_layer, parse_overrides(list(overrides)), nest(given)]
    recipe = Recipe(stage=stage)
    for layer in [STAGE_DEFAULTS[stage], *user]:
        merge(recipe, layer)
    recipe = dataclasses.replace(recipe, model=_model(recipe, _says_num_heads(user)))
    check(recipe, world_size)
    return recipe


def derive(recipe: Recipe, changes: dict, world_size: int = 1) -> Recipe:
    """A resolved recipe with nested `changes` merged on a copy and checked again (a sweep's lr, a VTAB task)."""
    derived = copy.deepcopy(recipe)
    merge(derived, changes)
    check(derived, world_size)
    return derived


def _check_stage(stage: str, file_layer: dict, path) -> None:
    """The command decides the stage; a recipe file that says another one is a mistake, not a hint."""
    said = file_layer.get("stage")
    if said is not None and said != stage:
        raise RecipeError(f"{path} says stage: {said}, but this is `vit {stage}`; run `vit {said}` with it, "
                          f"or remove its stage: line")


def _says_num_heads(layers: list[dict]) -> bool:
    """True when the user set model.num_heads themselves (evidence for a checkpoint that has none)."""
    return any(isinstance(layer.get("model"), dict) and "num_heads" in layer["model"] for layer in layers)


def _model(recipe: Recipe, user_heads: bool) -> ModelConfig:
    """recipe.model with its name's sizes, and for a stage that starts from a checkpoint, that network."""
    model = resolve_name(recipe.model)
    if recipe.stage == "pretrain" or not recipe.init.checkpoint:
        return model
    loaded = read_checkpoint(recipe.init.checkpoint)
    named = loaded.kind != "vitcli" and model.name != "custom"  # the recipe names a foreign file's network
    foreign_heads = user_heads and loaded.kind != "vitcli" and not named  # ours: metadata wins, as for sizes
    spec = describe(loaded, num_heads=model.num_heads if foreign_heads else 0)
    if not named:
        model = resolve_name(dataclasses.replace(model, **spec.architecture()))
    if recipe.stage == "eval-fewshot":  # few-shot reads pre-logits: the representation stays, the head goes
        return dataclasses.replace(model, img_size=spec.img_size or model.img_size, num_classes=0,
                                   representation_size=spec.representation_size)
    # the paper drops the pre-logits layer for transfer
    keep = recipe.init.keep_representation
    return dataclasses.replace(model, representation_size=spec.representation_size if keep else 0)
