"""Our final weights: safetensors with the recipe and the model spec in its metadata, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vitcli.errors import CheckpointError
from vitcli.runtime.files import atomic_path

FORMAT = "vitcli/1"


def save_weights(path: str | Path, state_dict: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
    """Write weights as safetensors; `meta` values (recipe, model spec) are stored as JSON strings."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    metadata = {"format": FORMAT, **{k: json.dumps(v) for k, v in meta.items()}}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def load_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Read a safetensors file; returns (state_dict, metadata) with our JSON metadata decoded."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    return tensors, {k: v if k == "format" else _decode(v) for k, v in raw.items()}


def _decode(value: str) -> object:
    """Our metadata values are JSON; a foreign writer's plain strings are kept as they are."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
