"""Every value check of a recipe, in one place, run once at resolve time: one RecipeError naming the
key.

Types and unknown keys are layers.py's job (while merging); here are the values: choices, ranges,
and the cross-field rules (image size vs patch, width vs heads, warmup vs steps, batch vs
micro-batch x processes, which position embeddings a model family takes), the data keys
(data_checks.py), and last what the command needs to run (a length, a batch, eval-fewshot's
checkpoint and tasks). No torch: they run before it is imported. `vit --dry-run` runs them too, so
what a dry run accepts the run accepts; what needs a library (a timm model, a checkpoint, the task
registry) is vitcli.checkpoints.complete's, also before the dry run prints.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any

from vitcli.errors import RecipeError
from vitcli.recipe.choices import (
    LOGGER_PACKAGES,
    LOGGERS,
    TRAINS,
    VIT_POS_EMBEDS,
    WEIGHTED,
)
from vitcli.recipe.cluster_checks import check_slurm
from vitcli.recipe.data_checks import (
    check_data,
    check_randaugment,
    check_splits,
    check_train_batch,
    names_tar_shards,
)
from vitcli.recipe.fewshot_checks import check_fewshot
from vitcli.recipe.holdout_checks import check_holdout
from vitcli.recipe.layers import literal_keys
from vitcli.recipe.names import T2T_VITS, is_vit_family
from vitcli.recipe.objective_checks import check_distill, check_objective
from vitcli.recipe.rollback_checks import check_rollback
from vitcli.recipe.schema import Recipe, RunConfig, micro_batches

# the keys with a closed set, by dotted path -> its choices: read off schema.py's Literal
# annotations (whose sets recipe.choices holds), as a recipe's reading checks them; checked again
# here for a recipe changed in code (a checkpoint's architecture filled in, a sweep's point)
CHOICES: dict[str, tuple[str, ...]] = literal_keys(Recipe)
POSITIVE = (
    "model.img_size", "model.patch_size", "model.embed_dim", "model.depth", "model.num_heads",
    "model.mlp_dim", "model.layer_norm_eps",
    "data.batch_size", "data.eval_batch_size", "optim.lr", "run.log_every", "run.ckpt_every",
    "run.keep_checkpoints", "fewshot.seeds", "fewshot.resize", "data.shuffle_buffer", "data.erasing_count",
    "data.repeated_aug", "ema.warmup_gamma", "ema.warmup_power", "distill.tau", "fewshot.knn_k",
    "fewshot.knn_temperature", "mae.decoder_embed_dim", "mae.decoder_depth", "mae.decoder_num_heads",
    "dino.out_dim", "dino.hidden_dim", "dino.bottleneck_dim", "dino.head_layers", "dino.teacher_temp",
    "dino.warmup_teacher_temp", "dino.student_temp", "dino.sinkhorn_iterations", "dino.local_crop_size",
    "dino.koleo_group",
)
NOT_NEGATIVE = (
    "search.startup_trials", "search.prune_after", "search.prune_warmup_steps",
    "schedule.steps", "schedule.epochs", "schedule.warmup_steps", "schedule.end_lr", "run.seed",
    "run.eval_every", "run.ckpt_every_minutes", "data.num_workers", "data.cache_mb", "run.memory_budget_mb",
    "data.num_classes", "data.mixup_alpha", "data.cutmix_alpha", "data.color_jitter",
    "model.num_classes", "model.representation_size", "optim.weight_decay", "optim.clip_grad_norm",
    "fewshot.every", "fewshot.custom.num_classes", "ema.update_after_step", "dino.local_crops",
    "dino.freeze_last_layer_epochs", "dino.warmup_teacher_temp_epochs", "dino.ibot_weight",
    "dino.koleo_weight", "optim.patch_embed_lr_scale", "dino.clip_grad",
    "data.synthetic.train_size", "data.synthetic.val_size", "data.synthetic.test_size",
)
# [0, 1): a probability or a decay rate of 1 leaves nothing to learn
BELOW_ONE = ("model.dropout", "model.drop_path", "optim.label_smoothing", "optim.beta1", "optim.beta2",
             "optim.momentum", "mpp.mask_prob", "mpp.random_prob", "mae.mask_ratio", "ema.decay",
             "ema.min_decay", "fewshot.probe_holdout", "dino.center_momentum")
# (0, 1]: fractions of the image; a per-layer lr factor
UP_TO_ONE = ("data.crop_min_area", "data.eval_crop_pct", "optim.layer_decay")
# [0, 1]: probabilities, and the weight of one loss against another
PROBABILITIES = ("data.erasing", "data.mix_prob", "data.mix_switch_prob", "distill.alpha", "dino.momentum",
                 "dino.momentum_end", "dino.color_jitter_prob", "dino.grayscale_prob", "dino.solarize_prob",
                 "dino.ibot_mask_prob")
RANGES = (  # (keys, test, what the message asks for)
    (POSITIVE, lambda v: v > 0, "positive"),
    (NOT_NEGATIVE, lambda v: v >= 0, ">= 0"),
    (BELOW_ONE, lambda v: 0 <= v < 1, "in [0, 1)"),
    (UP_TO_ONE, lambda v: 0 < v <= 1, "in (0, 1]"),
    (PROBABILITIES, lambda v: 0 <= v <= 1, "in [0, 1]"),
)


def get(recipe: Recipe, path: str) -> Any:
    """The value at a dotted path (`optim.lr`)."""
    obj: Any = recipe
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def check(recipe: Recipe, world_size: int = 1, *, model: bool = True, inputs: bool = True) -> None:
    """Every check below; the first failure is a RecipeError naming the keys involved.

    `model=False` leaves out the architecture checks, for a model a checkpoint or timm is still to
    fill in (vitcli.recipe.resolve runs them once it has); `inputs=False` leaves out the check that
    the command has what it needs to run (a training length and a whole batch; the checkpoint of a
    stage that runs one, eval-fewshot's tasks, evaluate's split), for a recipe read on its own.
    """
    _choices(recipe)
    _compile(recipe.run.compile)
    _micro_batch_size(recipe.data.micro_batch_size)
    _ranges(recipe)
    _weight_decay_end(recipe.optim.weight_decay, recipe.optim.weight_decay_end)
    if model:
        check_model(recipe)
    check_schedule(recipe.schedule.warmup_steps, recipe.schedule.steps)
    _batch(recipe, world_size)
    _augment(recipe, world_size)
    check_holdout(recipe.data, recipe.stage in TRAINS)
    check_data(recipe)
    check_fewshot(recipe)
    check_objective(recipe)
    _ema(recipe)
    check_distill(recipe)
    _random_init(recipe)
    if recipe.init.grid:
        parse_grid(recipe.init.grid, "init.grid")
    check_loggers(recipe.run.loggers)
    check_tracking(recipe.run)
    check_ckpt_dir(recipe.run.ckpt_dir)
    _watchdog(recipe.run)
    check_slurm(recipe.slurm)
    check_rollback(recipe)
    if inputs:  # last, the values being right: what the command needs in order to run
        _length(recipe)
        check_train_batch(recipe)
        check_splits(recipe)
        _checkpoint_inputs(recipe)


def _watchdog(run) -> None:
    """The watchdog's bound (train.watchdog): off (run.hang_factor 0), or a factor of 2 or more over
    a positive floor; no negative start bound."""
    if run.hang_factor and run.hang_factor < 2:
        raise RecipeError(f"run.hang_factor={run.hang_factor:g}: a bound under 2x the median "
                          "step is an ordinary slow step; use 0 (no watchdog) or 2 or more "
                          "(default 10)")
    if run.hang_factor and run.hang_floor_s <= 0:
        raise RecipeError(f"run.hang_floor_s={run.hang_floor_s:g} must be positive while "
                          "run.hang_factor is on (a factor of a 10 ms step fires on a pause of the "
                          "machine); default 300")
    if run.hang_start_s < 0:
        raise RecipeError(f"run.hang_start_s must be >= 0 (0: the first steps unwatched), got "
                          f"{run.hang_start_s:g}")


def _choices(recipe: Recipe) -> None:
    for path, allowed in CHOICES.items():
        if get(recipe, path) not in allowed:
            raise RecipeError(f"{path}: {get(recipe, path)!r} is not one of {', '.join(allowed)}")


def _compile(value) -> None:
    """run.compile is a switch with a third position, auto (a bool or the string "auto" after
    coercion)."""
    if not isinstance(value, bool) and value != "auto":
        raise RecipeError(f"run.compile: '{value}' is not one of auto, true, false")


def _micro_batch_size(value) -> None:
    """data.micro_batch_size is a number of images (0: the batch per process) or auto (an int or the
    string "auto" after coercion)."""
    if value == "auto":
        return
    if not isinstance(value, int):
        raise RecipeError(f"data.micro_batch_size: '{value}' is not auto or a number of images")
    if value < 0:
        raise RecipeError(f"data.micro_batch_size must be >= 0 or auto, got {value}")


def _ranges(recipe: Recipe) -> None:
    """NaN and infinity nowhere; then each key's range."""
    for path, value in _numbers(recipe):
        if not math.isfinite(value):
            raise RecipeError(f"{path} must be a finite number, got {value}")
    for paths, ok, want in RANGES:
        for path in paths:
            if not ok(get(recipe, path)):
                raise RecipeError(f"{path} must be {want}, got {get(recipe, path)}")


