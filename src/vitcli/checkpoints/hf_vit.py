"""transformers' ViT layout, both ways: the names `vit export --format hf` writes, and a folder
transformers wrote (`ViTForImageClassification` or `ViTModel.save_pretrained`, e.g. a local copy of
google/vit-base-patch16-224) read back into timm's names.

The mapping is transformers' own `convert_vit_timm_to_pytorch.py` (written here from it, not
imported: that script is not part of the installed package): timm's fused qkv (3D, D) is query, key
and value stacked, `norm1`/`norm2` are `layernorm_before`/`layernorm_after`, the MLP's fc1/fc2 the
`intermediate`/`output` dense layers, the final norm `vit.layernorm` and the head `classifier`.
transformers 5 renames these in memory but still saves them so; a ViTModel saves them without the
`vit.` prefix.

The network comes from config.json, and everything timm's ViT cannot be is refused in one line
naming the file and the key: only exact GELU, 3 channels, square patches and images.
`layer_norm_eps` is honoured (model.layer_norm_eps): transformers' default, and google's converted
checkpoints, say 1e-12 where timm's ViT has 1e-6. `qkv_bias: false` is zero biases, the same
network. A ViTModel's `pooler` (Dense + tanh on the class token) is timm's pre-logits layer when no
classifier reads past it (google's in21k folders); beside a `classifier`, which reads the class
token itself, or with another `pooler_act`, it is dropped, and the load table says so. The class
names are `id2label`'s, unless they are transformers' LABEL_0, LABEL_1, ... placeholders.

config.json's values are checked by the types transformers' ViTConfig declares (a quoted "2" for
num_hidden_layers is refused naming the file, the key and what it should be). Weights are
model.safetensors, or pytorch_model.bin through torch's weights-only unpickler (tensors and plain
containers, no code runs), or either sharded as save_pretrained(max_shard_size=...) writes it: an
index (model.safetensors.index.json, pytorch_model.bin.index.json) whose `weight_map` names each
tensor's shard file beside it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vitcli.checkpoints.weights import not_safetensors
from vitcli.errors import CheckpointError, first_line
from vitcli.recipe.data_checks import json_object
from vitcli.runtime.run_files import MODEL_FILE  # transformers' save_pretrained names it so too

# timm block names -> transformers' `vit.encoder.layer.{i}.` names (weight and bias alike)
BLOCK_NAMES = {
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}
TOP_NAMES = {
    "cls_token": "vit.embeddings.cls_token",
    "pos_embed": "vit.embeddings.position_embeddings",
    "patch_embed.proj.weight": "vit.embeddings.patch_embeddings.projection.weight",
    "patch_embed.proj.bias": "vit.embeddings.patch_embeddings.projection.bias",
    "norm.weight": "vit.layernorm.weight",
    "norm.bias": "vit.layernorm.bias",
    "head.weight": "classifier.weight",
    "head.bias": "classifier.bias",
}
QKV = ("query", "key", "value")
HF_PREFIXES = ("vit.embeddings.", "embeddings.patch_embeddings.")  # what no other layout names so
# what save_pretrained writes, newest first: whole, or an index of shards (`weight_map`: tensor
# name -> shard file)
INDEX_SUFFIX = ".index.json"
WEIGHTS_FILES = (MODEL_FILE, MODEL_FILE + INDEX_SUFFIX, "pytorch_model.bin",
                 "pytorch_model.bin" + INDEX_SUFFIX)
ARCHITECTURES = ("ViTForImageClassification", "ViTModel")
# transformers' ViTConfig defaults: what a config.json that leaves a key out means
DEFAULTS = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
            "hidden_act": "gelu", "layer_norm_eps": 1e-12, "image_size": 224, "patch_size": 16,
            "num_channels": 3, "qkv_bias": True, "pooler_act": "tanh"}
TIMM_EPS = 1e-6  # timm's VisionTransformer LayerNorm
# the types ViTConfig declares for the keys read here (a float key takes an int: 1e0 is written 1)
INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "num_channels")
TYPES = {**dict.fromkeys(INTS, "int"), "hidden_act": "str", "pooler_act": "str",
         "layer_norm_eps": "float", "image_size": "size", "patch_size": "size", "qkv_bias": "bool",
         "architectures": "names"}
SAID = {"int": "a positive integer (unquoted)", "str": "a string",
        "float": "a positive number (unquoted)", "bool": "true or false (unquoted)",
        "size": "a positive integer or a list of two",
        "names": "a list of model class names such as [\"ViTForImageClassification\"]"}


@dataclass(frozen=True)
class HfVit:
    """A transformers ViT folder in timm's terms."""

    state_dict: dict[str, torch.Tensor]  # timm names
    num_heads: int
    layer_norm_eps: float
    class_names: list[str] | None  # id2label's, None when it holds transformers' placeholders
    # load-table rows: what the config says and what was dropped or filled
    notes: list[tuple[str, str]]
    image_size: int  # config.json's (square: check_config refuses others), so its grid is known
    patch_size: int


