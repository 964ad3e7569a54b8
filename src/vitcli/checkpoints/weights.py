"""Our final weights: safetensors with the recipe and the model spec in its metadata, written
atomically."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from vitcli.errors import CheckpointError, first_line
from vitcli.runtime.files import atomic_path

FORMAT = "vitcli/1"
# a safetensors file: its JSON header's length (u64, little-endian), the header, the tensors' bytes
HEADER_LENGTH = 8
MAX_HEADER = 100_000_000  # safetensors' own limit ("header too large" beyond it)
PICKLE_OR_ZIP = (b"\x80", b"PK\x03\x04")  # how torch.save's files start: a pickle, or a zip


def save_weights(path: str | Path, state_dict: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
    """Write weights as safetensors; `meta` values (recipe, model spec) are stored as JSON
    strings."""
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
    """Why safetensors could not read `path`, told from its bytes: empty, a torch.save file under
    this name (`rename`: what to call it instead), cut short, or else safetensors' own words."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_LENGTH)
            length = int.from_bytes(head, "little")
            # a pickle's one-byte mark is also how a safetensors header of 128 + 256k bytes starts:
            # a pickle's next bytes read as a length beyond any header
            torch_like = head.startswith(PICKLE_OR_ZIP[1]) or (
                head.startswith(PICKLE_OR_ZIP[0]) and length > MAX_HEADER)
            header = b"" if torch_like or length > MAX_HEADER else f.read(length)
    except OSError as e:
        return CheckpointError(f"cannot read {path}: {e.strerror}")
    if size == 0:
        return CheckpointError(f"{path} is empty (0 bytes), not a safetensors file; copy it again")
    if torch_like:
        return CheckpointError(f"{path} is not a safetensors file (it starts like a PyTorch "
                               f"pickle/zip: rename it {rename}, which vit reads weights-only)")
    short = _cut_short(size, length, header)
    if short is not None:
        return CheckpointError(f"{path} is cut short: {size} bytes{short} (an interrupted copy or "
                               "download?); copy it again")
    return CheckpointError(f"{path}: not a readable safetensors file ({first_line(error)})")


def _cut_short(size: int, length: int, header: bytes) -> str | None:
    """None unless a file of `size` bytes, whose header (of `length` announced) starts `header`,
    stops early; then " of the N its header describes" when the header is whole, else ""."""
    if size < HEADER_LENGTH:
        return ""
    if header[:1] != b"{":  # a JSON object, or no safetensors header at all
        return None
    if len(header) < length:
        return ""
    try:
        entries = json.loads(header)
    except ValueError:
        return None
    ends = [v.get("data_offsets") for v in entries.values() if isinstance(v, dict)]
    end = HEADER_LENGTH + length + max((o[1] for o in ends if isinstance(o, list) and len(o) == 2
                                        and type(o[1]) is int), default=0)
    return f" of the {end} its header describes" if size < end else None


def _decode(value: str) -> object:
    """Our metadata values are JSON; a foreign writer's plain strings are kept as they are."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value
