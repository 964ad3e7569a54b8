"""The step of recipe resolution that needs torch (vitcli.recipe.resolve hands it the recipe it has checked).

A timm model name is described as timm registers it; for `finetune` and `eval-fewshot` the starting
checkpoint's architecture fills the model (and, to evaluate it, its native resolution and head);
run.device=cuda is checked against this machine, and few-shot task names against the task registry.
"""

from __future__ import annotations

import dataclasses

import torch

from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.read import read_checkpoint
from vitcli.data import tasks
from vitcli.errors import RecipeError
from vitcli.models.zoo import resolve_name
from vitcli.recipe.schema import ModelConfig, Recipe


def complete(recipe: Recipe, user_heads: bool) -> Recipe:
    """`recipe` with its model filled in from timm or its starting checkpoint; `user_heads`: the user set
    model.num_heads (evidence for a foreign checkpoint that does not say)."""
    if recipe.run.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("run.device=cuda but this machine has no CUDA device; use run.device=auto or cpu")
    _check_task_names(recipe)
    return dataclasses.replace(recipe, model=_model(recipe, user_heads))


def _check_task_names(recipe: Recipe) -> None:
    """Every name in fewshot.tasks is a registry name, a group, `synthetic` or fewshot.custom.name."""
    own = {"synthetic", recipe.fewshot.custom.name} - {""}
    stand_ins = {name: tasks.synthetic_task(name=name) for name in own}  # only their names matter here
    for spec in recipe.fewshot.tasks:
        tasks.get_tasks(spec, stand_ins)


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