def _weight_decay_end(start: float, end: float) -> None:
    """optim.weight_decay_end: -1 (constant), or a decay the cosine reaches from a decay to
    scale."""
    if end != -1 and end < 0:
        raise RecipeError(f"optim.weight_decay_end must be >= 0, or -1 to keep the decay constant; got {end}")
    if end >= 0 and not start:
        raise RecipeError(f"optim.weight_decay_end={end:g} needs optim.weight_decay > 0 to start the cosine "
                          "from (DINO: 0.04 -> 0.4)")


def _numbers(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted path, value) of every number in the recipe, lists included."""
    if dataclasses.is_dataclass(obj):
        return [pair for f in dataclasses.fields(obj)
                for pair in _numbers(getattr(obj, f.name), f"{prefix}{f.name}.")]
    if isinstance(obj, list):
        return [pair for i, v in enumerate(obj) for pair in _numbers(v, f"{prefix[:-1]}[{i}].")]
    is_number = isinstance(obj, int | float) and not isinstance(obj, bool)
    return [(prefix[:-1], float(obj))] if is_number else []


def grid_for(img_size: int | tuple[int, int], patch_size: int | tuple[int, int], name: str = "image size",
             patch_name: str = "the patch size") -> tuple[int, int]:
    """The patch grid (gh, gw) for an image size: the one place image size vs patch is checked. A
    RecipeError naming `name` (`model.img_size`, `--res`) when a side is not a positive multiple of
    the patch."""
    h, w = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    if h % ph or w % pw or h <= 0 or w <= 0:
        size, patch = (f"{h}", f"{ph}") if (h, ph) == (w, pw) else (f"{h}x{w}", f"{ph}x{pw}")
        near = f"{max(round(h / ph), 1) * ph}" + ("" if h == w else f"x{max(round(w / pw), 1) * pw}")
        raise RecipeError(f"{name}={size} is not a multiple of {patch} ({patch_name}); use a multiple "
                          f"such as {near}")
    return h // ph, w // pw


def parse_grid(text: str, name: str) -> tuple[int, int]:
    """`4x5` -> (4, 5): rows x columns of patches; a RecipeError naming `name` for anything else."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise RecipeError(f"{name}={text!r}: expected HxW, rows x columns of patches, e.g. 14x14")
    return int(parts[0]), int(parts[1])


