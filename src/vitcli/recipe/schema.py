"""Recipes: YAML -> typed dataclasses, with defaults < recipe file < `a.b=c` overrides, strictly checked.

One recipe is one experiment. Every key has a declared type; values are coerced to it (PyYAML reads `1e-3`
as a string), unknown keys are errors naming their dotted path with the closest valid key (a key vitcli
removed says why it went: REMOVED_KEYS), and the resolved recipe is what gets written to
`WORKDIR/recipe.yaml` and into every checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vitcli.errors import RecipeError


@dataclass
class ModelConfig:
    """The network. Named models (`ViT-B/16`, `T2T-ViT-14`, any timm name) fill in the sizes themselves."""

    # paper name, T2T-ViT-N (Performer token mixer) / T2T-ViT_t-N (Transformer), BiT-R50x1, R50+ViT-B/16, a
    # timm name, or "custom"
    name: str = "custom"
    img_size: int = 224  # train and eval resolution; must be a multiple of patch_size
    patch_size: int = 16
    embed_dim: int = 768  # "width" in the paper's Table 1
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    pool: str = "token"  # token (class token, the paper's default) | gap (global average pool)
    # learned_1d | learned_2d | sincos_2d | none (paper App. D.4); T2T: sincos_1d
    pos_embed: str = "learned_1d"
    representation_size: int = 0  # >0 adds Dense+tanh before the head, as in the i21k checkpoints
    dropout: float = 0.0
    drop_path: float = 0.0
    num_classes: int = 0  # 0: taken from the dataset's ClassLabel feature or data.num_classes
    head_bias_init: float = 0.0  # -10 with sigmoid loss on ImageNet-21k keeps early logits tiny
    # big_vision and vit_jax start the head kernel at zero (`head_zeroinit`), so the first logits are the bias
    # alone; false keeps timm's random kernel. Fine-tuning always zeroes the whole new head (paper, Sec. 3.2).
    head_zero_init: bool = True


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
    binary_pixels: bool = False  # images stored as 0/1 (dSprites): decoded as 0/255, as VTAB does
    batch_size: int = 512  # global batch per optimizer step, reached by accumulation if needed
    micro_batch_size: int = 0  # per-process forward/backward batch; 0 = batch_size / world size
    # repeated augmentation k, DeiT's RASampler: an epoch's images k times each, the copies in different
    # micro-batches (on different processes when each takes one micro-batch per step), each copy with its
    # own augmentation draws; an epoch stays len(split) images, so ~len / k distinct ones. 1 = off; DeiT: 3.
    # A map-style split only (not data.streaming).
    repeated_aug: int = 1
    eval_batch_size: int = 256
    num_workers: int = 2
    # read the train split as a stream (Hub, parquet/arrow/json files, a save_to_disk dir) instead of loading
    # it whole: for splits larger than the disk or the patience to download them. Val/test still load whole.
    streaming: bool = False
    shuffle_buffer: int = 10_000  # streaming: examples mixed at once (HF IterableDataset.shuffle buffer_size)
    inception_crop: bool = True  # random-resized crop over crop_min_area..100% of the image
    crop_min_area: float = 0.05
    hflip: bool = True
    # per-image augmentation, batched on uint8 where the model runs (data/augmentations.py): a timm
    # RandAugment spec, e.g. "rand-m9-mstd0.5-inc1" ("" disables); or DeiT III's 3-Augment (one of
    # grayscale, solarize, blur per image) with colour jitter of strength color_jitter
    randaugment: str = ""
    three_augment: bool = False
    color_jitter: float = 0.0
    # random erasing after normalisation, timm's RandomErasing: the probability per image (timm's reprob;
    # 0 disables), the fill (pixel | rand | const) and the boxes per erased image
    erasing: float = 0.0
    erasing_mode: str = "pixel"
    erasing_count: int = 1
    # mixup and CutMix with timm's Mixup semantics, on the device: alphas (0 disables each), the
    # probability a micro-batch is mixed at all, of CutMix when both are on, and batch | pair | elem
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    mix_switch_prob: float = 0.5
    mix_mode: str = "batch"
    eval_crop_pct: float = 1.0  # eval: resize to img_size / crop_pct, then centre crop img_size
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class OptimConfig:
    """Optimizer and loss."""

    name: str = "adamw"  # adamw (the paper's Adam, decoupled decay) | sgd (momentum, for fine-tuning)
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.03  # not applied to biases, norms, position embedding, class token
    # torch: decay each step by lr_t * weight_decay (torch AdamW; flax.optim.Adam, so the paper's Table 3).
    # big_vision: by schedule_t * weight_decay, not scaled by the peak lr (optax add_decayed_weights before
    # the schedule), so a big_vision config's `wd` ports unchanged: its 1e-4 at lr 1e-3 is torch's 0.1.
    weight_decay_convention: str = "torch"  # torch | big_vision
    # layer-wise lr decay (BEiT, MAE fine-tuning; timm's param_groups_layer_decay): of a ViT's L + 2 layers
    # (the embeddings 0, block j at j + 1 and the final norm with the last, the head L + 1), layer i trains at
    # lr_t * layer_decay^(L + 1 - i), and decays its weights in proportion. In (0, 1]; 1: off
    layer_decay: float = 1.0
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
class EmaConfig:
    """Weight EMA (timm's ModelEmaV3): an exponential moving average of the weights, updated after each
    optimizer step, evaluated beside them (`val_ema/top1`) and kept in every checkpoint."""

    # the average's decay per optimizer step; 0 turns EMA off (timm's train.py: 0.9998; DeiT: 0.99996)
    decay: float = 0.0
    min_decay: float = 0.0  # floor of the warmed-up decay (timm's min_decay)
    update_after_step: int = 0  # optimizer steps after the first that only copy the weights (timm's)
    # the decay warms up as min(decay, 1 - (1 + t / warmup_gamma) ** -warmup_power), t counting the
    # averaging steps, so the early average is not the random initial weights' (timm's use_warmup)
    warmup: bool = False
    warmup_gamma: float = 1.0
    warmup_power: float = 2 / 3  # timm's: reaches 0.999 at 31.6K steps, 0.9999 at 1M
    save: str = "live"  # which weights model.safetensors holds: live (the trained ones) | ema


@dataclass
class RunConfig:
    """Everything about running that does not change the maths."""

    seed: int = 0
    # auto | fp32 | bf16 (autocast; weights and optimizer stay fp32). auto: bf16 where the device runs it
    # natively (CUDA with bf16, a CPU with AVX-512 bf16 or AMX), fp32 where bf16 would be emulated
    precision: str = "auto"
    # torch.compile the model for training (seconds to minutes of compiling first; exports unchanged).
    # auto | true | false. auto: on where the device gains (CUDA: ~3x for a small ViT), off on a CPU (0.89x
    # measured); the run's recipe.yaml holds the choice (runtime.precision.choose_compile)
    compile: bool | str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 10  # steps between metrics.jsonl train rows
    eval_every: int = 0  # steps between held-out evaluations; 0 = only at the end
    ckpt_every: int = 500  # steps between resumable checkpoints; the last step always saves
    ckpt_every_minutes: float = 30.0  # also checkpoint when this long has passed since the last one; 0: off
    keep_checkpoints: int = 2  # resumable checkpoints kept; a damaged latest one falls back to the one before
    # ddp: every process holds the whole model, optimizer and gradients (state-<step>.pt checkpoints). fsdp:
    # FSDP2 shards them over the processes block by block (state-<step>/ directories, one file per process);
    # with one process there is nothing to shard over, so it runs unsharded but writes the same directories
    strategy: str = "ddp"
    # recompute each transformer block's activations in the backward pass instead of keeping them: about a
    # third more compute for far less activation memory; the gradients do not change
    activation_checkpointing: bool = False
    # metrics.jsonl is always written; tensorboard (WORKDIR/tensorboard) and wandb (offline without an
    # account) are optional extras: pip install 'vitcli[tensorboard]' / 'vitcli[wandb]'
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])


@dataclass
class InitConfig:
    """Starting weights for fine-tuning (the paper's transfer protocol by default)."""

    checkpoint: str = ""  # vitcli workdir / model.safetensors, timm safetensors, Google .npz, Hub name
    keep_head: bool = False  # False: drop the pretrained head, attach a zero-initialised D x K head
    keep_representation: bool = False  # the paper drops the pre-logits layer when fine-tuning
    posemb_method: str = "bilinear"  # bilinear (big_vision / vit_jax) | bicubic (timm, antialiased)
    random: bool = False  # eval-fewshot: the checkpoint's network with fresh weights (run.seed), the baseline


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
    resize: int = 256  # at 224 px (big_vision: resize to 256, centre crop 224), scaled to img_size; >= 224
    # big_vision: tf bilinear without antialias, as big_vision's few-shot pp, so numbers compare with its own;
    resize_method: str = "big_vision"
    cache_dir: str = ""  # feature cache; "" = WORKDIR/features
    custom: CustomTaskConfig = field(default_factory=CustomTaskConfig)


@dataclass
class MppConfig:
    """Masked patch prediction (paper App. B.1.2): the self-supervised objective, used with objective: mpp."""

    target: str = "mean_color"  # mean_color (the paper's choice, 512 classes) | color_4x4 | pixels_l2
    corrupt_ratio: float = 0.5  # fraction of each image's patch embeddings corrupted
    mask_prob: float = 0.8  # of the corrupted: replaced by the learned [mask] embedding
    random_prob: float = 0.1  # of the corrupted: replaced by another patch's embedding; the rest stay as is


@dataclass
class DistillConfig:
    """Knowledge distillation as DeiT does it (Touvron et al. 2021; facebookresearch/deit losses.py): a frozen
    teacher's logits on the images the student sees, a second target beside the labels (train/distill.py)."""

    # the teacher's weights: a vitcli workdir / model.safetensors, a timm safetensors, a Google .npz, or a
    # timm / Hub model name (timm downloads it); "" = no teacher
    teacher: str = ""
    # the teacher's architecture, any model.name (DeiT's regnety_160), for a file that does not say it (a
    # foreign network that is not a ViT); "" = read from the checkpoint or the timm name
    teacher_model: str = ""
    type: str = "none"  # none | hard (cross-entropy on the teacher's top class) | soft (KL at temperature)
    alpha: float = 0.5  # the distillation loss's weight; the labels' loss gets 1 - alpha (DeiT's 0.5)
    tau: float = 1.0  # soft: the temperature of both softmaxes (DeiT's 1.0)


@dataclass
class Recipe:
    """One experiment."""

    # pretrain | finetune | eval-fewshot: set by the command, checked against the file
    stage: str = "pretrain"
    objective: str = "supervised"  # supervised (labels) | mpp (masked patch prediction, pretrain only)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init: InitConfig = field(default_factory=InitConfig)
    fewshot: FewshotConfig = field(default_factory=FewshotConfig)
    mpp: MppConfig = field(default_factory=MppConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)


# ---------------------------------------------------------------- coercion


def _coerce(value: Any, typ: Any, path: str) -> Any:
    """Return `value` as `typ`, or raise a RecipeError naming the dotted path, the type and the value."""
    origin = typing.get_origin(typ)
    if origin is types.UnionType:  # `bool | str`: the first type that takes the value (true -> True, auto)
        for option in typing.get_args(typ):
            with contextlib.suppress(RecipeError):
                return _coerce(value, option, path)
        names = " or ".join(option.__name__ for option in typing.get_args(typ))
        raise RecipeError(f"{path}: expected {names}, got {value!r}")
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


# keys vitcli once took, by dotted path -> the one line a recipe or override still giving one gets (exit 2):
# why the key went and what to do instead, rather than a "did you mean" guess at a neighbouring key
REMOVED_KEYS = {
    "data.decode_device": (
        "data.decode_device was removed: decoding JPEGs on the model's device (nvJPEG) trained a third "
        "slower than the loader workers on an H100 (2026-11-25); delete the key (the workers decode, the "
        "device resizes and augments)"),
}


def merge(obj: Any, updates: dict, prefix: str = "") -> None:
    """Apply a nested dict of updates onto dataclass `obj` in place, coercing and rejecting unknown keys."""
    if not isinstance(updates, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {updates!r}")
    hints = typing.get_type_hints(type(obj))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints and path in REMOVED_KEYS:
            raise RecipeError(REMOVED_KEYS[path])
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(hints)}"
            raise RecipeError(f"unknown recipe key '{path}'{hint}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            merge(getattr(obj, key), value if value is not None else {}, f"{path}.")
        else:
            setattr(obj, key, _coerce(value, typ, path))


def nest(dotted: dict[str, Any]) -> dict:
    """`{"optim.lr": 1e-3, "data.batch_size": 64}` ->
    `{"optim": {"lr": 1e-3}, "data": {"batch_size": 64}}`."""
    nested: dict = {}
    for key, value in dotted.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"'{key}' conflicts with an earlier value of '{part}'")
        node[leaf] = value
    return nested


def parse_overrides(pairs: list[str]) -> dict:
    """Turn `["optim.lr=1e-3", "data.batch_size=64"]` into a nested dict; values parsed as YAML scalars."""
    dotted: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{pair}' is not KEY=VALUE (for example optim.lr=1e-3)")
        try:
            dotted[key] = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            dotted[key] = raw
    return nest(dotted)


class _DuplicateKey(yaml.MarkedYAMLError):
    """A mapping that gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: PyYAML would keep the last silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of `node`, once each explicit key in it is new (`<<` merges may repeat one)."""
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in first:
                raise _DuplicateKey(problem=f"'{key}' is given twice (first at line {first[key] + 1})",
                                    problem_mark=key_node.start_mark)
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict:
    """Read a recipe file as safe_load does; malformed YAML or a key given twice is a one-line error with the
    line number."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file (not UTF-8), so not a YAML recipe") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # safe: a SafeLoader subclass
    except _DuplicateKey as e:
        line = e.problem_mark.line + 1
        raise RecipeError(f"{path}: line {line}: {e.problem}; a recipe says each key once") from None
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


def to_dict(recipe: Recipe) -> dict:
    """Plain nested dict of the recipe, in declaration order."""
    return dataclasses.asdict(recipe)


def to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, the way `--dry-run` prints it and recipe.yaml stores it."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=False)


def micro_batches(recipe: Recipe, world_size: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation): each process's forward/backward batch (data.micro_batch_size, or 0 for
    data.batch_size / world_size) and how many of them it sums per optimizer step, batch_size / (micro x
    world_size). Accumulation is 0 when the micro-batch is not positive (recipe.checks refuses that, and a
    micro-batch x world size that does not divide data.batch_size)."""
    d = recipe.data
    micro = d.micro_batch_size or d.batch_size // world_size
    return micro, d.batch_size // (micro * world_size) if micro > 0 else 0
