"""A checkpoint fitted to a model: the paper's transfer protocol applied to a state dict.

Drop the head (the model keeps its zero-initialised one), drop the pre_logits layer unless asked,
and resize the position embedding to the model's grid. What the checkpoint's table is (kind, grid,
prefix rows) comes from its `CheckpointSpec`, never re-guessed here. The result loads with
strict=True or the error names the first keys that do not fit.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from vitcli.checkpoints.describe import CheckpointSpec
from vitcli.errors import CheckpointError
from vitcli.models import zoo
from vitcli.models.posemb import resample_axis, resample_posemb, sincos_2d
from vitcli.recipe.checks import parse_grid

HEAD = "head."
REPRESENTATION = "pre_logits."  # the i21k Dense+tanh before the head, `pre_logits.fc.*`
# learned_2d: which grid axis each table spans
AXIS_TABLES = {"pos_embed_row": 0, "pos_embed_col": 1}
# functions of the grid, rebuilt by the model at its own size
FIXED_TABLES = ("sincos_2d", "sincos_1d")
TABLES = {"learned_1d": ("pos_embed",), "sincos_2d": ("pos_embed",), "learned_2d": tuple(AXIS_TABLES)}


def adapt_state_dict(
    sd: dict[str, torch.Tensor],
    model: nn.Module,
    spec: CheckpointSpec,
    *,
    keep_head: bool,
    keep_representation: bool,
    method: str,
) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """A state dict that loads strict=True into `model`, plus (what, detail) report rows; `sd` is
    not changed.

    `spec` (from `describe`) says what the checkpoint's position table is: kind, grid and prefix
    rows.
    """
    target = model.state_dict()
    sd = dict(sd)
    # the first is the head; a DeiT distilled model's second, head_dist
    prefixes = head_prefixes(model)
    rows = [row for i, prefix in enumerate(prefixes)
            for row in _fit_head(sd, target, keep_head, prefix, prefix[:-1] if i else "head")]
    rows += _fit_representation(sd, keep_representation)
    rows += _fit_final_norm(sd, target)
    _check_fit(sd, target, resizable=("pos_embed", *AXIS_TABLES))
    rows += _fit_posemb(sd, target, model, spec, method)
    _check_fit(sd, target)
    own = sum(1 for k, v in sd.items() if v is target.get(k))
    rows.insert(0, ("loaded", f"{len(sd) - own} of {len(target)} tensors from the checkpoint"))
    return sd, rows


def head_prefix(model: nn.Module) -> str:
    """State-dict prefix of the model's classifier: `head.` for ViTs, `fc.` for timm ResNets,
    `head.fc.` BiT; a DeiT distilled model's class-token head."""
    return head_prefixes(model)[0]


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """State-dict prefixes of every classifier the model has: one, or a DeiT distilled model's two
    (`head.`, `head_dist.`), each fitted alike."""
    heads = zoo.classifiers(model) if hasattr(model, "get_classifier") else ()
    names = {id(module): f"{name}." for name, module in model.named_modules() if name}
    return tuple(names[id(h)] for h in heads if id(h) in names) or (HEAD,)


def _fit_head(sd: dict, target: dict, keep: bool, prefix: str, label: str) -> list[tuple[str, str]]:
    weight = f"{prefix}weight"  # (K, D)
    ckpt_k = sd[weight].shape[0] if weight in sd else 0
    model_k = target[weight].shape[0] if weight in target else 0
    if keep:
        if ckpt_k != model_k:
            raise CheckpointError(
                f"init.keep_head=true but the dataset has {model_k} classes and the checkpoint head has "
                f"{ckpt_k}; set init.keep_head=false to start from a zero head"
            )
        return [(label, f"kept ({ckpt_k} classes)")]
    for k in [k for k in sd if k.startswith(prefix)]:
        del sd[k]
    new = {k: v for k, v in target.items() if k.startswith(prefix)}
    sd.update(new)  # the model's own head: transfer.load_init zeroed it (zoo.zero_head)
    dropped = f"the checkpoint's {ckpt_k}-class head dropped" if ckpt_k else "the checkpoint has no head"
    if not model_k:
        return [(label, f"none ({dropped})")]
    zero = "zero-initialised " if all(not v.any() for v in new.values()) else ""
    return [(label, f"a new {zero}head for {model_k} classes ({dropped})")]


