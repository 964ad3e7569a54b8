"""Starting weights from wherever the paper's models live, read into timm names and fitted to a model.

Sources: a vitcli workdir or its model.safetensors, a timm .safetensors, a Google .npz in vit_jax or
big_vision layout, or a Hub / timm model name (timm downloads it). Pickle files (.pt/.pth/.bin/.ckpt) are
refused, never unpickled: unpickling runs whatever code the file carries.
"""

from __future__ import annotations

import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vitcli.checkpoint import MODEL_FILE, load_weights
from vitcli.errors import CheckpointError
from vitcli.posemb import resample_axis, resample_posemb

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
HUB_PREFIXES = ("hf-hub:", "hf_hub:", "timm/")
ZIP_MAGIC = b"PK\x03\x04"
HEAD = "head."
REPRESENTATION = "pre_logits."  # the i21k Dense+tanh before the head, `pre_logits.fc.*`
AXIS_TABLES = {"pos_embed_row": 0, "pos_embed_col": 1}  # learned_2d: which grid axis each table spans


@dataclass
class Loaded:
    """A checkpoint in memory: timm-named tensors plus, for our own files, the recipe and model spec."""

    state_dict: dict[str, torch.Tensor]
    meta: dict  # ours: {"format", "recipe", "model"}; {} for foreign checkpoints
    kind: str  # vitcli | timm | npz | hub
    path: str


def read_checkpoint(src: str) -> Loaded:
    """Read a workdir, .safetensors, Google .npz or Hub/timm name into timm names; refuse pickles."""
    src = str(src)
    path = Path(src).expanduser()
    if path.is_dir():
        if not (path / MODEL_FILE).is_file():
            raise CheckpointError(
                f"{path} has no {MODEL_FILE}; pass a finished vitcli workdir or a weights file"
            )
        return _read_file(path / MODEL_FILE)
    if path.is_file():
        return _read_file(path)
    looks_like_file = "/" in src or path.suffix.lower() in (".safetensors", ".npz", *PICKLE_SUFFIXES)
    if src.startswith(HUB_PREFIXES) or not looks_like_file:
        return _read_hub(src)
    hint = f" (for a Hub model write hf-hub:{src})" if src.count("/") == 1 and not path.suffix else ""
    raise CheckpointError(f"checkpoint not found: {src}{hint}")


def _pickle_refusal(path: Path) -> CheckpointError:
    out = path.with_suffix(".safetensors")
    return CheckpointError(
        f"{path} is a pickle file, which can run arbitrary code, so it is not loaded; convert it once with: "
        f'python -c "import torch; from safetensors.torch import save_file; '
        f"sd = torch.load('{path}', map_location='cpu', weights_only=True); "
        f"sd = sd.get('state_dict', sd.get('model', sd)); "
        f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{out}')\""
    )


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def _read_file(path: Path) -> Loaded:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    names = _zip_names(path) if head.startswith(ZIP_MAGIC) else []  # .npz and torch.save files are zips
    is_npz = bool(names) and all(n.endswith(".npy") for n in names)
    is_pickle = head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    if path.suffix.lower() in PICKLE_SUFFIXES or is_pickle or any(n.endswith(".pkl") for n in names):
        raise _pickle_refusal(path)  # torch.save writes a zip holding data.pkl (or, legacy, a bare pickle)
    if is_npz:
        try:
            with np.load(path, allow_pickle=False) as f:
                arrays = {k: f[k] for k in f.files}
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read as a numpy .npz without pickle ({e})") from None
        return Loaded(npz_to_timm(arrays, str(path)), {}, "npz", str(path))
    # safetensors: 8-byte little-endian header length, then the JSON header
    if path.suffix.lower() == ".safetensors" or head[8:9] == b"{":
        state_dict, meta = load_weights(path)
        ours = str(meta.get("format", "")).startswith("vitcli")
        return Loaded(state_dict, meta if ours else {}, "vitcli" if ours else "timm", str(path))
    raise CheckpointError(
        f"{path}: unknown weights format; expected .safetensors, a Google .npz or a workdir"
    )


def _read_hub(name: str) -> Loaded:
    import timm

    model_name = f"hf-hub:{name}" if name.startswith("timm/") else name
    try:
        model = timm.create_model(model_name, pretrained=True)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise CheckpointError(f"'{name}' is not a file, a workdir or a timm model name") from None
        raise CheckpointError(f"cannot load {name}: {str(e).splitlines()[0]}") from None
    except (OSError, ValueError) as e:  # huggingface_hub's LocalEntryNotFoundError is an OSError
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        why = "offline" if offline else (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"cannot download {name}: {why}; pass a local file") from None
    return Loaded(model.state_dict(), {}, "hub", name)


# ---------------------------------------------------------------- Google .npz -> timm names

