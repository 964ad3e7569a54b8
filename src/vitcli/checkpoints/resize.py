"""Checkpoint surgery: resize a checkpoint's position embedding to a new resolution, offline, once
(the command, `vit resize-posemb`, is stages/resize.py; the tables move as fit.move_posemb moves
them).

Reads anything `read_checkpoint` reads; `describe` says its patch size, grid, table kind and prefix
rows (the heads are not needed, so a file whose heads are unknown resizes too). Our own checkpoints
keep their metadata with model.img_size (and the recipe's) moved to the new size, so they rebuild
there; foreign ones come out as timm-layout safetensors that timm's VisionTransformer at the new
img_size loads with strict=True.
"""

from __future__ import annotations

import copy
from pathlib import Path

from safetensors.torch import save_file

from vitcli.checkpoints.describe import CheckpointSpec, describe
from vitcli.checkpoints.fit import move_posemb, with_grid
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.checkpoints.weights import save_weights
from vitcli.errors import CheckpointError, OutputError
from vitcli.models.posemb import check_method
from vitcli.recipe.checks import grid_for
from vitcli.runtime.files import atomic_path
from vitcli.runtime.workdir import check_output_file, kept_file


def resize_checkpoint(
    src: str,
    *,
    new_grid: tuple[int, int] | None = None,
    res: int | None = None,
    patch_size: int | None = None,
    method: str = "bilinear",
    old_grid: str = "",
    out: str | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
) -> list[tuple[str, str]]:
    """Resize the position embedding of `src` to `new_grid` (or res / patch) and write `out`
    atomically.

    `old_grid` (HxW) is the grid a 1-D table spans where the file cannot tell (fit.with_grid). `out`
    defaults to `<src stem>_<gh>x<gw>.safetensors` beside the source; an existing one is replaced
    only with `overwrite`, and kept beside it (runtime.workdir.kept_file). Returns (what, detail) rows:
    old and new grid, and old and new shape of every resized tensor.
    """
    _check_request(new_grid, res, patch_size, method, out)
    loaded = read_checkpoint(src)
    spec = with_grid(describe(loaded), loaded.state_dict, old_grid, "--old-grid")
    patch = _patch_size(spec, patch_size)
    new = (tuple(new_grid) if new_grid is not None
           else grid_for(res, patch, "--res", "the checkpoint's patch size"))
    old = _old_grid(spec)
    rows = [
        ("grid", f"{old[0]}x{old[1]} -> {new[0]}x{new[1]} (patch {patch}, {spec.pos_embed}, {method})"),
        ("img_size", f"{old[0] * patch}x{old[1] * patch} -> {new[0] * patch}x{new[1] * patch}"),
    ]
    # the read is cached and shared: replace entries, never change them
    sd = dict(loaded.state_dict)
    moved = move_posemb(sd, spec.pos_embed, old, new, spec.num_prefix_tokens, method)
    rows += [(key, f"{before} -> {after}") for key, before, after in moved]
    meta = _new_meta(loaded, new, patch)
    target = Path(out) if out else _default_out(loaded, new)
    if target.resolve() == Path(loaded.path).resolve():  # a workdir's weights among them
        raise OutputError(f"--out {target} is the checkpoint it reads, which the resized weights "
                          "would replace; name another file")
    check_output_file(target, "--out" if out else "the output (default: beside the source; set --out)",
                      overwrite)
    if not dry_run:
        with kept_file(target):
            _write(target, sd, meta, loaded.kind == "vitcli")
    rows.append(("output", f"{target}{' (dry run, not written)' if dry_run else ''}"))
    return rows


def _check_request(new_grid, res, patch_size, method: str, out: str | None) -> None:
    """Everything about the request that is wrong whatever the checkpoint holds, before anything is
    read."""
    if (new_grid is None) == (res is None):
        raise CheckpointError("give exactly one of a new grid (HxW) or a new resolution")
    check_method(method, "--method")
    if new_grid is not None and (len(new_grid) != 2 or min(new_grid) <= 0):
        raise CheckpointError(f"grid {new_grid}: expected two positive sides (H, W)")
    if res is not None and res <= 0:
        raise CheckpointError(f"resolution {res}: expected a positive number of pixels")
    if res is not None and patch_size:
        grid_for(res, patch_size, "--res", "--patch")  # names a resolution that fits
    if out is not None and Path(out).suffix != ".safetensors":
        raise CheckpointError(f"output {out}: the output is safetensors; name it *.safetensors")
    if out is not None:
        check_output_file(Path(out), "--out")


def _patch_size(spec: CheckpointSpec, given: int | None) -> int:
    """The checkpoint's patch size; --patch must agree, and is needed only when the checkpoint
    cannot tell."""
    if given is not None and spec.patch_size and spec.patch_size != given:
        raise CheckpointError(
            f"patch size {given} given, but the checkpoint's patch embedding is "
            f"{spec.patch_size}x{spec.patch_size}; only the position embedding is resized, so drop --patch"
        )
    if not spec.patch_size and given is None:
        raise CheckpointError("the checkpoint has no patch_embed.proj.weight; give the patch size (--patch)")
    return spec.patch_size or given


def _old_grid(spec: CheckpointSpec) -> tuple[int, int]:
    """The grid the checkpoint's position tables span (a 1-D table that does not tell it was
    refused, or told by --old-grid, in fit.with_grid)."""
    if spec.grid is None:
        raise CheckpointError("the checkpoint has no position embedding, so there is nothing to resize")
    return spec.grid


def _new_meta(loaded: Loaded, new: tuple[int, int], patch: int) -> dict:
    """Our metadata with model.img_size (spec and recipe) at the new size; foreign files carry
    none."""
    if loaded.kind != "vitcli":
        return {}
    h, w = new[0] * patch, new[1] * patch
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
    """`<stem>_<gh>x<gw>.safetensors` beside the source file (in the current directory for a Hub
    name)."""
    if loaded.kind == "hub":
        stem, parent = loaded.path.replace("/", "_").replace(":", "_"), Path(".")
    else:
        stem, parent = Path(loaded.path).stem, Path(loaded.path).parent
    return parent / f"{stem}_{new[0]}x{new[1]}.safetensors"


def _write(path: Path, sd: dict, meta: dict, ours: bool) -> None:
    if ours:
        save_weights(path, sd, meta)
        return
    # timm's own safetensors metadata, so it reads back as a timm file
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(tmp), metadata={"format": "pt"})
