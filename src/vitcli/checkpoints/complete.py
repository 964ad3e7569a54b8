"""The step of recipe resolution that needs torch (vitcli.recipe.resolve hands it the recipe it has
checked).

A timm model name is described as timm registers it; for every stage but `pretrain` the starting
checkpoint's architecture fills the model (and, to evaluate, inspect or export it, its native
resolution or head);
run.device=cuda is checked against this machine, and few-shot task names against the task registry.
"""

from __future__ import annotations

import dataclasses

import torch

from vitcli.checkpoints import preprocessing
from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.fit import with_grid
from vitcli.checkpoints.read import Loaded, locate_checkpoint, read_checkpoint
from vitcli.data.rows import tasks
from vitcli.errors import CheckpointError, ModelError, RecipeError
from vitcli.models.zoo import resolve_name
from vitcli.recipe.choices import AS_TRAINED, CLASS_TOKEN_POOLS, CLASSIFIES
from vitcli.recipe.schema import ModelConfig, Recipe

# what `vit evaluate` and `vit predict` take from our own checkpoint's recipe: how its eval images
# were prepared (beside the preprocessing module's keys) and its loss; and, unless --data names other
# data, where its test images are. Not its precision: that was most often `auto`'s choice on the
# training machine, no request for inference (runtime.precision.choose_for reads it, `trained_precision`)
TRAINED_EVAL = {"data": ("binary_pixels",), "optim": ("loss", "label_smoothing")}
TRAINED_DATA = ("source", "image_column", "label_column", "label_rule", "num_classes", "train_split",
                # holdout + train_split: its split
                "val_split", "test_split", "holdout", "synthetic")


def complete(recipe: Recipe, user_heads: bool) -> Recipe:
    """`recipe` with its model filled in from timm or its starting checkpoint; `user_heads`: the
    user set model.num_heads (evidence for a foreign checkpoint that does not say)."""
    if recipe.run.device == "cuda" and not torch.cuda.is_available():
        raise RecipeError("run.device=cuda but this machine has no CUDA device; use run.device=auto or cpu")
    _check_task_names(recipe)
    _check_teacher(recipe)
    return dataclasses.replace(recipe, model=_model(recipe, user_heads))


def _check_teacher(recipe: Recipe) -> None:
    """A teacher named by a local path is there before anything runs (--dry-run says so too); its
    weights are read when the run builds it (train.distill.load_teacher), a Hub or timm name then
    downloaded."""
    if recipe.distill.teacher:
        try:
            locate_checkpoint(recipe.distill.teacher)
        except CheckpointError as e:
            raise CheckpointError(f"distill.teacher: {e}") from None


def trained_with(recipe: Recipe, own_data: bool = True) -> dict:
    """The recipe layer the starting checkpoint gives (vitcli.recipe.resolve's `base`), from the
    recipe resolved without it (its stage, init.checkpoint and model.name): the pixels its weights
    expect (preprocessing.FEED; export and, with the eval crop, evaluate and predict:
    preprocessing.KEYS). evaluate and predict also take its native resolution, and from our own
    files the eval settings and loss it was trained with, plus with `own_data` its data
    (source, columns, splits). {} for a stage that starts from no checkpoint."""
    if recipe.stage in ("pretrain", "prepare-data") or not recipe.init.checkpoint or recipe.init.random:
        return {}
    loaded = read_checkpoint(recipe.init.checkpoint)
    said = preprocessing.said_by(loaded, recipe.model.name)
    whole = recipe.stage in (*CLASSIFIES, "export")
    layer = preprocessing.layer(said, preprocessing.KEYS if whole else preprocessing.FEED)
    if recipe.stage not in CLASSIFIES:
        return layer
    img_size = describe(loaded).img_size
    if img_size:
        layer["model"] = {"img_size": img_size}
    trained = loaded.meta.get("recipe") if loaded.kind == "vitcli" else None
    if not isinstance(trained, dict):
        return layer
    keys = {**TRAINED_EVAL, "data": TRAINED_EVAL["data"] + TRAINED_DATA * own_data}
    for section, names in keys.items():
        stored = trained.get(section) or {}
        layer.setdefault(section, {}).update({k: stored[k] for k in names if k in stored})
    return layer