def _fit_representation(sd: dict, keep: bool) -> list[tuple[str, str]]:
    keys = [k for k in sd if k.startswith(REPRESENTATION)]
    if keep and not keys:
        raise CheckpointError(
            "init.keep_representation=true but the checkpoint has no pre_logits layer; set it to false"
        )
    if not keys:
        return []
    width = next(tuple(sd[k].shape) for k in keys if sd[k].ndim == 2)  # (R, D)
    if keep:
        return [("representation", f"kept pre_logits {width[1]} -> {width[0]}")]
    for k in keys:
        del sd[k]
    return [("representation", f"dropped pre_logits {width[1]} -> {width[0]}")]


def _fit_final_norm(sd: dict, target: dict) -> list[tuple[str, str]]:
    """A token-pooled encoder fine-tuned with pool gap_fc_norm, as MAE's main_finetune.py does: the
    model has no final norm, so the checkpoint's is dropped, and the fc_norm after the pooling
    starts fresh (weight 1, bias 0; MAE asserts it is missing, and timm's `.mae` weights under
    global_pool='avg' load the same)."""
    moves = "fc_norm.weight" in target and "norm.weight" not in target
    if not moves or "fc_norm.weight" in sd or "norm.weight" not in sd:
        return []
    for k in [k for k in sd if k.startswith("norm.")]:
        del sd[k]
    sd.update({k: v for k, v in target.items() if k.startswith("fc_norm.")})
    said = "the checkpoint's dropped; a new fc_norm (weight 1, bias 0) after the pooling (pool gap_fc_norm)"
    return [("final norm", said)]


def _fit_posemb(sd: dict, target: dict, model: nn.Module, spec: CheckpointSpec, method: str) -> list:
    """Position tables at the model's grid; report rows for what was resized or rebuilt."""
    if spec.pos_embed in FIXED_TABLES:
        sd.pop("pos_embed", None)
        if "pos_embed" in target:
            sd["pos_embed"] = target["pos_embed"]
        return [("position embedding", f"{spec.pos_embed} for grid {_grid_str(model.patch_embed.grid_size)}")]
    if spec.pos_embed == "learned_2d":
        return _fit_axis_tables(sd, tuple(model.patch_embed.grid_size), method)
    if spec.pos_embed == "learned_1d" and "pos_embed" in sd and "pos_embed" in target:
        return _fit_table(sd, target, tuple(model.patch_embed.grid_size), spec, method)
    return []  # none: BiT and other models without a position table


