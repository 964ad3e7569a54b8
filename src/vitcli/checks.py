"""Every value check of a recipe, in one place, run once at resolve time: one RecipeError naming the key.

Types and unknown keys are recipe.py's job (while merging); here are the values: choices, ranges, and the
cross-field rules (image size vs patch, width vs heads, warmup vs steps, batch vs micro-batch x processes,
which position embeddings a model family takes). `vit --dry-run` runs them too, so a recipe that dry-runs
also starts.
"""

from __future__ import annotations

import math
from typing import Any

from vitcli.errors import RecipeError
from vitcli.models import T2T_VITS, is_vit_family
from vitcli.posemb import METHODS, grid_for
from vitcli.recipe import Recipe

STAGES = ("pretrain", "finetune", "eval-fewshot")
VIT_POS_EMBEDS = ("learned_1d", "learned_2d", "sincos_2d", "none")
CHOICES: dict[str, tuple[str, ...]] = {
    "stage": STAGES,
    "model.pool": ("token", "gap"),
    "model.pos_embed": (*VIT_POS_EMBEDS, "sincos_1d"),  # sincos_1d: T2T-ViT's own fixed table
    "optim.name": ("adamw", "sgd"),
    "optim.loss": ("softmax", "sigmoid"),
    "schedule.decay": ("linear", "cosine", "constant"),
    "run.precision": ("fp32", "bf16"),
    "run.device": ("auto", "cpu", "cuda"),
    "init.posemb_method": METHODS,
}
POSITIVE = ("model.img_size", "model.patch_size", "data.batch_size", "data.eval_batch_size")
NOT_NEGATIVE = ("schedule.steps", "schedule.epochs", "schedule.warmup_steps")


def get(recipe: Recipe, path: str) -> Any:
    """The value at a dotted path (`optim.lr`)."""
    obj: Any = recipe
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(recipe: Recipe, world_size: int = 1) -> None:
    """Every check below; the first failure is a RecipeError naming the keys involved."""
    _choices(recipe)
    _ranges(recipe)
    check_model(recipe)
    check_schedule(recipe.schedule.warmup_steps, recipe.schedule.steps)
    _batch(recipe, world_size)
    _fewshot(recipe)


def _choices(recipe: Recipe) -> None:
    for path, allowed in CHOICES.items():
        if get(recipe, path) not in allowed:
            raise RecipeError(f"{path}: '{get(recipe, path)}' is not one of {', '.join(allowed)}")


def _ranges(recipe: Recipe) -> None:
    for path in POSITIVE:
        if get(recipe, path) <= 0:
            raise RecipeError(f"{path} must be positive, got {get(recipe, path)}")
    for path in NOT_NEGATIVE:
        if get(recipe, path) < 0:
            raise RecipeError(f"{path} must not be negative, got {get(recipe, path)}")
    d = recipe.data
    if not 0 < d.crop_min_area <= 1:
        raise RecipeError(f"data.crop_min_area must be in (0, 1], got {d.crop_min_area}")
    if not 0 < d.eval_crop_pct <= 1:
        raise RecipeError(f"data.eval_crop_pct must be in (0, 1], got {d.eval_crop_pct}")


def check_model(recipe: Recipe) -> None:
    """Image size vs patch, width vs heads, and the position embeddings each model family takes."""
    m = recipe.model
    family = "vit" if is_vit_family(m.name) else "t2t" if m.name in T2T_VITS else "timm"
    if family == "timm":
        if m.representation_size:
            raise RecipeError(f"model.representation_size={m.representation_size} is only supported for the "
                              f"paper's ViTs, T2T-ViT and custom, not '{m.name}'; set it to 0")
        return
    patch = 16 if family == "t2t" else m.patch_size  # T2T's soft splits make an effective patch of 16
    grid_for(m.img_size, patch, "model.img_size", f"the patch size of {m.name}")
    if m.num_heads <= 0 or m.embed_dim % m.num_heads:
        raise RecipeError(f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}")
    if family == "vit":
        _vit_pos_embed(m.pos_embed, m.embed_dim)


def _vit_pos_embed(kind: str, width: int) -> None:
    if kind not in VIT_POS_EMBEDS:
        raise RecipeError(f"model.pos_embed: '{kind}' is not one of {', '.join(VIT_POS_EMBEDS)} for a ViT")
    if kind == "sincos_2d" and (width % 4 or width < 8):
        raise RecipeError(f"model.pos_embed=sincos_2d needs model.embed_dim a multiple of 4 and >= 8, got {width}")
    if kind == "learned_2d" and width % 2:
        raise RecipeError(f"model.pos_embed=learned_2d needs an even model.embed_dim, got {width}")


def check_schedule(warmup_steps: int, steps: int, derived: bool = False) -> None:
    """Warmup must end before training does; `derived`: steps came from schedule.epochs and the data size."""
    if steps and warmup_steps >= steps:
        total = f"the {steps} total steps" if derived else f"schedule.steps={steps}"
        raise RecipeError(f"schedule.warmup_steps={warmup_steps} must be smaller than {total}")


def _batch(recipe: Recipe, world_size: int) -> None:
    d = recipe.data
    micro = d.micro_batch_size or d.batch_size // world_size
    if micro <= 0 or d.batch_size % (micro * world_size):
        raise RecipeError(
            f"data.batch_size={d.batch_size} is not divisible by data.micro_batch_size={micro} x "
            f"world size {world_size}; pick a micro-batch that divides {d.batch_size // world_size or 1}"
        )


def _fewshot(recipe: Recipe) -> None:
    f = recipe.fewshot
    if f.l2_reg != "auto":
        try:
            ok = float(f.l2_reg) > 0 and math.isfinite(float(f.l2_reg))
        except ValueError:
            ok = False
        if not ok:
            raise RecipeError(f"fewshot.l2_reg: expected a positive number or 'auto', got {f.l2_reg!r}")


def parse_lrs(text: str) -> list[float]:
    """`--lr-sweep 0.001,0.003` -> [0.001, 0.003], with a one-line error for anything else."""
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RecipeError(f"--lr-sweep: expected comma-separated numbers, got {text!r}") from None
    if not lrs or any(not lr > 0 or not math.isfinite(lr) for lr in lrs):
        raise RecipeError(f"--lr-sweep: expected positive learning rates, got {text!r}")
    return lrs
