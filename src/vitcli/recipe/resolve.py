"""One step from the command line to the recipe that runs: (stage, recipe file, overrides, flags) ->
Recipe.

Layers, later wins: defaults < the stage's defaults < what the starting checkpoint says of itself
(`base`: the pixels its weights expect; evaluate and predict: its resolution too) < the VTAB
protocol (`--task`) < the recipe file < `KEY=VALUE` overrides < command flags (`--res`, `--init`,
`--shots`, ...). Then the model is filled in: a known name's sizes, and every key and value is
checked (vitcli.recipe.checks), all without torch, so a misspelt key costs no import of torch. Only
then, and only for a timm model name, a starting checkpoint (`finetune`, `eval-fewshot`, `evaluate`,
`predict`, `inspect`, `export`: its architecture; eval-fewshot, inspect and export its native
resolution and pre-logits, evaluate and predict its head), run.device=cuda or few-shot task names,
the caller's `complete` step runs (it needs torch, timm or datasets) and everything is checked
again. Nothing downstream edits the result: `--dry-run` prints it and the run writes exactly it to
WORKDIR/recipe.yaml.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

from vitcli.errors import RecipeError
from vitcli.recipe.checks import check
from vitcli.recipe.choices import SECTIONS, STAGES, TRAINS
from vitcli.recipe.data_checks import names_tar_shards
from vitcli.recipe.layers import merge, nest, parse_overrides, read_yaml
from vitcli.recipe.names import NAMED, refuse_resized, resolve_known
from vitcli.recipe.schema import Recipe

# (recipe, whether the user set model.num_heads) -> the recipe with what needs torch filled in and
# checked: vitcli.checkpoints.complete.complete. This package imports no torch, so the caller hands
# it in.
Complete = Callable[[Recipe, bool], Recipe]
# the recipe resolved without it -> the layer its starting checkpoint gives:
# vitcli.checkpoints.complete. trained_with, handed in for the same reason
Base = Callable[[Recipe], dict]

# The paper's transfer protocol (Sec. 4.1, App. B.1.1) is the finetune stage's default, below the
# recipe file: SGD momentum 0.9, global batch 512, global-norm clip 1, no weight decay, dropout 0,
# cosine decay after a short linear warmup, 384 px. A finetune recipe then only says what differs
# (dataset, steps, lr).
STAGE_DEFAULTS: dict[str, dict] = {
    "pretrain": {},
    "finetune": {
        "model": {"img_size": 384, "dropout": 0.0, "drop_path": 0.0},
        "data": {"batch_size": 512, "randaugment": "", "mixup_alpha": 0.0},
        "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "clip_grad_norm": 1.0},
        "schedule": {"warmup_steps": 500, "decay": "cosine"},
    },
    "eval-fewshot": {},
    "evaluate": {},
    "predict": {},
    "inspect": {},
    "export": {},
    "prepare-data": {},
}
# VTAB-1k (Zhai et al. 2019; ViT paper App. B.1.1): 2,500 steps at lr 0.01, batch 512, 384 px, per
# task.
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
    complete: Complete | None = None,
    inputs: bool = True,
    base: Base | None = None,
) -> Recipe:
    """The complete, checked recipe a command runs. `flags` maps dotted keys to values (None: not
    given).

    `base(recipe)` gives a nested layer just above the stage's defaults from the recipe resolved
    without it: what its starting checkpoint says about itself (the pixels its weights expect; for
    `vit evaluate` and `vit predict` also the resolution it was trained at), so that the recipe
    file, overrides and flags still win. Reading it needs torch, so it is called only once the other
    layers have passed the torch-free checks (a misspelt key is still reported at once).

    `complete` is required when the recipe needs torch to be complete (`needs_torch`);
    `inputs=False` skips the check that the command's inputs are named (vitcli.recipe.checks.check).
    """
    layer = {}
    if base is not None:
        first = _layered(stage, recipe_file, overrides, flags, vtab, {})[0]
        check(first, world_size, model=False, inputs=False)
        layer = base(first)
    recipe, user = _layered(stage, recipe_file, overrides, flags, vtab, layer)
    late = needs_torch(recipe)
    # a model to fill in: checked once it is
    check(recipe, world_size, model=not late, inputs=inputs)
    if not late:
        return recipe
    if complete is None:
        raise TypeError("resolve: this recipe needs torch to complete; pass complete= "
                        "(vitcli.checkpoints.complete.complete)")
    given = recipe.model
    recipe = complete(recipe, _says_num_heads(user))
    if recipe.stage == "pretrain" or not recipe.init.checkpoint:  # a timm name's sizes, timm's
        refuse_resized(given, recipe.model, user)
    check(recipe, world_size, inputs=inputs)
    return recipe


def _layered(stage: str, recipe_file, overrides: list[str], flags: dict | None,
             vtab: bool, base: dict) -> tuple[Recipe, list[dict]]:
    """The layers merged in order, a known model name's sizes filled in; and the user's layers (file,
    overrides, flags: what they set, for the checks that need to know)."""
    if stage not in STAGES:
        raise RecipeError(f"stage: '{stage}' is not one of {', '.join(STAGES)}")
    file_layer = _file_layer(stage, recipe_file)
    _check_sections(stage, overrides)
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    user = [VTAB_PROTOCOL if vtab else {}, file_layer, parse_overrides(list(overrides)), nest(given)]
    recipe = Recipe(stage=stage)
    for layer in [STAGE_DEFAULTS[stage], base, *user]:
        merge(recipe, layer)
    _stream_tar_shards(recipe, user)
    known = resolve_known(recipe.model)
    refuse_resized(recipe.model, known, user)
    return dataclasses.replace(recipe, model=known), user


def _stream_tar_shards(recipe: Recipe, layers: list[dict]) -> None:
    """A training stage on WebDataset tar shards streams its train split (data.streaming=true, so
    the saved recipe says so) unless the user set data.streaming, whose false data_checks refuses.
    Why not load it whole: HF's webdataset builder would first copy every image into its arrow
    cache, ImageNet's 140 GB a second time, before the first step."""
    said = any(isinstance(layer.get("data"), dict) and "streaming" in layer["data"] for layer in layers)
    if recipe.stage in TRAINS and not said and names_tar_shards(recipe.data.source):
        recipe.data.streaming = True