NPZ_PREFIXES = ("", "opt/target/", "params/", "params/img/", "img/")  # vit_jax, old vit_jax, big_vision
POS_KEYS = ("Transformer/posembed_input/pos_embedding", "pos_embedding", "Transformer/pos_embedding")


def npz_to_timm(w: dict[str, np.ndarray], name: str = "npz") -> dict[str, torch.Tensor]:
    """Convert flattened Flax ViT params (vit_jax or big_vision layout) to timm VisionTransformer names.

    Flax Dense kernels are (in, out) and timm Linear weights (out, in); conv kernels HWIO vs OIHW;
    attention q/k/v kernels (D, H, D/H) are flattened and stacked into timm's fused (3D, D) qkv.
    """
    prefix = next((p for p in NPZ_PREFIXES if f"{p}embedding/kernel" in w), None)
    if prefix is None:
        raise CheckpointError(
            f"{name}: no embedding/kernel array, so not a ViT in vit_jax or big_vision layout"
        )
    used: set[str] = set()

    def get(key: str, idx: int | None = None) -> torch.Tensor:
        if prefix + key not in w:
            raise CheckpointError(f"{name}: missing array {prefix + key}")
        used.add(prefix + key)
        a = w[prefix + key] if idx is None else w[prefix + key][idx]
        return torch.from_numpy(np.asarray(a, dtype=np.float32))

    def dense(key: str, idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return get(f"{key}/kernel", idx).T, get(f"{key}/bias", idx)

    sd = {
        "patch_embed.proj.weight": get("embedding/kernel").permute(3, 2, 0, 1),  # HWIO -> OIHW
        "patch_embed.proj.bias": get("embedding/bias"),
    }
    if prefix + "cls" in w:
        sd["cls_token"] = get("cls")  # (1, 1, D)
    pos_key = next((k for k in POS_KEYS if prefix + k in w), None)  # absent for big_vision sincos2d
    if pos_key:
        pos = get(pos_key).reshape(1, -1, sd["patch_embed.proj.bias"].shape[0])  # (1, N or 1+N, D)
        n = pos.shape[1]
        if "cls_token" in sd and math.isqrt(n) ** 2 == n:
            # big_vision adds posemb before prepending [cls]; timm adds it after, so [cls] gets a zero row
            pos = torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)
        sd["pos_embed"] = pos
    sd["norm.weight"], sd["norm.bias"] = (
        get("Transformer/encoder_norm/scale"),
        get("Transformer/encoder_norm/bias"),
    )
    for layer, key in (("head", "head"), ("pre_logits.fc", "pre_logits")):
        if f"{prefix}{key}/kernel" in w:
            sd[f"{layer}.weight"], sd[f"{layer}.bias"] = dense(key)
    sd.update(_npz_blocks(w, prefix, get, dense))
    leftover = sorted(k for k in w if k.startswith(prefix) and k not in used)
    if leftover:
        raise CheckpointError(f"{name}: arrays a plain ViT does not have: {', '.join(leftover[:3])}")
    return {k: v.contiguous() for k, v in sd.items()}


def _npz_blocks(w, prefix, get, dense) -> dict[str, torch.Tensor]:
    """Encoder blocks; `scan` checkpoints stack all blocks in one array with a leading depth axis."""
    scan = f"{prefix}Transformer/encoderblock/LayerNorm_0/scale" in w
    depth = len(w[f"{prefix}Transformer/encoderblock/LayerNorm_0/scale"]) if scan else 0
    while not scan and f"{prefix}Transformer/encoderblock_{depth}/LayerNorm_0/scale" in w:
        depth += 1
    sd = {}
    for i in range(depth):
        bp, idx = ("Transformer/encoderblock/", i) if scan else (f"Transformer/encoderblock_{i}/", None)
        # vit_jax numbers submodules in call order (LN_0, MHDPA_1, LN_2, Mlp_3), big_vision per type
        attn, ln2, mlp = (
            (1, 2, 3) if f"{prefix}{bp}MultiHeadDotProductAttention_1/out/bias" in w else (0, 1, 0)
        )
        t, a = f"blocks.{i}.", f"{bp}MultiHeadDotProductAttention_{attn}/"
        sd[t + "norm1.weight"], sd[t + "norm1.bias"] = (
            get(bp + "LayerNorm_0/scale", idx),
            get(bp + "LayerNorm_0/bias", idx),
        )
        qkv = [get(f"{a}{n}/kernel", idx) for n in ("query", "key", "value")]  # each (D, H, D/H)
        sd[t + "attn.qkv.weight"] = torch.cat([k.flatten(1).T for k in qkv])  # (3D, D)
        sd[t + "attn.qkv.bias"] = torch.cat(
            [get(f"{a}{n}/bias", idx).flatten() for n in ("query", "key", "value")]
        )
        out = get(a + "out/kernel", idx)  # (H, D/H, D)
        sd[t + "attn.proj.weight"] = out.reshape(-1, out.shape[-1]).T
        sd[t + "attn.proj.bias"] = get(a + "out/bias", idx)
        sd[t + "norm2.weight"], sd[t + "norm2.bias"] = (
            get(f"{bp}LayerNorm_{ln2}/scale", idx),
            get(f"{bp}LayerNorm_{ln2}/bias", idx),
        )
        for j in range(2):
            sd[f"{t}mlp.fc{j + 1}.weight"], sd[f"{t}mlp.fc{j + 1}.bias"] = dense(
                f"{bp}MlpBlock_{mlp}/Dense_{j}", idx
            )
    return sd


