"""Checkpoint surgery: resize a checkpoint's position embedding to a new resolution, offline, once.

Reads anything `weights.read_checkpoint` reads. Our own checkpoints keep their metadata with model.img_size
(and the recipe's) moved to the new size, so they rebuild there; foreign ones come out as timm-layout
safetensors that timm's VisionTransformer at the new img_size loads with strict=True.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from vitcli.checkpoint import atomic_path, save_weights
from vitcli.errors import CheckpointError
from vitcli.posemb import grid_for, resample_axis, resample_posemb, sincos_2d
from vitcli.weights import AXIS_TABLES, Loaded, read_checkpoint


def _patch_size(sd: dict, spec: dict, patch_size: int | None) -> tuple[int, int]:
    """The checkpoint's patch size (our spec, else the patch-embedding kernel); --patch must agree."""
    kernel = sd.get("patch_embed.proj.weight")  # (D, C, ph, pw)
    found = tuple(kernel.shape[-2:]) if kernel is not None else None
    if spec.get("patch_size"):  # ours say; a hybrid's 1x1 kernel sits on a stride-16 ResNet map
        found = (int(spec["patch_size"]),) * 2
    if patch_size is not None and found is not None and found != (patch_size, patch_size):
        raise CheckpointError(
            f"patch size {patch_size} given, but the checkpoint's patch embedding is {found[0]}x{found[1]}; "
            "only the position embedding is resized, so drop --patch"
        )
    if found is None and patch_size is None:
        raise CheckpointError("the checkpoint has no patch_embed.proj.weight; give the patch size (--patch)")
    return found or (patch_size, patch_size)


def _kind(sd: dict, spec: dict) -> str:
    if spec.get("pos_embed"):
        return spec["pos_embed"]
    if all(k in sd for k in AXIS_TABLES):
        return "learned_2d"
    return "learned_1d" if "pos_embed" in sd else "none"


def _old_grid(sd: dict, spec: dict, patch: tuple[int, int], kind: str) -> tuple[int, int]:
    """Our checkpoints state their img_size; otherwise the tables tell (1-D: a square grid after prefixes)."""
    if spec.get("img_size"):
        return grid_for(spec["img_size"], patch)
    if kind == "learned_2d":
        return sd["pos_embed_row"].shape[1], sd["pos_embed_col"].shape[1]
    if kind == "none":
        raise CheckpointError("the checkpoint has no position embedding, so there is nothing to resize")
    rows = sd["pos_embed"].shape[1]
    grid = rows - _num_prefix_tokens(sd, rows)
    side = math.isqrt(grid)
    if side * side != grid:
        raise CheckpointError(
            f"pos_embed {tuple(sd['pos_embed'].shape)}: {grid} grid rows is not a square, "
            "so the old grid is unknown"
        )
    return side, side


def _num_prefix_tokens(sd: dict, rows: int) -> int:
    """Class and register tokens with a pos_embed row (timm no_embed_class models have none)."""
    tokens = ("cls_token" in sd) + (sd["reg_token"].shape[1] if "reg_token" in sd else 0)
    if tokens and math.isqrt(rows) ** 2 == rows and math.isqrt(rows - tokens) ** 2 != rows - tokens:
        return 0
    return tokens


def _resize(sd: dict, kind: str, old: tuple[int, int], new: tuple[int, int], method: str) -> list:
    """Resize the position tensors of `sd` in place; report rows (tensor, old shape -> new shape)."""
    keys = {"learned_1d": ["pos_embed"], "sincos_2d": ["pos_embed"], "learned_2d": list(AXIS_TABLES)}.get(
        kind, []
    )
    before = {k: tuple(sd[k].shape) for k in keys}
    if kind == "learned_1d":
        prefix = sd["pos_embed"].shape[1] - old[0] * old[1]
        sd["pos_embed"] = resample_posemb(sd["pos_embed"], old, new, prefix, method)
    elif kind == "sincos_2d" and old != new:  # fixed table: recompute at the new grid, keep the prefix rows
        pe = sd["pos_embed"]  # (1, P+N, D)
        prefix = pe[:, : pe.shape[1] - old[0] * old[1]]
        sd["pos_embed"] = torch.cat([prefix, sincos_2d(new, pe.shape[-1]).to(pe.dtype)], dim=1)
    elif kind == "learned_2d":
        for key, axis in AXIS_TABLES.items():
            sd[key] = resample_axis(sd[key], new[axis], method)
    return [(k, f"{before[k]} -> {tuple(sd[k].shape)}") for k in keys]