def is_vit_folder(folder: Path) -> bool:
    """Whether `folder` holds a transformers ViT: its config.json says model_type "vit"."""
    return model_type(folder) == "vit"


def model_type(folder: Path) -> str | None:
    """The model_type a transformers folder's config.json says; None without one (no config.json, or
    timm's, which has none)."""
    found = json_object(folder / "config.json").get("model_type")
    return None if found is None else str(found)


def weights_file(folder: Path) -> Path | None:
    """The weights save_pretrained wrote into a transformers ViT folder; None for any other
    folder."""
    if not is_vit_folder(folder):
        return None
    return next((folder / n for n in WEIGHTS_FILES if (folder / n).is_file()), None)


def read_vit_folder(path: Path) -> HfVit:
    """`path` (a transformers ViT folder's weights file) and its config.json as timm's
    VisionTransformer."""
    where = path.parent / "config.json"
    config = {**DEFAULTS, **json.loads(where.read_text())}
    check_config(config, where)
    sd, notes = timm_state_dict(_tensors(path), config, path)
    depth = config["num_hidden_layers"]
    eps = float(config["layer_norm_eps"])
    names = _class_names(config.get("id2label"), sd.get("head.weight"))
    arch = (config.get("architectures") or ["ViTModel"])[0]
    said = [f"{arch}, depth {depth}", f"LayerNorm eps {eps:g} (layer_norm_eps; timm's ViT: {TIMM_EPS:g})"]
    said.append("class names from id2label" if names else "no class names (id2label holds none)")
    rows = [("transformers", "; ".join(said)), *notes]
    return HfVit(sd, config["num_attention_heads"], eps, names, rows, _side(config["image_size"]),
                 _side(config["patch_size"]))


def check_config(config: dict, where: Path) -> None:
    """A CheckpointError naming `where`, the first key timm's ViT cannot be, its value and why."""
    _check_types(config, where)
    heads, arch = config["num_attention_heads"], config.get("architectures") or []
    refused = {  # key -> why, when its value is refused
        "architectures": (any(a not in ARCHITECTURES for a in arch),
                          f"vitcli reads {' and '.join(ARCHITECTURES)} folders"),
        "hidden_act": (config["hidden_act"] != "gelu", "timm's ViT has exact GELU (\"gelu\") only"),
        "num_channels": (config["num_channels"] != 3, "vitcli feeds RGB images (3)"),
        "patch_size": (not _side(config["patch_size"]), "only square patches"),
        "image_size": (not _side(config["image_size"]), "only square images"),
        "num_attention_heads": (config["hidden_size"] % heads != 0,
                                f"the heads must divide hidden_size {config['hidden_size']}"),
    }
    key = next((k for k, (bad, _) in refused.items() if bad), None)
    if key:
        raise CheckpointError(f"{where}: {key} {json.dumps(config[key])}: {refused[key][1]}")


def _check_types(config: dict, where: Path) -> None:
    """A CheckpointError naming `where`, the first key whose value is not of the type ViTConfig
    declares, what it holds and what it should be (sizes and eps positive too)."""
    for key, kind in TYPES.items():
        value = config.get(key)
        if key == "architectures" and value is None:
            continue
        if not _is_type(value, kind):
            held = json.dumps(value)
            held = f"the string {held}" if isinstance(value, str) else held
            raise CheckpointError(f"{where}: {key} holds {held}, but transformers' ViTConfig "
                                  f"declares {SAID[kind]}")


def _is_type(value, kind: str) -> bool:
    """Whether a config.json value is of ViTConfig's type `kind` (a bool is no int here)."""
    if kind == "int":
        return type(value) is int and value > 0
    if kind == "float":
        return type(value) in (int, float) and value > 0
    if kind == "size":
        parts = value if isinstance(value, list) and len(value) == 2 else [value]
        return all(_is_type(v, "int") for v in parts)
    if kind == "names":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, {"str": str, "bool": bool}[kind])


def _side(size) -> int:
    """A square size's side (an int, or [s, s]); 0 when it is not square."""
    if isinstance(size, int):
        return size
    return size[0] if isinstance(size, list) and len(size) == 2 and size[0] == size[1] else 0


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors by transformers' names: one file, or every shard an index names."""
    if not path.name.endswith(INDEX_SUFFIX):
        return _file_tensors(path)
    weight_map = _weight_map(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or "\\" in shard or not (path.parent / shard).is_file():
            raise CheckpointError(f"{path}: its weight_map names shard {shard}, which is not in "
                                  f"{path.parent}; copy the whole folder")
        tensors.update(_file_tensors(path.parent / shard))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensors its weight_map names are not in "
                              f"their shards ({', '.join(missing[:3])}); copy the folder again")
    return tensors


