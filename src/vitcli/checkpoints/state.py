"""The resumable training state of a workdir: the last `run.keep_checkpoints` checkpoints, and the latest good one.

Layout: `WORKDIR/state-<step>.pt`, each beside its checksum `state-<step>.pt.sha256` (`sha256sum -c
state-500.pt.sha256` checks one by hand); the highest step is the latest checkpoint. A sharded (FSDP) run
writes directories `WORKDIR/state-<step>/` instead (sharding.save): every rank's tensors in
torch.distributed.checkpoint's files, the rest (step, recipe, RNG states, ...) in extra.json and
extra.safetensors, and a SHA256SUMS manifest of them all. Both kinds are found, ordered, checked, rotated and
cleared here alike.

Why files named by their step rather than `state.pt` plus renamed older copies: a checkpoint is never renamed
once written, so a kill at any moment leaves every earlier checkpoint and its checksum intact. Rotating names
would move a good file and its checksum in two renames, and a kill between them would make it look damaged.
A directory appears under its name in one rename, already sealed, and leaves it the same way (files.remove_dir).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vitcli.errors import CheckpointError
from vitcli.runtime import files
from vitcli.runtime.metrics import console

STATE_KEYS = ("step", "model", "optimizer", "rng", "recipe")  # what the trainer saves and needs back
SHARDED_KEYS = ("step", "recipe")  # what a sharded checkpoint's extra part must hold; its tensors are DCP's
EXTRA_JSON, EXTRA_TENSORS = "extra.json", "extra.safetensors"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
SHARDED_FILES = (DCP_METADATA, EXTRA_JSON, EXTRA_TENSORS)  # a sharded checkpoint without one is incomplete
_TENSOR = "__tensor__"  # extra.json's stand-in for a tensor kept in extra.safetensors: {"__tensor__": "t0"}
_NAME = re.compile(r"state-(\d+)(\.pt(\.sha256)?)?")
_STALE_DIR = re.compile(r"\.state-\d+\.[a-z0-9_]{8}\.tmp")  # files.atomic_dir's and remove_dir's temporaries


def checkpoint_path(workdir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(workdir) / f"state-{step}.pt"


def checkpoint_dir(workdir: Path, step: int) -> Path:
    """Where the sharded checkpoint of `step` lives."""
    return Path(workdir) / f"state-{step}"


def _at(workdir: Path, step: int) -> list[Path]:
    """The checkpoints of `step`: its directory and/or its file (one of them, unless the strategy changed)."""
    folder, file = checkpoint_dir(workdir, step), checkpoint_path(workdir, step)
    return [p for p, ok in ((folder, folder.is_dir()), (file, file.is_file())) if ok]


def _by_step(workdir: Path) -> dict[int, list[Path]]:
    """Our checkpoints and checksums in `workdir`, grouped by step."""
    found: dict[int, list[Path]] = {}
    for path in Path(workdir).glob("state-*"):
        match = _NAME.fullmatch(path.name)
        if match:
            found.setdefault(int(match[1]), []).append(path)
    return found


def _steps(workdir: Path) -> list[int]:
    """Steps that have a checkpoint file or directory (a checksum alone is not one), newest first."""
    return [s for s in sorted(_by_step(workdir), reverse=True) if _at(workdir, s)]


def checkpoints(workdir: Path) -> list[Path]:
    """Checkpoint files and sharded directories, newest step first; an older vitcli's `state.pt` last, so it is
    named if nothing else reads. A `.state-*.tmp` directory (a write that never finished) is never one."""
    legacy = Path(workdir) / files.STATE_FILE
    return [p for s in _steps(workdir) for p in _at(workdir, s)] + ([legacy] if legacy.is_file() else [])


def stale_dirs(workdir: Path) -> list[Path]:
    """Temporary checkpoint directories that a killed sharded save or removal left behind."""
    return [p for p in Path(workdir).glob(".state-*.tmp")
            if _STALE_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]


def remove_stale_dirs(workdir: Path) -> list[Path]:
    """Delete stale_dirs; return them. Call it before the run writes anything (as files.remove_stale_temps)."""
    stale = stale_dirs(workdir)
    for path in stale:
        files.remove_dir(path)
    return stale


def state_files(workdir: Path) -> list[Path]:
    """Every file and directory of a previous run's state: what a fresh run sets aside so that nothing old
    looks resumable."""
    legacy = Path(workdir) / files.STATE_FILE
    ours = [p for paths in _by_step(workdir).values() for p in paths]
    return ours + [p for p in (legacy, files.checksum_path(legacy)) if p.exists()] + stale_dirs(workdir)


def _remove(workdir: Path, doomed: Callable[[int], bool]) -> None:
    """Delete the checkpoints (and checksums) of the steps `doomed` picks."""
    for step, paths in _by_step(workdir).items():
        if doomed(step):
            for path in sorted(paths):  # the checkpoint before its checksum: never a checksum-less survivor
                if path.is_dir() and not path.is_symlink():
                    files.remove_dir(path)
                else:
                    path.unlink(missing_ok=True)


def discard_from(workdir: Path, step: int) -> None:
    """Delete the checkpoints at `step` and later, before writing the one of `step`.

    They belong to a run abandoned by a fallback or --no-resume; gone before the write, so that whatever a
    kill leaves behind, the newest checkpoint is from this run."""
    _remove(workdir, lambda s: s >= step)


def keep_newest(workdir: Path, keep: int) -> None:
    """Delete all checkpoints but the `keep` newest steps, files and directories alike."""
    kept = set(_steps(workdir)[:keep])
    _remove(workdir, lambda s: s not in kept)


def save_checkpoint(workdir: Path, state: dict, keep: int) -> Path:
    """Write the checkpoint of state["step"], then delete all but the `keep` newest; return its path."""
    step = int(state["step"])
    discard_from(workdir, step)
    path = checkpoint_path(workdir, step)
    files.save_state(path, state)
    keep_newest(workdir, keep)
    return path


def write_extra(directory: Path, extra: dict) -> None:
    """The non-tensor part of a sharded checkpoint (step, recipe, RNG states, data position), so that reading it
    never unpickles: plain data as extra.json, the tensors in it (RNG byte tensors) in extra.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    plain = _split_tensors(extra, tensors)
    save_file(tensors, str(Path(directory) / EXTRA_TENSORS))
    (Path(directory) / EXTRA_JSON).write_text(json.dumps(plain, indent=1) + "\n")


