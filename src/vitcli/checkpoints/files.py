"""Our own files: final weights as safetensors with the recipe in metadata, resumable training state.

Every write goes to a temporary name in the same directory and is renamed into place, so an interrupted run
never leaves a half-written file where a later stage would read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vitcli.errors import CheckpointError

FORMAT = "vitcli/1"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text(path: str | Path, text: str) -> None:
    """Atomically write a text file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


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


def save_state(path: str | Path, state: dict) -> None:
    """Write the resumable training state (tensors, numbers, strings only, so it loads with weights_only)."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_state(path: str | Path) -> dict:
    """Read a training state written by `save_state`, never unpickling arbitrary objects."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError or EOFError
        raise CheckpointError(f"{path}: cannot read training state ({type(e).__name__}: {e})") from None
