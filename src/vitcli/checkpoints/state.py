"""The resumable training state of a workdir: the last `run.keep_checkpoints` checkpoints, and the latest good one.

Layout: `WORKDIR/state-<step>.pt`, each beside its checksum `state-<step>.pt.sha256` (`sha256sum -c
state-500.pt.sha256` checks one by hand); the highest step is the latest checkpoint.

Why files named by their step rather than `state.pt` plus renamed older copies: a checkpoint is never renamed
once written, so a kill at any moment leaves every earlier checkpoint and its checksum intact. Rotating names
would move a good file and its checksum in two renames, and a kill between them would make it look damaged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from vitcli.checkpoints import files
from vitcli.errors import CheckpointError
from vitcli.metrics import console

STATE_KEYS = ("step", "model", "optimizer", "rng", "recipe")  # what the trainer saves and needs back
_NAME = re.compile(r"state-(\d+)\.pt(\.sha256)?")


def checkpoint_path(workdir: Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(workdir) / f"state-{step}.pt"


def _by_step(workdir: Path) -> dict[int, list[Path]]:
    """Our checkpoints and checksums in `workdir`, grouped by step."""
    found: dict[int, list[Path]] = {}
    for path in Path(workdir).glob("state-*"):
        match = _NAME.fullmatch(path.name)
        if match:
            found.setdefault(int(match[1]), []).append(path)
    return found


def _steps(workdir: Path) -> list[int]:
    """Steps that have a checkpoint file (a checksum alone is not one), newest first."""
    return [s for s in sorted(_by_step(workdir), reverse=True) if checkpoint_path(workdir, s).is_file()]


def checkpoints(workdir: Path) -> list[Path]:
    """Checkpoint files, newest first; an older vitcli's `state.pt` last, so it is named if nothing else reads."""
    legacy = Path(workdir) / files.STATE_FILE
    return [checkpoint_path(workdir, s) for s in _steps(workdir)] + ([legacy] if legacy.is_file() else [])


def state_files(workdir: Path) -> list[Path]:
    """Every file of a previous run's state: what a fresh run deletes so that nothing old looks resumable."""
    legacy = Path(workdir) / files.STATE_FILE
    ours = [p for paths in _by_step(workdir).values() for p in paths]
    return ours + [p for p in (legacy, files.checksum_path(legacy)) if p.exists()]


def _remove(workdir: Path, doomed: Callable[[int], bool]) -> None:
    """Delete the checkpoints (and checksums) of the steps `doomed` picks."""
    for step, paths in _by_step(workdir).items():
        if doomed(step):
            for path in sorted(paths):  # the checkpoint before its checksum: never a checksum-less survivor
                path.unlink(missing_ok=True)


def save_checkpoint(workdir: Path, state: dict, keep: int) -> Path:
    """Write the checkpoint of state["step"], then delete all but the `keep` newest; return its path."""
    step = int(state["step"])
    # A checkpoint at this step or later belongs to a run abandoned by a fallback or --no-resume; gone before the
    # write, so that whatever a kill leaves behind, the newest checkpoint is from this run.
    _remove(workdir, lambda s: s >= step)
    path = checkpoint_path(workdir, step)
    files.save_state(path, state)
    kept = set(_steps(workdir)[:keep])
    _remove(workdir, lambda s: s not in kept)
    return path


def _load_complete(path: Path) -> dict:
    """A checkpoint that verifies and holds every key the trainer needs, or a CheckpointError naming it.

    An older vitcli's state.pt has no checksum; it was written by an atomic rename too, so it is whole, and it
    is read unverified (with a warning) rather than turning an upgrade into an error."""
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