def _split_tensors(obj, tensors: dict[str, torch.Tensor]):
    """`obj` with each tensor moved into `tensors` under a fresh name and replaced by {_TENSOR: name}."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared storage
        return {_TENSOR: name}
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, tensors) for v in obj]
    return obj


def read_extra(directory: Path) -> dict:
    """What write_extra wrote, tensors back in place; a CheckpointError naming the file it cannot read."""
    directory = Path(directory)
    try:
        tensors = load_file(str(directory / EXTRA_TENSORS))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{directory / EXTRA_TENSORS}: not a readable safetensors file ({e})") from None
    try:
        plain = json.loads((directory / EXTRA_JSON).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory / EXTRA_JSON}: not readable JSON ({e})") from None
    return _join_tensors(plain, tensors, directory)


def _join_tensors(obj, tensors: dict[str, torch.Tensor], directory: Path):
    if isinstance(obj, dict) and set(obj) == {_TENSOR}:
        if obj[_TENSOR] not in tensors:
            raise CheckpointError(f"{directory / EXTRA_TENSORS}: no tensor {obj[_TENSOR]}, which {EXTRA_JSON} names")
        return tensors[obj[_TENSOR]]
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors, directory) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors, directory) for v in obj]
    return obj


def verified_extra(path: Path) -> dict:
    """The extra part of a sharded checkpoint whose manifest verifies and which holds every file and key."""
    listed = files.verify_manifest(path)
    absent = [name for name in SHARDED_FILES if name not in listed]
    if absent:
        raise CheckpointError(f"{path}: not a complete sharded state (no {', '.join(absent)})")
    extra = read_extra(path)
    missing = [k for k in SHARDED_KEYS if k not in extra]
    if missing:
        raise CheckpointError(f"{path}: not a complete training state (no {', '.join(missing)} in {EXTRA_JSON})")
    return extra


def _load_complete(path: Path) -> dict:
    """A checkpoint that verifies and holds every key the trainer needs, or a CheckpointError naming it.

    An older vitcli's state.pt has no checksum; it was written by an atomic rename too, so it is whole, and it
    is read unverified (with a warning) rather than turning an upgrade into an error."""
    if path.is_dir():
        return verified_extra(path)
    legacy = path.name == files.STATE_FILE
    if legacy:
        console.log(f"[yellow]warning: {path} was written by an older vitcli, without a checksum; read unverified")
    state = files.load_state(path, verify=not legacy)
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise CheckpointError(f"{path}: not a complete training state (no {', '.join(missing)})")
    return state


def latest_good_state(workdir: Path, verbose: bool = True) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies and is complete, as (path, state); None when there is none at all.

    For a file `state-<step>.pt`, state is all of it (STATE_KEYS). For a directory `state-<step>/` (a sharded
    run), state is only its extra part, the dict the run gave sharding.save (SHARDED_KEYS at least, RNG byte
    tensors as tensors), read without unpickling; the model and optimizer tensors stay on disk until
    sharding.load(path, model, optimizer) reads them into the live, already sharded model (`path.is_dir()`
    tells the two apart). Either is checked against its checksums first.

    Each newer one skipped is named in a warning (if `verbose`); if none is usable, a CheckpointError names them.
    """
    failures = []
    for path in checkpoints(workdir):
        try:
            state = _load_complete(path)
        except CheckpointError as e:
            failures.append(str(e))
            continue
        for failure in failures if verbose else []:
            console.log(f"[yellow]warning: {failure}; resuming from {path.name} instead")
        return path, state
    if failures:
        raise CheckpointError(f"no usable checkpoint in {workdir}: {'; '.join(failures)}; --no-resume starts over")
    return None