def check_model(recipe: Recipe) -> None:
    """Image size vs patch, width vs heads, and the position embeddings each model family takes."""
    m = recipe.model
    family = "vit" if is_vit_family(m.name) else "t2t" if m.name in T2T_VITS else "timm"
    # T2T-ViT and timm's own builds keep their norms
    if family != "vit" and m.layer_norm_eps != 1e-6:
        raise RecipeError(f"model.layer_norm_eps={m.layer_norm_eps:g} is only honoured by the paper's ViTs, "
                          f"the hybrid and custom, not '{m.name}'; leave it at 1e-6")
    if family == "timm":
        if m.representation_size:
            raise RecipeError(f"model.representation_size={m.representation_size} is only supported for the "
                              f"paper's ViTs, T2T-ViT and custom, not '{m.name}'; set it to 0")
        return
    if family == "t2t" and m.pool == "gap_fc_norm":
        raise RecipeError(f"model.pool=gap_fc_norm (MAE's fine-tune pooling) is built for the paper's ViTs, "
                          f"the hybrid and custom, not '{m.name}'; use token or gap")
    # T2T's soft splits make an effective patch of 16
    patch = 16 if family == "t2t" else m.patch_size
    grid_for(m.img_size, patch, "model.img_size", f"the patch size of {m.name}")
    if m.num_heads <= 0 or m.embed_dim % m.num_heads:
        raise RecipeError(f"model.embed_dim={m.embed_dim} is not divisible by model.num_heads={m.num_heads}")
    if family == "vit":
        _vit_pos_embed(m.pos_embed, m.embed_dim)


