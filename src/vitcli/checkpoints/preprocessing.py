"""The pixels a checkpoint's weights expect, as the recipe's data keys (mean, std, interpolation,
eval_crop_pct, eval_crop_mode), and where the checkpoint says so.

Resolution puts them just above the defaults (the `base` layer of vitcli.recipe.resolve), so a
recipe file or a KEY=VALUE override still wins; the run's recipe.yaml records what was chosen, and
the load table says where it came from (`row`). By the checkpoint's kind:

- ours: the recipe it was trained with (a file from before these keys was fed [-1, 1], bilinear);
- a Hub name, or a folder timm or transformers wrote: what it states (read.Loaded.pretrained_cfg);
- a bare timm .safetensors: the pretrained_cfg timm registers for the recipe's model.name, if a timm
name;
- Google's .npz: [-1, 1], bilinear: vit_jax and big_vision feed x / 127.5 - 1 (the crop stays the
recipe's);
- MAE's .pth: ImageNet mean and std, bicubic, a 0.875 eval crop, as MAE's main_finetune.py feeds
them
  (timm's create_transform, then resize to 256 and centre-crop 224 to evaluate).
"""

from __future__ import annotations

from dataclasses import dataclass

import timm
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from vitcli.checkpoints.read import Loaded
from vitcli.recipe.choices import EVAL_CROP_MODES, INTERPOLATIONS
from vitcli.recipe.names import NAMED
from vitcli.recipe.schema import DataConfig

KEYS = ("mean", "std", "interpolation", "eval_crop_pct", "eval_crop_mode")
# what fine-tuning, few-shot features and inspect take: the input the weights know; the eval crop is
# a protocol's choice (the paper's transfer evaluates uncropped), only evaluate, predict and export
# take it
FEED = ("mean", "std", "interpolation")
SIGNED = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "interpolation": "bilinear"}
MAE = {"mean": list(IMAGENET_DEFAULT_MEAN), "std": list(IMAGENET_DEFAULT_STD), "interpolation": "bicubic",
       "eval_crop_pct": 0.875}


@dataclass(frozen=True)
class Said:
    """What a checkpoint says of its input, as data keys -> values, and where it says it ("" when
    nowhere)."""

    values: dict
    source: str


def said_by(loaded: Loaded, model_name: str) -> Said:
    """The preprocessing `loaded` states; `model_name` (the recipe's model.name) names timm's
    registered pretrained_cfg for a bare timm file."""
    if loaded.kind == "vitcli":
        data = (loaded.meta.get("recipe") or {}).get("data") or {}
        return Said({**SIGNED, "eval_crop_pct": 1.0, "eval_crop_mode": "center",
                     **{k: data[k] for k in KEYS if k in data}},
                    "the checkpoint's recipe")
    if loaded.kind == "npz":
        return Said(dict(SIGNED), "Google .npz: [-1, 1]")
    if loaded.kind == "mae":
        return Said(dict(MAE), "MAE's .pth: ImageNet mean and std, bicubic, as its main_finetune.py")
    cfg = loaded.pretrained_cfg or _registered(model_name)
    # timm also knows `random` and lanczos, which the recipe does not
    resize = cfg.get("interpolation")
    values = {"mean": cfg.get("mean"), "std": cfg.get("std"), "eval_crop_pct": cfg.get("crop_pct"),
              "interpolation": resize if resize in INTERPOLATIONS else None,
              "eval_crop_mode": cfg.get("crop_mode") if cfg.get("crop_mode") in EVAL_CROP_MODES else None}
    values = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in values.items() if v is not None}
    # said, but not run: the load table names it beside the recipe's value it is fed instead
    unrun = [f"{key} {cfg[key]}" for key, runs in (("interpolation", INTERPOLATIONS),
                                                   ("crop_mode", EVAL_CROP_MODES))
             if cfg.get(key) is not None and cfg[key] not in runs]
    source = cfg.get("from", "") if values else ""
    if unrun and source:
        source += f"; its {', '.join(unrun)} is none vit runs: the recipe's instead"
    return Said(values, source)


def _registered(name: str) -> dict:
    """timm's registered pretrained_cfg for a timm model name (its default tag, or the one named);
    {} for vitcli's own names and names timm does not know."""
    if name in NAMED:
        return {}
    cfg = timm.models.get_pretrained_cfg(name)
    return {**cfg.to_dict(), "from": f"timm's pretrained_cfg of {name}"} if cfg is not None else {}


def layer(said: Said, keys: tuple[str, ...]) -> dict:
    """The recipe layer of what the checkpoint says, `keys` of it."""
    data = {k: v for k, v in said.values.items() if k in keys}
    return {"data": data} if data else {}


def row(data: DataConfig, said: Said, keys: tuple[str, ...] = KEYS) -> str:
    """The load table's preprocessing row: the values the run uses, and where they came from."""
    chosen = {k: getattr(data, k) for k in keys}
    shown = [f"{k} {_show(v)}" for k, v in chosen.items()]
    told = {k: v for k, v in said.values.items() if k in keys}
    differ = [k for k, v in told.items() if _show(v) != _show(chosen[k])]
    if not told:
        return f"{', '.join(shown)} (the recipe; the checkpoint says none)"
    if not differ:
        return f"{', '.join(shown)} (from {said.source})"
    theirs = ", ".join(f"{k} {_show(told[k])}" for k in differ)
    return f"{', '.join(shown)} (the recipe's {', '.join(differ)} over {said.source}: {theirs})"


def _show(value) -> str:
    """A value as the row writes it: 0.485,0.456,0.406; 0.9; bicubic."""
    if isinstance(value, (list, tuple)):
        return ",".join(f"{float(v):g}" for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)
