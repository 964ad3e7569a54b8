"""Recipes: YAML -> typed dataclasses, with defaults < recipe file < `a.b=c` overrides, strictly checked.

One recipe is one experiment. Every key has a declared type; values are coerced to it (PyYAML reads `1e-3`
as a string), unknown keys are errors naming their dotted path with the closest valid key, and the resolved
recipe is what gets written to `WORKDIR/recipe.yaml` and into every checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vitcli.errors import RecipeError


@dataclass
class ModelConfig:
    """The network. Named models (`ViT-B/16`, `T2T-ViT-14`, any timm name) fill in the sizes themselves."""

    name: str = "custom"  # paper name, T2T-ViT-N, BiT-R50x1, R50+ViT-B/16, a timm name, or "custom"
    img_size: int = 224  # train and eval resolution; must be a multiple of patch_size
    patch_size: int = 16
    embed_dim: int = 768  # "width" in the paper's Table 1
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    pool: str = "token"  # token (class token, the paper's default) | gap (global average pool)
    pos_embed: str = "learned_1d"  # learned_1d | learned_2d | sincos_2d | none (paper App. D.4); T2T: sincos_1d
    representation_size: int = 0  # >0 adds Dense+tanh before the head, as in the i21k checkpoints
    dropout: float = 0.0
    drop_path: float = 0.0
    num_classes: int = 0  # 0: taken from the dataset's ClassLabel feature or data.num_classes
    head_bias_init: float = 0.0  # -10 with sigmoid loss on ImageNet-21k keeps early logits tiny


@dataclass
class SyntheticConfig:
    """Sizes of the built-in procedural dataset (used when data.source is `synthetic`)."""

    num_classes: int = 10
    train_size: int = 5000
    val_size: int = 500
    test_size: int = 1000
    img_size: int = 32  # native resolution the images are drawn at; transforms resize to model.img_size
    seed: int = 0


@dataclass
class DataConfig:
    """Where images come from and how they are batched and augmented."""

    source: str = "synthetic"  # synthetic | Hub id | save_to_disk dir | parquet/arrow file(s) | image folder
    image_column: str = "image"
    label_column: str = "label"
    train_split: str = "train"  # HF split syntax, slicing allowed: train[:98%]
    val_split: str = "validation"  # held-out split for periodic eval; "" disables it
    test_split: str = "test"  # "" disables the final test evaluation
    num_classes: int = 0  # 0: from the ClassLabel feature
    label_rule: str = ""  # derive the label from raw columns (VTAB: clevr_count, kitti_closest_vehicle, ...)
    batch_size: int = 512  # global batch per optimizer step, reached by accumulation if needed
    micro_batch_size: int = 0  # per-process forward/backward batch; 0 = batch_size / world size
    eval_batch_size: int = 256
    num_workers: int = 2
    inception_crop: bool = True  # random-resized crop over crop_min_area..100% of the image
    crop_min_area: float = 0.05
    hflip: bool = True
    randaugment: str = ""  # timm spec, e.g. "rand-m9-mstd0.5"; "" disables
    mixup_alpha: float = 0.0  # 0 disables mixup
    eval_crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then centre crop img_size
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class OptimConfig:
    """Optimizer and loss."""

    name: str = "adamw"  # adamw (the paper's Adam, decoupled decay) | sgd (momentum, for fine-tuning)
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.03  # not applied to biases, norms, position embedding, class token
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float = 0.9  # sgd only
    clip_grad_norm: float = 1.0  # global-norm clip; 0 disables
    label_smoothing: float = 0.0
    loss: str = "softmax"  # softmax | sigmoid (per-class binary cross-entropy, as for ImageNet-21k)


@dataclass
class ScheduleConfig:
    """How long to train and how the learning rate moves."""

    steps: int = 0  # optimizer steps; 0: derived from epochs and the train split size
    epochs: float = 0.0
    warmup_steps: int = 10_000
    decay: str = "linear"  # linear | cosine | constant
    end_lr: float = 0.0  # learning rate at the last step


@dataclass
class RunConfig:
    """Everything about running that does not change the maths."""

    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 (autocast; weights and optimizer stay fp32)
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 10  # steps between metrics.jsonl train rows
    eval_every: int = 0  # steps between held-out evaluations; 0 = only at the end
    ckpt_every: int = 500  # steps between resumable checkpoints; the last step always saves


@dataclass
class InitConfig:
    """Starting weights for fine-tuning (the paper's transfer protocol by default)."""

    checkpoint: str = ""  # vitcli workdir / model.safetensors, timm safetensors, Google .npz, Hub name
    keep_head: bool = False  # False: drop the pretrained head, attach a zero-initialised D x K head
    keep_representation: bool = False  # the paper drops the pre-logits layer when fine-tuning
    posemb_method: str = "bilinear"  # bilinear (big_vision / vit_jax) | bicubic (timm, antialiased)


@dataclass
class CustomTaskConfig:
    """A few-shot task of your own, named in fewshot.tasks by `name`."""

    name: str = ""  # "" = no custom task
    source: str = ""  # anything data.source accepts
    train_split: str = "train"
    test_split: str = "test"
    image_column: str = "image"
    label_column: str = "label"
    num_classes: int = 0  # 0: from the ClassLabel feature


@dataclass
class FewshotConfig:
    """Linear few-shot evaluation by closed-form least squares (big_vision `fewshot_lsr`)."""

    tasks: list[str] = field(default_factory=list)
    shots: list[int] = field(default_factory=lambda: [1, 5, 10, 25])
    seeds: int = 3
    l2_reg: str = "1024"  # a number, or "auto" for leave-one-out choice on the shot set
    every: int = 0  # steps between few-shot runs inside training; 0 disables
    data_root: str = ""  # one directory per task, read by the data layer, instead of the Hub
    resize: int = 256  # big_vision: resize to resize x resize, centre crop img_size
    cache_dir: str = ""  # feature cache; "" = WORKDIR/features
    custom: CustomTaskConfig = field(default_factory=CustomTaskConfig)


@dataclass
class Recipe:
    """One experiment."""

    stage: str = "pretrain"  # pretrain | finetune
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init: InitConfig = field(default_factory=InitConfig)
    fewshot: FewshotConfig = field(default_factory=FewshotConfig)


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
}