def needs_torch(recipe: Recipe) -> bool:
    """True when completing the recipe needs torch (or timm, datasets): a timm model name (timm
    describes it), a starting checkpoint to describe, run.device=cuda (only torch knows whether this
    machine has one), few-shot task names (their registry, vitcli.data.rows.tasks, imports
    datasets), or a teacher to find."""
    from_checkpoint = recipe.stage != "pretrain" and bool(recipe.init.checkpoint)
    heavy = from_checkpoint or recipe.run.device == "cuda" or bool(recipe.fewshot.tasks)
    heavy = heavy or bool(recipe.distill.teacher)
    return recipe.model.name not in NAMED or heavy


def derive(recipe: Recipe, changes: dict, world_size: int = 1) -> Recipe:
    """A resolved recipe with nested `changes` merged on a copy and checked again
    (a sweep's lr, a VTAB task)."""
    derived = copy.deepcopy(recipe)
    merge(derived, changes)
    check(derived, world_size)
    return derived


def _file_layer(stage: str, path) -> dict:
    """The recipe file's layer. The command decides the stage: a file that says another one is a
    mistake, not a hint; but a stage that reads only some sections (SECTIONS) takes them from a
    recipe of any stage, its other sections checked for known keys and types only."""
    layer = read_yaml(path) if path else {}
    said = layer.get("stage")
    if stage in SECTIONS:
        merge(Recipe(), layer)  # every key known and of its type, whatever it belongs to
        if said is not None and said not in STAGES:
            raise RecipeError(f"{path}: stage: '{said}' is not one of {', '.join(STAGES)}")
        return {k: v for k, v in layer.items() if k in SECTIONS[stage]}
    if said is not None and said != stage:
        raise RecipeError(f"{path} says stage: {said}, but this is `vit {stage}`; run `vit {said}` with it, "
                          f"or remove its stage: line")
    return layer


def _check_sections(stage: str, overrides: list[str]) -> None:
    """A stage that reads only some sections takes overrides of those alone."""
    sections = SECTIONS.get(stage)
    foreign = [o for o in overrides if sections and o.partition(".")[0] not in sections]
    if foreign:
        keys = " or ".join(f"{s}.*" for s in sections)
        raise RecipeError(f"{foreign[0]}: `vit {stage}` reads only the {keys} keys of a recipe, "
                          f"so it takes only {keys} overrides")


def _says_num_heads(layers: list[dict]) -> bool:
    """True when the user set model.num_heads themselves (evidence for a checkpoint that has
    none)."""
    return any(isinstance(layer.get("model"), dict) and "num_heads" in layer["model"] for layer in layers)