def shards(path: Path) -> list[Path]:
    """The shard files beside `path` that it indexes (there now); [] for a whole weights file."""
    if not path.name.endswith(INDEX_SUFFIX):
        return []
    try:
        names = sorted(set(_weight_map(path).values()))
    except CheckpointError:
        return []  # refused, with the reason, when read
    return [path.parent / n for n in names if (path.parent / n).is_file()]


def _weight_map(index: Path) -> dict[str, str]:
    """An index's `weight_map` (tensor name -> shard file), or one line saying what is wrong."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{index}: not a transformers shard index (JSON with a weight_map): "
                              f"{first_line(e)}") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: no weight_map of tensor names to shard files, which "
                              "save_pretrained writes into a sharded folder's index")
    return weight_map


def _file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """One weights file; a pickle only through torch's weights-only unpickler."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            as_pickle = "pytorch_model.bin" if path.name == MODEL_FILE else ".bin"
            raise not_safetensors(path, e, as_pickle) from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: not readable as transformers' weights "
                              f"({first_line(e)})") from None


def timm_state_dict(raw: dict[str, torch.Tensor], config: dict, path: Path
                    ) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """transformers' names -> timm's (and load-table rows for what had no place); every tensor is
    used once or named in a row, and anything else is refused."""
    # a ViTModel saves without the prefix
    left = {k.removeprefix("vit."): v for k, v in raw.items()}

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise CheckpointError(f"{path}: no tensor {name}, which a ViT of the config.json beside it "
                                  f"({config['num_hidden_layers']} layers) has")
        return left.pop(name)

    sd = {timm: take(hf.removeprefix("vit.")) for timm, hf in TOP_NAMES.items() if "head" not in timm}
    if "classifier.weight" in left:
        sd.update({"head.weight": take("classifier.weight"), "head.bias": take("classifier.bias")})
    for i in range(config["num_hidden_layers"]):
        sd.update(_block(take, f"encoder.layer.{i}.", f"blocks.{i}.", config["qkv_bias"]))
    notes = _pooler(take, left, config, "head.weight" in sd, sd)
    # ViTModel(use_mask_token=True): masked image modelling only
    if "embeddings.mask_token" in left:
        take("embeddings.mask_token")
        notes.append(("dropped", "embeddings.mask_token (masked image modelling's; no classifier reads it)"))
    if not config["qkv_bias"]:
        notes.append(("filled", "qkv bias zeros (config.json qkv_bias: false; the same network)"))
    if left:
        raise CheckpointError(f"{path}: tensors with no place in a ViT of {config['num_hidden_layers']} "
                              f"layers (config.json): {', '.join(sorted(left)[:3])}")
    return {k: v.contiguous() for k, v in sd.items()}, notes


def _block(take, src: str, dst: str, qkv_bias: bool) -> dict[str, torch.Tensor]:
    """One encoder layer: query, key and value stacked into timm's qkv, weight (3D, D) and bias
    (3D,)."""
    attn = f"{src}attention.attention."
    out = {f"{dst}attn.qkv.weight": torch.cat([take(f"{attn}{n}.weight") for n in QKV])}
    biases = [take(f"{attn}{n}.bias") for n in QKV] if qkv_bias else []
    out[f"{dst}attn.qkv.bias"] = torch.cat(biases) if biases else out[f"{dst}attn.qkv.weight"].new_zeros(
        out[f"{dst}attn.qkv.weight"].shape[0])
    for timm, hf in BLOCK_NAMES.items():
        out.update({f"{dst}{timm}.{p}": take(f"{src}{hf}.{p}") for p in ("weight", "bias")})
    return out


def _pooler(take, left: dict, config: dict, has_head: bool, sd: dict) -> list[tuple[str, str]]:
    """ViTModel's pooler into `sd` as timm's pre-logits (Dense + tanh) when nothing reads past it;
    else dropped. The load-table row that says which."""
    if "pooler.dense.weight" not in left:
        return []
    weight, bias = take("pooler.dense.weight"), take("pooler.dense.bias")  # (R, D), (R,)
    if has_head:
        return [("dropped", "pooler.dense (the classifier reads the class token, not the pooler)")]
    if config["pooler_act"] != "tanh":
        act = config["pooler_act"]
        return [("dropped", f"pooler.dense (pooler_act '{act}'; timm's pre-logits is Dense + tanh)")]
    sd.update({"pre_logits.fc.weight": weight, "pre_logits.fc.bias": bias})
    return [("pre-logits", f"pooler.dense -> pre_logits.fc ({weight.shape[0]} wide, tanh)")]


def _class_names(id2label, head: torch.Tensor | None) -> list[str] | None:
    """id2label as a list over the head's rows; None without a head, for another count, or for
    transformers' LABEL_{i} placeholders (a config that named no classes)."""
    if head is None or not isinstance(id2label, dict) or len(id2label) != head.shape[0]:
        return None
    try:
        names = [str(id2label[str(i)] if str(i) in id2label else id2label[i]) for i in range(head.shape[0])]
    except KeyError:
        return None
    return None if names == [f"LABEL_{i}" for i in range(len(names))] else names