# ---------------------------------------------------------------- fitting to a model


def _fit_head(sd: dict, target: dict, keep: bool) -> list[tuple[str, str]]:
    ckpt_k = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    model_k = target["head.weight"].shape[0] if "head.weight" in target else 0
    if keep:
        if ckpt_k != model_k:
            raise CheckpointError(
                f"init.keep_head=true but the dataset has {model_k} classes and the checkpoint head has "
                f"{ckpt_k}; set init.keep_head=false to start from a zero head"
            )
        return [("head", f"kept ({ckpt_k} classes)")]
    for k in [k for k in sd if k.startswith(HEAD)]:
        del sd[k]
    sd.update({k: v for k, v in target.items() if k.startswith(HEAD)})  # the model's own zero-init head
    return [("head", f"dropped ({ckpt_k} classes); model's own head for {model_k} classes")]


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


def _fit_posemb(sd, target, model, kind, method, old_grid) -> list[tuple[str, str]]:
    if kind in ("sincos_2d", "sincos_1d"):  # a fixed function of the grid: take the model's table, built at its size
        sd.pop("pos_embed", None)
        if "pos_embed" in target:
            sd["pos_embed"] = target["pos_embed"]
        return [("position embedding", f"{kind} for grid {_grid_str(model.patch_embed.grid_size)}")]
    rows = []
    if kind == "learned_1d" and "pos_embed" in sd and "pos_embed" in target:
        new_grid = tuple(model.patch_embed.grid_size)
        prefix = 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens
        old = sd["pos_embed"]
        if old.shape != target["pos_embed"].shape or (old_grid and tuple(old_grid) != new_grid):
            sd["pos_embed"] = resample_posemb(old, old_grid, new_grid, prefix, method)
            side = math.isqrt(old.shape[1] - prefix)  # resample_posemb took a missing old grid as square
            was = _grid_str(old_grid) if old_grid else f"{side}x{side}"
            detail = (
                f"{tuple(old.shape)} -> {tuple(sd['pos_embed'].shape)}, grid {was} -> {_grid_str(new_grid)} "
                f"({method})"
            )
            rows.append(("position embedding", detail))
    for key in AXIS_TABLES if kind == "learned_2d" else ():
        if key in sd and key in target and sd[key].shape[1] != target[key].shape[1]:
            old = sd[key]
            sd[key] = resample_axis(old, target[key].shape[1], method)
            rows.append((key, f"{tuple(old.shape)} -> {tuple(sd[key].shape)} ({method})"))
    return rows


def _grid_str(grid) -> str:
    return f"{grid[0]}x{grid[1]}"


def _check_fit(sd: dict, target: dict, resizable: tuple[str, ...] = ()) -> None:
    """Raise one line naming the first mismatching, missing and unexpected keys with their shapes."""
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


def adapt_state_dict(
    sd: dict[str, torch.Tensor],
    model: nn.Module,
    *,
    keep_head: bool,
    keep_representation: bool,
    method: str,
    pos_embed_kind: str = "learned_1d",
    old_grid: tuple[int, int] | None = None,
) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """A state dict that loads strict=True into `model`, plus (what, detail) report rows.

    The paper's transfer protocol: drop the head (the model keeps its zero-initialised one), drop the
    pre_logits layer unless asked, resize the position embedding to the model's grid. `old_grid` is the
    checkpoint's grid when known (ours store it); otherwise it is taken to be square.
    """
    target = model.state_dict()
    sd = dict(sd)
    rows = _fit_head(sd, target, keep_head) + _fit_representation(sd, keep_representation)
    _check_fit(sd, target, resizable=("pos_embed", *AXIS_TABLES))
    rows += _fit_posemb(sd, target, model, pos_embed_kind, method, old_grid)
    _check_fit(sd, target)
    own = sum(1 for k, v in sd.items() if v is target.get(k))
    rows.insert(0, ("loaded", f"{len(sd) - own} of {len(target)} tensors from the checkpoint"))
    return sd, rows