def trained_precision(src: str) -> str | None:
    """The precision our own checkpoint `src`'s run computed in (its resolved run.precision); None
    for a foreign file, which does not say. Read once per process (read_checkpoint's cache)."""
    loaded = read_checkpoint(src)
    trained = loaded.meta.get("recipe") if loaded.kind == "vitcli" else None
    run = trained.get("run") if isinstance(trained, dict) else None
    return run.get("precision") if isinstance(run, dict) else None


def _check_task_names(recipe: Recipe) -> None:
    """Every name in fewshot.tasks is a registry name, a group, `synthetic` or
    fewshot.custom.name."""
    own = {"synthetic", recipe.fewshot.custom.name} - {""}
    # only their names matter here
    stand_ins = {name: tasks.synthetic_task(name=name) for name in own}
    for spec in recipe.fewshot.tasks:
        tasks.get_tasks(spec, stand_ins)


def _model(recipe: Recipe, user_heads: bool) -> ModelConfig:
    """recipe.model with its name's sizes, and for a stage that starts from a checkpoint, that
    network."""
    model = resolve_name(recipe.model)
    if recipe.stage == "pretrain" or not recipe.init.checkpoint:
        return model
    loaded = read_checkpoint(recipe.init.checkpoint)
    if recipe.stage == "inspect":
        _check_attention(loaded, recipe.init.checkpoint)
    # the recipe names a foreign file's network
    named = loaded.kind != "vitcli" and model.name != "custom"
    # ours: metadata wins, as for sizes
    foreign_heads = user_heads and loaded.kind != "vitcli" and not named
    spec = describe(loaded, num_heads=model.num_heads if foreign_heads else 0)
    if not recipe.init.random:  # its table is loaded: its grid must be known now, for --dry-run too
        spec = with_grid(spec, loaded.state_dict, recipe.init.grid)
    if not named:
        model = resolve_name(dataclasses.replace(model, **spec.architecture()))
    if recipe.stage in CLASSIFIES:  # the checkpoint as it is: its head and representation layer
        if not spec.num_classes:
            left = f" (left out: {'; '.join(loaded.dropped)})" if loaded.dropped else ""  # MAE's
            raise CheckpointError(f"{recipe.init.checkpoint} has no classification head (a masked patch "
                                  f"prediction, MAE or headless checkpoint){left}; `vit {recipe.stage}` "
                                  "needs one: fine-tune it first")
        return dataclasses.replace(model, num_classes=spec.num_classes,
                                   representation_size=spec.representation_size)
    if recipe.stage in AS_TRAINED:  # pre-logits are read: the representation stays, the head goes
        return dataclasses.replace(model, img_size=spec.img_size or model.img_size, num_classes=0,
                                   representation_size=spec.representation_size)
    # the paper drops the pre-logits layer for transfer
    keep = recipe.init.keep_representation
    return dataclasses.replace(model, representation_size=spec.representation_size if keep else 0,
                               pool=_transfer_pool(recipe, model.pool))


def _transfer_pool(recipe: Recipe, had: str) -> str:
    """The fine-tune's pooling: the checkpoint's, unless the recipe asks for gap_fc_norm over a
    class-token network (MAE fine-tunes its token-pooled encoder so: the final norm gives way to an
    fc_norm after the mean of the patch tokens, checkpoints.fit); the pooling is the head's choice,
    the weights are the same."""
    if recipe.model.pool != "gap_fc_norm" or had == "gap_fc_norm":
        return had
    if had not in CLASS_TOKEN_POOLS:
        raise CheckpointError(f"model.pool=gap_fc_norm keeps a class token in the sequence, but "
                              f"{recipe.init.checkpoint} has none (pool {had}); use model.pool={had}")
    return "gap_fc_norm"


def _check_attention(loaded: Loaded, ckpt: str) -> None:
    """`vit inspect` measures attention: a one-line error for checkpoints without transformer blocks
    (BiT, other CNNs)."""
    if not any(k.startswith("blocks.") and ".attn." in k for k in loaded.state_dict):
        named = loaded.meta.get("model", {}).get("name", "") if loaded.kind == "vitcli" else ""
        what = f"a {named}" if named else "no ViT"
        raise ModelError(f"{ckpt} holds {what} (no blocks.N.attn tensors): vit inspect reads ViT, "
                         "hybrid and T2T-ViT checkpoints")
