"""Starting weights from wherever the paper's models live, read into timm names.

Sources: a vitcli workdir or its model.safetensors, a timm .safetensors, a Google .npz in vit_jax or
big_vision layout, a torch.save file (.pth/.pt: MAE's checkpoints, timm's or DeiT's training files;
read by vitcli.checkpoints.pth with weights_only=True, argparse.Namespace allowed by name and
nothing else), a folder transformers' ViT wrote (hf_vit.py), a folder timm wrote (timm_folder.py:
the network its config.json names with its model_args, the folder or either weights file in it),
or a Hub / timm model name (timm downloads it). What a foreign source says of the pixels its
weights expect is kept in timm's terms (`pretrained_cfg`: mean, std, interpolation, crop_pct,
crop_mode): a Hub model's own, or a folder's beside its weights (timm's config.json,
transformers' preprocessor_config.json). A bare
pickle (not a torch.save file) is refused, never unpickled: unpickling runs whatever code the file
carries. A torch.save file named .safetensors is refused with the name to give it (torch.load reads
a .safetensors name as safetensors), and a folder that is not what it looks like (another
transformers model_type, weights without their config.json, a config without weights) is named with
what it holds.

Reads are cached per process (the resolve step and the training driver read the same checkpoint),
keyed on the resolved path, inode, modification time and size, so a rewritten file is read again.
Callers share the returned dicts and must not mutate them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import timm
import torch
from torch import nn

from vitcli.checkpoints import hf_vit, timm_folder
from vitcli.checkpoints.npz import npz_to_timm
from vitcli.checkpoints.pth import read_pth
from vitcli.checkpoints.weights import load_weights, not_safetensors
from vitcli.errors import CheckpointError, first_line
from vitcli.recipe.data_checks import json_object
from vitcli.runtime.run_dir import newest_step
from vitcli.runtime.run_files import MODEL_FILE, RECIPE_FILE

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
HUB_PREFIXES = ("hf-hub:", "hf_hub:", "timm/")
LOCAL_DIR = "local-dir:"  # timm.create_model's name for a folder save_for_hf wrote
ZIP_MAGIC = b"PK\x03\x04"
# a pickle starts with PROTO (0x80) and its version
PICKLE_PROTOCOLS = (b"\x02", b"\x03", b"\x04", b"\x05")
# torch.save's legacy (non-zip) format: a protocol-2 pickle of its magic number
# 0x1950a86a20f9469cfc6c first
LEGACY_TORCH = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


@dataclass
class Loaded:
    """A checkpoint in memory: timm-named tensors plus, for our own files, the recipe and model
    spec."""

    state_dict: dict[str, torch.Tensor]  # timm names
    # ours: {"format", "recipe", "model"}; a transformers folder: {"class_names", "layer_norm_eps",
    # "notes", "image_size", "patch_size"}; a timm folder: {"class_names", "architecture",
    # "built_as", "img_size", "num_classes", "layer_norm_eps", "model", "grid",
    # "num_prefix_tokens"}; {} for other foreign files
    meta: dict
    # vitcli | timm | npz | hub | mae (one of MAE's .pth layouts) | torch (another torch.save file)
    # | hf (a transformers ViT folder)
    kind: str
    path: str
    # evidence the source itself carries: npz query kernels, a Hub model's attn.num_heads; 0 = none
    num_heads: int = 0
    # a foreign source's preprocessing in timm's pretrained_cfg terms (mean, std, interpolation,
    # crop_pct) and where it was read; {} when it says none
    pretrained_cfg: dict = field(default_factory=dict)
    # what the file held that was left out (MAE's decoder and mask token, a training file's
    # optimizer), as the load table says it
    dropped: tuple[str, ...] = ()


def read_checkpoint(src: str) -> Loaded:
    """Read a workdir, .safetensors, Google .npz or Hub/timm name into timm names; refuse
    pickles."""
    where = locate_checkpoint(src)
    if isinstance(where, Path):
        # an atomic rewrite is a new inode, an in-place one changes mtime or size; shards count too
        files = [where, *hf_vit.shards(where)]
        version = tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in map(Path.stat, files))
        return _read_cached(str(where.resolve()), version)
    return _read_cached(where, None)


def locate_checkpoint(src: str) -> Path | str:
    """Where `src` is, read nothing: a local weights file (a workdir's model.safetensors), or the
    Hub/timm name it is; a local path that is not there (or a workdir without weights) is
    refused. timm's `local-dir:DIR` is DIR."""
    src = str(src).removeprefix(LOCAL_DIR)
    path = Path(src).expanduser()
    if path.is_dir():
        path = _folder_weights(path)
    if path.is_file():
        return path
    looks_like_file = "/" in src or path.suffix.lower() in (".safetensors", ".npz", *PICKLE_SUFFIXES)
    if src.startswith(HUB_PREFIXES) or not looks_like_file:
        return src
    raise CheckpointError(f"checkpoint not found: {src}{_near(src, path)}")


def _folder_weights(folder: Path) -> Path:
    """The weights file of a folder: a vitcli workdir's or a timm folder's model.safetensors, or a
    transformers ViT folder's (whole or sharded); one line saying what is missing and what helps."""
    model_type = hf_vit.model_type(folder)
    if model_type not in (None, "vit"):
        raise _not_vit(folder, model_type)
    if timm_folder.is_timm_folder(folder):
        return _timm_weights(folder)
    found = hf_vit.weights_file(folder) if model_type else folder / MODEL_FILE
    if found is not None and found.is_file():
        return found
    names = sorted(p.name for p in folder.iterdir())
    held = f"it holds {', '.join(names[:6])}{', ...' if names[6:] else ''}" if names else "empty"
    if model_type:
        raise CheckpointError(
            f"{folder} is a transformers ViT folder (config.json) without its weights ({held}): "
            f"save_pretrained writes {MODEL_FILE} or pytorch_model.bin (sharded: either's "
            ".index.json and its shards) beside config.json; copy them from where it came from")
    step = newest_step(folder) if (folder / RECIPE_FILE).is_file() else 0
    if step:  # a vitcli run stopped before its end, which writes the weights
        raise CheckpointError(
            f"{folder} holds an unfinished run (its newest checkpoint is of step {step}; "
            f"{MODEL_FILE} is written at its end): run the command that started it again, which "
            "resumes and finishes it, then pass the workdir")
    # timm's or transformers' weights
    theirs = [n for n in names if n.startswith(("pytorch_model", "model-"))]
    raise CheckpointError(
        f"{folder} has no {MODEL_FILE} ({held}): pass a finished vitcli workdir, a weights file, "
        f"or a timm or transformers folder (each holds config.json beside {MODEL_FILE} or "
        "pytorch_model.bin)"
        + (f"; {theirs[0]} needs its config.json beside it" if theirs else ""))


def _timm_weights(folder: Path) -> Path:
    """A timm folder's weights file, or one line saying it has none."""
    found = timm_folder.weights_file(folder)
    if found is None:
        names = ", ".join(sorted(p.name for p in folder.iterdir()))
        raise CheckpointError(
            f"{folder} is a timm folder (config.json names an architecture) without its weights "
            f"(it holds {names}): save_for_hf writes {' or '.join(timm_folder.WEIGHTS_FILES)} "
            "beside config.json; copy them from where it came from")
    return found


def _not_vit(folder: Path, model_type: str) -> CheckpointError:
    """A transformers folder of another model than ViT."""
    return CheckpointError(
        f"{folder / 'config.json'} says model_type '{model_type}': vit reads transformers folders "
        "of model_type 'vit' (ViTModel, ViTForImageClassification), timm's ViT weights "
        f"(.safetensors or a Hub name), Google .npz files and MAE's .pth; a {model_type} model is "
        "none of these")


def _near(src: str, path: Path) -> str:
    """What a missing source probably meant: a neighbour in its folder when that folder exists here
    (a mistyped runs/fm_pree is a local path, not a Hub model), else the Hub spelling of an
    `org/name`."""
    folder = path.parent
    if str(folder) not in ("", ".") and folder.is_dir():
        near = difflib.get_close_matches(path.name, [p.name for p in folder.iterdir()], n=1)
        return f" (did you mean {folder / near[0]}?)" if near else f" ({folder} holds no such entry)"
    return f" (for a Hub model write hf-hub:{src})" if src.count("/") == 1 and not path.suffix else ""


# one cache for files and Hub names: at most two checkpoints held in memory
@functools.lru_cache(maxsize=2)
def _read_cached(src: str, version: tuple | None) -> Loaded:
    """A resolved file path with the (inode, mtime_ns, size) of it and its shards, or a Hub name
    with None."""
    return _read_hub(src) if version is None else _read_file(Path(src))


def _read_file(path: Path) -> Loaded:
    """One file by its format, told by its first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    model_type = hf_vit.model_type(path.parent) if path.name in hf_vit.WEIGHTS_FILES else None
    if model_type not in (None, "vit"):
        raise _not_vit(path.parent, model_type)
    if model_type == "vit":
        return _read_hf(path)
    if path.name in timm_folder.WEIGHTS_FILES and timm_folder.is_timm_folder(path.parent):
        return _read_timm(path, head)
    # .npz and torch.save files are zips
    names = _zip_names(path) if head.startswith(ZIP_MAGIC) else []
    if head.startswith(ZIP_MAGIC) and not names:  # a zip's table of contents is at its end
        raise CheckpointError(f"{path} begins as a zip archive (torch.save and .npz files are) but "
                              f"its end is missing or damaged: cut short at {path.stat().st_size} "
                              "bytes (an interrupted copy or download?); copy it again")
    is_torch_zip = any(n.endswith("/data.pkl") for n in names)  # torch.save writes ARCHIVE/data.pkl
    if path.suffix.lower() == ".safetensors" and (is_torch_zip or head.startswith(LEGACY_TORCH)):
        # torch.load would read it as safetensors, by its name
        raise not_safetensors(path, ValueError("a torch.save file"))
    if is_torch_zip or head.startswith(LEGACY_TORCH):
        read = read_pth(path, is_zip=is_torch_zip)
        _check_not_transformers(read.state_dict, path)
        return Loaded(read.state_dict, {}, "mae" if read.mae else "torch", str(path), dropped=read.dropped)
    is_pickle = head[:1] == b"\x80" and head[1:2] in PICKLE_PROTOCOLS
    if path.suffix.lower() in PICKLE_SUFFIXES or is_pickle or any(n.endswith(".pkl") for n in names):
        raise _pickle_refusal(path)
    if names and all(n.endswith(".npy") for n in names):
        return _read_npz(path)
    # safetensors: 8-byte little-endian header length, then the JSON header
    if path.suffix.lower() == ".safetensors" or head[8:9] == b"{":
        state_dict, meta = load_weights(path)
        if str(meta.get("format", "")).startswith("vitcli"):
            return Loaded(state_dict, meta, "vitcli", str(path))
        _check_not_transformers(state_dict, path)
        return Loaded(state_dict, {}, "timm", str(path), pretrained_cfg=_folder_cfg(path))
    raise CheckpointError(
        f"{path}: unknown weights format; expected .safetensors, a Google .npz or a workdir"
    )


def _check_not_transformers(sd: dict[str, torch.Tensor], path: Path) -> None:
    """transformers' ViT tensor names without the config.json that says the network they are."""
    first = next((k for k in sd if k.startswith(hf_vit.HF_PREFIXES)), None)
    if first:
        raise CheckpointError(
            f"{path} holds transformers' ViT tensors ({first}) but no config.json of model_type "
            "vit is beside it to say the network they make; put the config.json save_pretrained "
            "wrote beside it and pass the folder")


def _read_hf(path: Path) -> Loaded:
    """A transformers ViT folder's weights, config.json and preprocessor_config.json."""
    vit = hf_vit.read_vit_folder(path)
    meta = {"class_names": vit.class_names, "layer_norm_eps": vit.layer_norm_eps,
            "notes": vit.notes, "image_size": vit.image_size, "patch_size": vit.patch_size}
    return Loaded(vit.state_dict, meta, "hf", str(path), vit.num_heads, _folder_cfg(path))


def _read_timm(path: Path, head: bytes) -> Loaded:
    """A timm folder's weights (either of its files, the folder's config.json beside it), with the
    network, class names and preprocessing its config.json says."""
    folder = timm_folder.read_config(path.parent)
    if path.suffix == ".bin":
        state_dict = read_pth(path, is_zip=head.startswith(ZIP_MAGIC)).state_dict
    else:
        state_dict = load_weights(path)[0]
    meta = {"class_names": folder.class_names, "architecture": folder.architecture,
            "built_as": folder.built_as, "img_size": folder.model.img_size,
            "num_classes": folder.num_classes, "layer_norm_eps": folder.model.layer_norm_eps,
            "model": dataclasses.asdict(folder.model), "grid": folder.grid,
            "num_prefix_tokens": folder.num_prefix_tokens}
    return Loaded(state_dict, meta, "timm", str(path), folder.num_heads, _folder_cfg(path))


# transformers' `resample` (PIL's Resampling numbers) -> timm's interpolation names
PIL_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _folder_cfg(path: Path) -> dict:
    """The preprocessing a model folder states beside its model.safetensors: timm's config.json
    (pretrained_cfg, or the legacy flat form), else transformers' preprocessor_config.json
    (image_mean, image_std, resample; crop_pct, or crop_size over size.shortest_edge, or over
    size.height when both sides are set: crop_mode squash); {} for anything else."""
    # MODEL_FILE, or a transformers folder's pytorch_model.bin
    if path.name not in hf_vit.WEIGHTS_FILES:
        return {}
    timm_cfg = json_object(path.parent / "config.json")
    timm_cfg = timm_cfg.get("pretrained_cfg", timm_cfg)
    if "mean" in timm_cfg:
        keys = ("mean", "std", "interpolation", "crop_pct", "crop_mode")
        return {"from": "its config.json (timm)", **{k: timm_cfg[k] for k in keys if k in timm_cfg}}
    hf = json_object(path.parent / "preprocessor_config.json")
    if "image_mean" not in hf:
        return {}
    out = {"from": "its preprocessor_config.json (transformers)", "mean": hf["image_mean"],
           "std": hf.get("image_std")}
    if hf.get("resample") in PIL_RESAMPLE:
        out["interpolation"] = PIL_RESAMPLE[hf["resample"]]
    size, crop = hf.get("size") or {}, hf.get("crop_size")
    # ViTImageProcessor: height and width, squashed
    edge = size.get("shortest_edge") or size.get("height")
    if "height" in size and "shortest_edge" not in size:
        out["crop_mode"] = "squash"
    if hf.get("crop_pct"):
        out["crop_pct"] = hf["crop_pct"]
    elif hf.get("do_center_crop") and isinstance(crop, dict) and edge:
        out["crop_pct"] = crop.get("height", edge) / edge
    elif edge:  # no crop: all the resized image is seen
        out["crop_pct"] = 1.0
    return {k: v for k, v in out.items() if v is not None}


def _zip_names(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def _pickle_refusal(path: Path) -> CheckpointError:
    """A pickle that torch.save did not write: torch.load's weights_only reader does not take it,
    and plain unpickling runs whatever code the file carries."""
    return CheckpointError(
        f"{path} is a pickle file that torch.save did not write, which can run arbitrary code, so it is not "
        f"loaded; where you trust it, save its weights with safetensors.torch.save_file and pass that file"
    )


def _read_npz(path: Path) -> Loaded:
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read as a numpy .npz without pickle ({e})") from None
    state_dict, num_heads = npz_to_timm(arrays, str(path))
    return Loaded(state_dict, {}, "npz", str(path), num_heads)


def _read_hub(name: str) -> Loaded:
    """A Hub / timm name, built by timm with its pretrained weights (timm downloads and caches
    them)."""
    model_name = f"hf-hub:{name}" if name.startswith("timm/") else name
    try:
        model = timm.create_model(model_name, pretrained=True)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise CheckpointError(f"'{name}' is not a file, a workdir or a timm model name") from None
        raise CheckpointError(f"cannot load {name}: {first_line(e)}") from None
    except (OSError, ValueError) as e:  # huggingface_hub's LocalEntryNotFoundError is an OSError
        offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
        why = "offline" if offline else first_line(e)
        raise CheckpointError(f"cannot download {name}: {why}; pass a local file") from None
    stated = getattr(model, "pretrained_cfg", None) or {}  # timm sets it on every model it creates
    keys = ("mean", "std", "interpolation", "crop_pct", "crop_mode")
    cfg = {k: stated[k] for k in keys if stated.get(k) is not None}
    return Loaded(model.state_dict(), {}, "hub", name, _attention_heads(model),
                  {"from": "its pretrained_cfg (timm)", **cfg} if cfg else {})


def _attention_heads(model: nn.Module) -> int:
    """The first block's attn.num_heads, 0 for models without ViT blocks."""
    blocks = getattr(model, "blocks", None)
    return int(getattr(getattr(blocks[0], "attn", None), "num_heads", 0)) if blocks else 0