def with_grid(spec: CheckpointSpec, sd: dict, given: str, key: str = "init.grid") -> CheckpointSpec:
    """`spec` with the patch grid of its learned 1-D position table known: `given` (HxW, from
    `key`), which also says whether the table has rows for the class and register tokens, else the
    file's own. One line naming the file, the tensor and the grids its rows would fit when neither
    tells; `given` may not contradict a grid the file states (our metadata, a transformers
    config.json)."""
    learned = spec.pos_embed == "learned_1d" and "pos_embed" in sd
    if given and not learned:
        raise CheckpointError(f"{key}={given}: {spec.path} has no learned 1-D position table "
                              f"({spec.pos_embed}), so there is no grid to tell; drop {key}")
    if not learned or (spec.grid and not given):
        return spec
    if spec.grid_from and parse_grid(given, key) != spec.grid:
        raise CheckpointError(f"{key}={given} contradicts {spec.path}, whose {spec.grid_from} "
                              f"gives the grid {_grid_str(spec.grid)}; leave {key} unset to take "
                              "the checkpoint's own")
    table = tuple(sd["pos_embed"].shape)  # (1, P+N, D)
    n = table[1] - spec.num_prefix_tokens
    # reg (1, R, D)
    tokens = ("cls_token" in sd) + (sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    if not given:
        raise CheckpointError(f"{spec.path}: pos_embed {table} holds {n} grid positions"
                              f"{_after(spec.num_prefix_tokens)}, not a square, so the grid it was trained "
                              f"at is unknown; set {key}=HxW, rows x columns of patches ({_grids(n)})")
    gh, gw = parse_grid(given, key)
    if gh * gw not in (table[1], table[1] - tokens):
        raise CheckpointError(f"{key}={given} is {gh * gw} positions, but {spec.path}: pos_embed {table} "
                              f"holds {table[1] - tokens}{_after(tokens)}; e.g. {key}="
                              f"{_grids(table[1] - tokens)}")
    # 0: timm's no_embed_class, a table of the patches alone
    prefix = 0 if gh * gw == table[1] else tokens
    img_size = gh * spec.patch_size if gh == gw else spec.img_size
    return dataclasses.replace(spec, grid=(gh, gw), num_prefix_tokens=prefix, img_size=img_size)


def _after(prefix: int) -> str:
    """` after its class-token row`: the table's rows that are no grid position."""
    if prefix < 2:
        return " after its class-token row" if prefix else ""
    return f" after its {prefix} class- and register-token rows"


def _grids(n: int, most: int = 4) -> str:
    """The grids of `n` positions, the squarest first: `4x5 or 5x4 or 2x10 or 10x2`."""
    grids = sorted(((h, n // h) for h in range(1, n + 1) if n % h == 0), key=lambda g: abs(g[0] - g[1]))
    return " or ".join(f"{h}x{w}" for h, w in grids[:most])


def _fit_table(sd: dict, target: dict, new_grid: tuple[int, int], spec: CheckpointSpec, method: str) -> list:
    """learned_1d: pos_embed (1, P+N, D) resampled from the checkpoint's grid to the model's."""
    old = sd["pos_embed"]
    if old.shape == target["pos_embed"].shape and spec.grid in (None, new_grid):
        return []
    [(_, before, after)] = move_posemb(sd, "learned_1d", spec.grid, new_grid, spec.num_prefix_tokens, method)
    # resample_posemb took a missing old grid as square, and raised if it was not
    was = spec.grid or (math.isqrt(old.shape[1] - spec.num_prefix_tokens),) * 2
    grids = f"grid {_grid_str(was)} -> {_grid_str(new_grid)}"
    return [("position embedding", f"{before} -> {after}, {grids} ({method})")]


def _fit_axis_tables(sd: dict, new_grid: tuple[int, int], method: str) -> list[tuple[str, str]]:
    """learned_2d: report rows for the axis tables whose length changed."""
    moved = move_posemb(sd, "learned_2d", None, new_grid, 0, method)
    return [(key, f"{before} -> {after} ({method})") for key, before, after in moved if before != after]


def move_posemb(sd: dict, kind: str, old_grid: tuple[int, int] | None, new_grid: tuple[int, int], prefix: int,
                method: str) -> list[tuple[str, tuple, tuple]]:
    """A checkpoint's position tables onto `new_grid`, in `sd` (entries replaced, tensors never
    changed): learned_1d `pos_embed` (1, P+N, D) resampled over the grid (`old_grid` None: square),
    learned_2d's row (1, H, D/2) and column (1, W, D/2) tables each along its own axis, sincos_2d
    recomputed at the new grid with its P prefix rows kept. (key, shape before, shape after) for
    each table of the kind."""
    keys = TABLES.get(kind, ())
    before = {k: tuple(sd[k].shape) for k in keys}
    if kind == "learned_1d":
        sd["pos_embed"] = resample_posemb(sd["pos_embed"], old_grid, new_grid, prefix, method)
    # a function of the grid: rebuilt, not resampled
    elif kind == "sincos_2d" and old_grid != new_grid:
        pe = sd["pos_embed"]  # (1, P+N, D)
        sd["pos_embed"] = torch.cat([pe[:, :prefix], sincos_2d(new_grid, pe.shape[-1]).to(pe.dtype)], dim=1)
    elif kind == "learned_2d":
        for key, axis in AXIS_TABLES.items():
            sd[key] = resample_axis(sd[key], new_grid[axis], method)
    return [(k, before[k], tuple(sd[k].shape)) for k in keys]


def _grid_str(grid: tuple[int, int]) -> str:
    return f"{grid[0]}x{grid[1]}"


def _check_fit(sd: dict, target: dict, resizable: tuple[str, ...] = ()) -> None:
    """Raise one line naming the first mismatching, missing and unexpected keys with their
    shapes."""
    shapes = [
        f"{k} {tuple(sd[k].shape)} in checkpoint vs {tuple(v.shape)} in model"
        for k, v in target.items()
        if k in sd and k not in resizable and sd[k].shape != v.shape
    ]
    missing = [k for k in target if k not in sd]
    unexpected = [k for k in sd if k not in target]
    parts = [
        f"{what}: {', '.join(keys[:3])}{f' (+{len(keys) - 3} more)' if len(keys) > 3 else ''}"
        for what, keys in (("shapes", shapes), ("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if parts:
        raise CheckpointError(f"checkpoint does not fit the model ({'; '.join(parts)})")