def _vit_pos_embed(kind: str, width: int) -> None:
    if kind not in VIT_POS_EMBEDS:
        raise RecipeError(f"model.pos_embed: '{kind}' is not one of {', '.join(VIT_POS_EMBEDS)} for a ViT")
    if kind == "sincos_2d" and (width % 4 or width < 8):
        raise RecipeError("model.pos_embed=sincos_2d needs model.embed_dim a multiple of 4 and >= 8, "
                          f"got {width}")
    if kind == "learned_2d" and width % 2:
        raise RecipeError(f"model.pos_embed=learned_2d needs an even model.embed_dim, got {width}")


def check_schedule(warmup_steps: int, steps: int, derived: bool = False) -> None:
    """Warmup must end before training does; `derived`: steps came from schedule.epochs and the data
    size."""
    if steps and warmup_steps >= steps:
        total = f"the {steps} total steps" if derived else f"schedule.steps={steps}"
        raise RecipeError(f"schedule.warmup_steps={warmup_steps} must be smaller than {total}")


def _batch(recipe: Recipe, world_size: int) -> None:
    """The global batch splits into equal micro-batches on every process; the advice names values
    that do (tests/unit/test_recipe.py follows it)."""
    d = recipe.data
    share, rest = divmod(d.batch_size, world_size)  # each process's images per step
    if rest or not share:
        near = sorted({m for m in (share * world_size, (share + 1) * world_size) if m > 0})
        raise RecipeError(f"data.batch_size={d.batch_size} does not split over {world_size} processes: use "
                          f"a multiple of {world_size} ({' or '.join(map(str, near))})")
    # it will be a divisor of the share (run.micro_batch.candidates)
    if d.micro_batch_size == "auto":
        return
    micro, _ = micro_batches(recipe, world_size)
    if micro <= 0 or share % micro:
        fits = max(m for m in range(1, min(max(micro, 1), share) + 1) if share % m == 0)
        raise RecipeError(
            f"data.batch_size={d.batch_size} is not divisible by data.micro_batch_size={micro} x "
            f"world size {world_size}; set data.micro_batch_size to a divisor of {share} (the batch per "
            f"process), such as {fits}"
        )