CHOICES: dict[str, tuple[str, ...]] = {
    "stage": ("pretrain", "finetune"),
    "model.pool": ("token", "gap"),
    "model.pos_embed": ("learned_1d", "learned_2d", "sincos_2d", "none", "sincos_1d"),  # sincos_1d: T2T-ViT
    "optim.name": ("adamw", "sgd"),
    "optim.loss": ("softmax", "sigmoid"),
    "schedule.decay": ("linear", "cosine", "constant"),
    "run.precision": ("fp32", "bf16"),
    "run.device": ("auto", "cpu", "cuda"),
    "init.posemb_method": ("bilinear", "bicubic"),
}


# ---------------------------------------------------------------- coercion


def _coerce(value: Any, typ: Any, path: str) -> Any:
    """Return `value` as `typ`, or raise a RecipeError naming the dotted path, the type and the value."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item_type,) = typing.get_args(typ)
        if isinstance(value, str):  # `shots=1,5,10` on the command line
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):  # `--shots 5`
            value = [value]
        if not isinstance(value, list):
            raise RecipeError(f"{path}: expected a list of {item_type.__name__}, got {value!r}")
        return [_coerce(v, item_type, f"{path}[{i}]") for i, v in enumerate(value)]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            as_float = float(value)
            if as_float.is_integer() and not isinstance(value, bool):  # 1e4 -> 10000
                return int(as_float)
        except (TypeError, ValueError):
            pass
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `l2_reg: 1024` or a numeric split name
    raise RecipeError(f"{path}: expected {typ.__name__}, got {value!r}")


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    """Apply a nested dict of updates onto dataclass `obj` in place, coercing and rejecting unknown keys."""
    if not isinstance(updates, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {updates!r}")
    hints = typing.get_type_hints(type(obj))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(hints)}"
            raise RecipeError(f"unknown recipe key '{path}'{hint}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            _merge(getattr(obj, key), value if value is not None else {}, f"{path}.")
        else:
            setattr(obj, key, _coerce(value, typ, path))


def parse_overrides(pairs: list[str]) -> dict:
    """Turn `["optim.lr=1e-3", "data.batch_size=64"]` into a nested dict; values parsed as YAML scalars."""
    nested: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{pair}' is not KEY=VALUE (for example optim.lr=1e-3)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"override '{pair}' conflicts with an earlier override of '{part}'")
        node[leaf] = value
    return nested


def read_yaml(path: str | Path) -> dict:
    """Read a recipe file with safe_load; malformed YAML is a one-line error with the line number."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise RecipeError(f"{path}: malformed YAML at {where}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: malformed YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def build_recipe(layers: list[dict], stage: str | None = None) -> Recipe:
    """Defaults < each layer in order (recipe file, then overrides); then fill named models and check."""
    recipe = Recipe()
    if stage:
        if stage not in STAGE_DEFAULTS:
            raise RecipeError(f"stage: '{stage}' is not one of {', '.join(STAGE_DEFAULTS)}")
        recipe.stage = stage
        _merge(recipe, STAGE_DEFAULTS[stage])
    for layer in layers:
        _merge(recipe, layer)
    check(recipe)
    return recipe


