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
HEADER_LENGTH = 8  # a safetensors file: the JSON header's length (u64, little-endian), the header, the data
PICKLE_OR_ZIP = (b"\x80", b"PK\x03\x04")  # how torch.save's files start: a pickle, or its zip archive
MAX_HEADER = 100_000_000  # safetensors' own limit on the header ("header too large" beyond it)


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
        raise not_safetensors(path, e) from None
    return tensors, {k: v if k == "format" else _decode(v) for k, v in raw.items()}


def not_safetensors(path: Path, error: Exception, rename: str = ".pt or .pth") -> CheckpointError:
    """Why safetensors could not read `path`, told from its bytes: empty, a torch.save file under this name
    (`rename`: what to call it instead), cut short (fewer bytes than its header describes), or else
    safetensors' own words."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_LENGTH)
            length = int.from_bytes(head, "little")
            torch_like = head.startswith(PICKLE_OR_ZIP)
            header = b"" if torch_like else f.read(min(length, MAX_HEADER))
    except OSError as e:
        return CheckpointError(f"cannot read {path}: {e.strerror}")
    if size == 0:
        return CheckpointError(f"{path} is empty (0 bytes), not a safetensors file; copy it again")
    if torch_like:
        return CheckpointError(f"{path} is not a safetensors file (it starts like a PyTorch pickle/zip: "
                               f"rename it {rename}, which vit reads weights-only)")
    whole = len(header) == length  # the file holds all the header its first 8 bytes announce
    end = _data_end(header) if whole else None  # (None: not JSON)
    if size < HEADER_LENGTH or (header[:1] == b"{" and length <= MAX_HEADER and (
            not whole or (end is not None and size < HEADER_LENGTH + length + end))):
        held = "" if end is None else f" of the {HEADER_LENGTH + length + end} its header describes"
        return CheckpointError(f"{path} is cut short: {size} bytes{held} (an interrupted copy or "
                               "download?); copy it again")
    why = (str(error).splitlines() or [type(error).__name__])[0]
    return CheckpointError(f"{path}: not a readable safetensors file ({why})")


def _data_end(header: bytes) -> int | None:
    """Where the last tensor's bytes end after the header, by its data_offsets; None if it is no JSON."""
    try:
        entries = json.loads(header)
    except ValueError:
        return None
    if not isinstance(entries, dict):
        return None
    offsets = [v.get("data_offsets") for v in entries.values() if isinstance(v, dict)]
    return max((o[1] for o in offsets if isinstance(o, list) and len(o) == 2 and type(o[1]) is int),
               default=0)


def _decode(value: str) -> object:
    """Our metadata values are JSON; a foreign writer's plain strings are kept as they are."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