def _augment(recipe: Recipe, world_size: int) -> None:
    """The augmentation keys combine: one per-image policy, jitter only inside 3-Augment, and the
    mixing on an even micro-batch of labelled images."""
    d = recipe.data
    if d.randaugment:
        check_randaugment(d.randaugment, "data.randaugment")
    # DeiT III's 3-Augment replaces RandAugment, it does not add
    if d.randaugment and d.three_augment:
        raise RecipeError(f"data.randaugment='{d.randaugment}' and data.three_augment are two per-image "
                          "policies (DeiT's and DeiT III's); keep one")
    if d.color_jitter and not d.three_augment:
        raise RecipeError(f"data.color_jitter={d.color_jitter} is 3-Augment's colour jitter; set "
                          "data.three_augment: true, or data.color_jitter: 0")
    mixing = [f"data.{k}={v}" for k, v in (("mixup_alpha", d.mixup_alpha), ("cutmix_alpha", d.cutmix_alpha))
              if v]
    if not mixing:
        return
    if recipe.objective != "supervised":
        raise RecipeError(f"{mixing[0]} mixes labels, but objective: {recipe.objective} has none (it "
                          "predicts the input's own patches); set it to 0")
    # auto tries even micro-batches only: the batch per process needs one
    if d.micro_batch_size == "auto":
        if (d.batch_size // world_size) % 2:
            raise RecipeError(f"{mixing[0]} needs an even micro-batch, but data.micro_batch_size=auto has "
                              f"none to try: the batch per process, {d.batch_size // world_size}, is odd; "
                              "make data.batch_size / world size even")
        return
    micro, _ = micro_batches(recipe, world_size)
    if micro % 2:  # Mixup and CutMix pair each image with its mirror in the micro-batch, as timm's
        raise RecipeError(f"{mixing[0]} needs an even micro-batch, got {micro}; "
                          "set data.micro_batch_size (or data.batch_size) to an even number")


def _ema(recipe: Recipe) -> None:
    """EMA weights exist only with a decay, and the warm-up's floor sits below the decay it warms up
    to."""
    e = recipe.ema
    if e.save == "ema" and not e.decay:
        raise RecipeError("ema.save=ema, but ema.decay=0 keeps no EMA weights; set ema.decay (timm: 0.9998) "
                          "or ema.save=live")
    if e.decay and e.min_decay > e.decay:
        raise RecipeError(f"ema.min_decay={e.min_decay} is above ema.decay={e.decay}: the floor of the "
                          "warmed-up decay must not exceed the decay itself")


def _random_init(recipe: Recipe) -> None:
    if recipe.init.random and recipe.stage != "eval-fewshot":
        raise RecipeError("init.random applies to eval-fewshot only (its random-initialisation baseline); "
                          f"`vit {recipe.stage}` without a checkpoint already trains "
                          "from random initialisation")


def _length(recipe: Recipe) -> None:
    """A training stage needs a length, and a stream cannot count epochs."""
    s = recipe.schedule
    if recipe.stage not in TRAINS:
        return
    if not s.steps and not s.epochs:
        raise RecipeError("set schedule.steps or schedule.epochs (both are 0)")
    if recipe.data.streaming and not s.steps:
        tar = " (a tar-shard source streams)" if names_tar_shards(recipe.data.source) else ""
        raise RecipeError(f"data.streaming=true{tar} needs schedule.steps: a stream has no length to count "
                          f"schedule.epochs={s.epochs} in")


def _checkpoint_inputs(recipe: Recipe) -> None:
    """eval-fewshot scores a checkpoint's features on tasks, evaluate its head on a split, predict
    on images, inspect and export read its network: each needs the checkpoint named, and
    eval-fewshot its tasks and evaluate its split."""
    if recipe.stage not in WEIGHTED:
        return
    if not recipe.init.checkpoint:
        raise RecipeError(f"{recipe.stage} needs weights: pass --ckpt (a workdir, .safetensors, .npz or Hub "
                          "name)")
    if recipe.stage == "evaluate" and not (recipe.data.test_split or recipe.data.val_split):
        raise RecipeError("evaluate: no split to evaluate (data.test_split and data.val_split are empty); "
                          "pass --split")
    if recipe.stage != "eval-fewshot":
        return
    if not recipe.fewshot.tasks:
        raise RecipeError("no tasks: pass --tasks (e.g. --tasks vtab/natural) or set fewshot.tasks")


def check_loggers(names: list[str]) -> None:
    """A RecipeError naming run.loggers for an unknown logger or one whose package is not
    installed."""
    for name in names:
        if name not in LOGGERS:
            raise RecipeError(f"run.loggers: '{name}' is not one of {', '.join(LOGGERS)}")
        package = LOGGER_PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise RecipeError(f"run.loggers: {name} needs the {package} package: "
                              f"pip install 'vitcli[{package}]'")


def check_tracking(run: RunConfig) -> None:
    """run.mlflow_uri: a URI MLflow can open (scheme://..., or a path); run.experiment: a name trackio
    takes. (A URI set while run.loggers does not name mlflow is allowed: --preflight and a search's
    trials turn the trackers off and keep the rest of the recipe.)"""
    uri = run.mlflow_uri
    refuse_unprintable("run.mlflow_uri", uri)
    refuse_unprintable("run.experiment", run.experiment)
    scheme = uri.partition("://")[0] if "://" in uri else ""
    # RFC 3986: a letter, then letters, digits, +, - or . (databricks-uc://, postgresql+psycopg2://)
    if scheme and not (scheme[0].isalpha() and all(c.isalnum() or c in "+-." for c in scheme)):
        raise RecipeError(f"run.mlflow_uri: '{uri}' is not a URI (http://host:5000, "
                          f"sqlite:///mlflow.db, file:///path, or a path)")
    if "/" in run.experiment and "trackio" in run.loggers:
        raise RecipeError(f"run.experiment: '{run.experiment}' names trackio's project, which "
                          f"cannot hold '/'")


def refuse_unprintable(key: str, value: str) -> None:
    """A name or URI handed to another tool (a store, a tracking server): no newline or other control
    character, no surrounding spaces."""
    if not value.isprintable() or value != value.strip():
        raise RecipeError(f"{key}: {value!r} has a control character or surrounding spaces")


def check_ckpt_dir(uri: str) -> None:
    """run.ckpt_dir: a path, or a URI whose protocol fsspec knows and whose library is installed
    (s3fs for s3://); whether the store answers is asked at the run's start (checkpoints.remote)."""
    if not uri:
        return
    from fsspec.core import split_protocol  # here: fsspec's import is for runs that name a URI
    from fsspec.registry import known_implementations, registry

    refuse_unprintable("run.ckpt_dir", uri)
    protocol, rest = split_protocol(uri)
    if protocol is None:
        return
    known = known_implementations.get(protocol)
    if (known is None and protocol not in registry) or not rest.strip("/"):
        raise RecipeError(f"run.ckpt_dir: {uri!r} is not a path nor a URI fsspec can open "
                          "(s3://bucket/prefix, gs://bucket/prefix, file:///path)")
    if protocol not in registry and importlib.util.find_spec(known["class"].split(".")[0]) is None:
        missing = known.get("err", "its fsspec library is not installed")
        raise RecipeError(f"run.ckpt_dir: {uri}: {missing}")


def check_sweep(recipe: Recipe) -> None:
    """A learning-rate sweep picks on the dev split, so there must be one."""
    if not recipe.data.val_split:
        raise RecipeError("--lr-sweep needs a dev split to choose on: set data.val_split (e.g. train[98%:])")


def parse_lrs(text: str) -> list[float]:
    """`--lr-sweep 0.001,0.003` -> [0.001, 0.003], with a one-line error for anything else."""
    try:
        lrs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RecipeError(f"--lr-sweep: expected comma-separated numbers, got {text!r}") from None
    if not lrs or any(not lr > 0 or not math.isfinite(lr) for lr in lrs):
        raise RecipeError(f"--lr-sweep: expected positive learning rates, got {text!r}")
    return lrs