def load_recipe(
    path: str | Path | None, overrides: list[str] = (), stage: str | None = None, base: list[dict] = ()
) -> Recipe:
    """The resolved recipe for a stage: defaults < `base` layers < file at `path` < dotted `overrides`."""
    layers = list(base) + ([read_yaml(path)] if path else [])
    layers.append(parse_overrides(list(overrides)))
    return build_recipe(layers, stage)


def recipe_from_dict(data: dict) -> Recipe:
    """Rebuild a recipe saved by `to_dict` (from recipe.yaml or checkpoint metadata)."""
    return build_recipe([data])


def to_dict(recipe: Recipe) -> dict:
    """Plain nested dict of the recipe, in declaration order."""
    return dataclasses.asdict(recipe)


def to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, the way `--dry-run` prints it and recipe.yaml stores it."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------- checks


def _get(recipe: Recipe, path: str) -> Any:
    obj: Any = recipe
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(recipe: Recipe, world_size: int = 1) -> None:
    """Cross-field checks that need no data or model; raise RecipeError naming the keys involved."""
    for path, allowed in CHOICES.items():
        value = _get(recipe, path)
        if value not in allowed:
            raise RecipeError(f"{path}: '{value}' is not one of {', '.join(allowed)}")
    m, d, s = recipe.model, recipe.data, recipe.schedule
    for path in ("model.img_size", "model.patch_size", "data.batch_size", "data.eval_batch_size"):
        if _get(recipe, path) <= 0:
            raise RecipeError(f"{path} must be positive, got {_get(recipe, path)}")
    # A fine-tune's architecture (patch size included) comes from its checkpoint, which is read later;
    # models.resolve_model checks divisibility again once the real patch size is known.
    adopts = recipe.stage == "finetune" and bool(recipe.init.checkpoint)
    if m.name == "custom" and not adopts and m.img_size % m.patch_size:
        raise RecipeError(
            f"model.img_size={m.img_size} is not divisible by model.patch_size={m.patch_size}; "
            f"use a multiple such as {m.img_size // m.patch_size * m.patch_size or m.patch_size}"
        )
    if m.name == "custom" and m.embed_dim % m.num_heads:
        raise RecipeError(f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}")
    if s.steps < 0 or s.epochs < 0 or s.warmup_steps < 0:
        raise RecipeError("schedule.steps, schedule.epochs and schedule.warmup_steps must not be negative")
    if s.steps and s.warmup_steps >= s.steps:
        raise RecipeError(
            f"schedule.warmup_steps={s.warmup_steps} must be smaller than schedule.steps={s.steps}"
        )
    micro = d.micro_batch_size or d.batch_size // world_size
    if micro <= 0 or d.batch_size % (micro * world_size):
        raise RecipeError(
            f"data.batch_size={d.batch_size} is not divisible by data.micro_batch_size={micro} x "
            f"world size {world_size}; pick a micro-batch that divides {d.batch_size // world_size or 1}"
        )
    if not 0 < d.crop_min_area <= 1:
        raise RecipeError(f"data.crop_min_area must be in (0, 1], got {d.crop_min_area}")
    if not 0 < d.eval_crop_pct <= 1:
        raise RecipeError(f"data.eval_crop_pct must be in (0, 1], got {d.eval_crop_pct}")
    if recipe.fewshot.l2_reg != "auto":
        try:
            float(recipe.fewshot.l2_reg)
        except ValueError:
            raise RecipeError(f"fewshot.l2_reg: expected a number or 'auto', got {recipe.fewshot.l2_reg!r}")


def accumulation_steps(recipe: Recipe, world_size: int = 1) -> int:
    """Micro-batches per optimizer step on each process: batch_size / (micro_batch_size x world_size)."""
    d = recipe.data
    micro = d.micro_batch_size or d.batch_size // world_size
    return d.batch_size // (micro * world_size)