def _new_meta(loaded: Loaded, new: tuple[int, int], patch: tuple[int, int]) -> dict:
    """Our metadata with model.img_size (spec and recipe) at the new size; foreign files carry none."""
    if loaded.kind != "vitcli":
        return {}
    h, w = new[0] * patch[0], new[1] * patch[1]
    if h != w:
        raise CheckpointError(
            f"grid {new[0]}x{new[1]} gives a {h}x{w} image, but model.img_size is one number; "
            "pick a square grid"
        )
    meta = {k: copy.deepcopy(v) for k, v in loaded.meta.items() if k != "format"}
    if isinstance(meta.get("model"), dict):
        meta["model"]["img_size"] = h
    if isinstance(meta.get("recipe"), dict) and isinstance(meta["recipe"].get("model"), dict):
        meta["recipe"]["model"]["img_size"] = h
    return meta


def _default_out(loaded: Loaded, new: tuple[int, int]) -> Path:
    """`<stem>_<gh>x<gw>.safetensors` beside the source file (in the current directory for a Hub name)."""
    if loaded.kind == "hub":
        stem, parent = loaded.path.replace("/", "_").replace(":", "_"), Path(".")
    else:
        stem, parent = Path(loaded.path).stem, Path(loaded.path).parent
    return parent / f"{stem}_{new[0]}x{new[1]}.safetensors"


def _write(path: Path, sd: dict, meta: dict, ours: bool) -> None:
    if ours:
        save_weights(path, sd, meta)
        return
    with atomic_path(path) as tmp:  # timm's own safetensors metadata, so it reads back as a timm file
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(tmp), metadata={"format": "pt"})


def resize_checkpoint(
    src: str,
    *,
    new_grid: tuple[int, int] | None = None,
    res: int | None = None,
    patch_size: int | None = None,
    method: str = "bilinear",
    out: str | None,
    dry_run: bool = False,
) -> list[tuple[str, str]]:
    """Resize the position embedding of `src` to `new_grid` (or res / patch) and write `out` atomically.

    `out` defaults to `<src stem>_<gh>x<gw>.safetensors` beside the source. Returns (what, detail) rows:
    old and new grid, and old and new shape of every resized tensor.
    """
    if (new_grid is None) == (res is None):
        raise CheckpointError("give exactly one of a new grid (HxW) or a new resolution")
    loaded = read_checkpoint(src)
    sd = dict(loaded.state_dict)
    spec = (
        loaded.meta.get("model")
        if loaded.kind == "vitcli" and isinstance(loaded.meta.get("model"), dict)
        else {}
    )
    patch = _patch_size(sd, spec, patch_size)
    new = tuple(new_grid) if new_grid is not None else grid_for(res, patch)
    kind = _kind(sd, spec)
    old = _old_grid(sd, spec, patch, kind)
    rows = [
        ("grid", f"{old[0]}x{old[1]} -> {new[0]}x{new[1]} (patch {patch[0]}, {kind}, {method})"),
        ("img_size", f"{old[0] * patch[0]}x{old[1] * patch[1]} -> {new[0] * patch[0]}x{new[1] * patch[1]}"),
    ]
    rows += _resize(sd, kind, old, new, method)
    meta = _new_meta(loaded, new, patch)
    target = Path(out) if out else _default_out(loaded, new)
    if target.suffix != ".safetensors":
        raise CheckpointError(f"output {target}: the output is safetensors; name it *.safetensors")
    if not dry_run:
        _write(target, sd, meta, loaded.kind == "vitcli")
    rows.append(("output", f"{target}{' (dry run, not written)' if dry_run else ''}"))
    return rows


def parse_grid(text: str) -> tuple[int, int]:
    """`24x16` -> (24, 16); a one-line error for anything that is not a rectangle of positive sides."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise CheckpointError(f"--grid {text!r}: expected HxW with positive integers, e.g. 24x24")
    return int(parts[0]), int(parts[1])


def run_resize(src: str, *, out, res, grid, patch, method: str, dry_run: bool) -> list[tuple[str, str]]:
    """`vit resize-posemb`: validate the flags, resize, and show what changed as a table."""
    from rich.table import Table

    from vitcli.metrics import stdout

    if method not in ("bilinear", "bicubic"):
        raise CheckpointError(f"--method {method!r}: expected bilinear or bicubic")
    rows = resize_checkpoint(src, new_grid=parse_grid(grid) if grid else None, res=res, patch_size=patch,
                             method=method, out=str(out) if out else None, dry_run=dry_run)
    table = Table(title="resize-posemb", show_header=False)
    for what, detail in rows:
        table.add_row(what, detail)
    stdout.print(table)
    return rows
