"""The layout of a workdir's training state: names, discovery, rotation, and the whole-file format.

Layout: `WORKDIR/state-<step>.pt`, each beside its checksum `state-<step>.pt.sha256` (`sha256sum -c
state-500.pt.sha256` checks one by hand); the highest step is the latest checkpoint. A sharded
(FSDP) run writes directories `WORKDIR/state-<step>/` instead (checkpoints.sharded): every rank's
tensors in torch.distributed.checkpoint's files, the rest (step, recipe, data position) in
extra.json and extra.safetensors, and a SHA256SUMS manifest of them all. Both kinds are found,
ordered, rotated and cleared here alike; checkpoints.manager decides which one a run resumes from.

Why files named by their step rather than `state.pt` plus renamed older copies: a checkpoint is
never renamed once written, so a kill at any moment leaves every earlier checkpoint and its checksum
intact. Rotating names would move a good file and its checksum in two renames, and a kill between
them would make it look damaged. A directory appears under its name in one rename, already sealed,
and leaves it the same way (files.remove_dir).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from vitcli.errors import CheckpointError, first_line
from vitcli.runtime import files
from vitcli.runtime.run_dir import state_dir, state_file, states_by_step

# What a checkpoint's parts mean, numbered: 1 added `format` itself (issue 46). A checkpoint without
# one is format 0 (every checkpoint written before), laid out the same way. This vitcli resumes the
# formats in READABLE; any other is refused by name (check_format), never passed over for an older
# checkpoint: a newer format may hold steps and parts this vitcli would lose.
FORMAT = 1
READABLE = (0, 1)
# what the trainer needs back (it saves `data` too; an older checkpoint may hold `rng`, left unread)
STATE_KEYS = ("step", "model", "optimizer", "recipe")
# files.atomic_dir's and remove_dir's temporaries
_STALE_DIR = re.compile(r"\.state-\d+\.[a-z0-9_]{8}\.tmp")


def checkpoint_path(workdir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(workdir) / state_file(step)


def checkpoint_dir(workdir: Path, step: int) -> Path:
    """Where the sharded checkpoint of `step` lives."""
    return Path(workdir) / state_dir(step)


def _at(workdir: Path, step: int) -> list[Path]:
    """The checkpoints of `step`: its directory and/or its file (one of them, unless the strategy
    changed)."""
    folder, file = checkpoint_dir(workdir, step), checkpoint_path(workdir, step)
    return [p for p, ok in ((folder, folder.is_dir()), (file, file.is_file())) if ok]


def _steps(workdir: Path) -> list[int]:
    """Steps that have a checkpoint file or directory (a checksum alone is not one), newest
    first."""
    return [s for s in sorted(states_by_step(workdir), reverse=True) if _at(workdir, s)]


def checkpoints(workdir: Path) -> list[Path]:
    """Checkpoint files and sharded directories, newest step first. A `.state-*.tmp` directory (a
    write that never finished) is never one."""
    return [p for s in _steps(workdir) for p in _at(workdir, s)]


def orphans(workdir: Path) -> list[Path]:
    """Checkpoint files without their checksum: a kill came between the file's rename and its
    checksum's write (save_state writes the checksum last), so the file may be whole, but nothing
    says it is."""
    return [p for p in checkpoints(workdir) if p.is_file() and not files.checksum_path(p).is_file()]


def stale_dirs(workdir: Path) -> list[Path]:
    """Temporary checkpoint directories that a killed sharded save or removal left behind."""
    return [p for p in Path(workdir).glob(".state-*.tmp")
            if _STALE_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]


def remove_stale_dirs(workdir: Path) -> list[Path]:
    """Delete stale_dirs; return them. Call it before the run writes anything
    (as files.remove_stale_temps)."""
    stale = stale_dirs(workdir)
    for path in stale:
        files.remove_dir(path)
    return stale


def state_files(workdir: Path) -> list[Path]:
    """Every file and directory of a previous run's state: what a fresh run sets aside so that
    nothing old looks resumable."""
    return [p for paths in states_by_step(workdir).values() for p in paths] + stale_dirs(workdir)


def _remove(workdir: Path, doomed: Callable[[int], bool]) -> None:
    """Delete the checkpoints (and checksums) of the steps `doomed` picks."""
    for step, paths in states_by_step(workdir).items():
        if doomed(step):
            # the checkpoint before its checksum: never a checksum-less survivor
            for path in sorted(paths):
                if path.is_dir() and not path.is_symlink():
                    files.remove_dir(path)
                else:
                    path.unlink(missing_ok=True)


def discard_from(workdir: Path, step: int) -> None:
    """Delete the checkpoints at `step` and later, before writing the one of `step`.

    They belong to a run abandoned by a fallback or --no-resume; gone before the write, so that
    whatever a kill leaves behind, the newest checkpoint is from this run."""
    _remove(workdir, lambda s: s >= step)


def keep_newest(workdir: Path, keep: int) -> None:
    """Delete all checkpoints but the `keep` newest steps, files and directories alike."""
    kept = set(_steps(workdir)[:keep])
    _remove(workdir, lambda s: s not in kept)


def save_state(path: str | Path, state: dict, fail: Callable[[Path], None] | None = None) -> None:
    """Write a training state (tensors, numbers, strings only, so it loads with weights_only), then
    its checksum beside it as `<name>.sha256`. `fail(tmp)`, given the temporary file once its bytes
    are there: the faults injected into the write (checkpoints.writer.injected)."""
    path = Path(path)
    # Gone first and written last: a kill at any point leaves a state without a checksum (read as
    # incomplete), never a state beside the checksum of another.
    files.checksum_path(path).unlink(missing_ok=True)
    with files.atomic_path(path) as tmp:
        torch.save(state, tmp)
        if fail is not None:
            fail(tmp)
        digest = files.sha256_of(tmp)
    files.write_text(files.checksum_path(path), f"{digest}  {path.name}\n")


def load_state(path: str | Path) -> dict:
    """Read a training state written by `save_state`: the checksum is checked first, and the bytes
    are read with weights_only, so neither damaged bytes nor arbitrary objects are ever
    unpickled."""
    path = Path(path)
    verify_checksum(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError or EOFError
        raise CheckpointError(f"{path}: cannot read training state ({first_line(e, named=True)})") from None


def verify_checksum(path: str | Path) -> None:
    """Raise CheckpointError unless `path` exists and its bytes match the sha256 recorded beside
    it."""
    path, sidecar = Path(path), files.checksum_path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: incomplete, no {sidecar.name} (its write was interrupted)")
    recorded = sidecar.read_text(errors="replace").split()[:1]
    if recorded != [files.sha256_of(path)]:
        raise CheckpointError(f"{path}: damaged, its sha256 differs from the one in {sidecar.name}")


def check_format(path: Path, saved: dict) -> None:
    """Refuse a checkpoint whose format this vitcli cannot read, naming both formats and what to do:
    a newer vitcli wrote it, or one so old that its layout is no longer read."""
    found = saved.get("format", 0)
    if found in READABLE:
        return
    newer = isinstance(found, int) and found > FORMAT
    who = "a newer vitcli: upgrade vitcli" if newer else "an older vitcli: resume with that version"
    raise CheckpointError(f"{path}: checkpoint format {found!r}, written by {who} to continue it "
                          f"(this one reads formats {READABLE[0]}-{READABLE[-1]}), or start over with "
                          "--no-resume or in a new --workdir")


def complete_state(path: Path) -> dict:
    """A checkpoint file that verifies and holds every key the trainer needs, or a
    CheckpointError."""
    state = load_state(path)
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise CheckpointError(f"{path}: not a complete training state (no {', '.join(missing)})")
    return state
