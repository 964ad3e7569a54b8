"""Our own files, written so that no reader ever sees half of one.

Every write goes to a temporary name in the same directory, is fsync'd and renamed into place, so
neither a killed run nor a power cut leaves a half-written file where a later stage would read it. A
checksum can sit beside a file (`<name>.sha256`, `sha256sum` format; checkpoints.state writes one
for each training state). A directory (a sharded checkpoint) is written the same way by
`atomic_dir`: filled under a temporary name, sealed with a SHA256SUMS manifest of every file in it,
fsync'd and renamed into place in one step.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vitcli.errors import CheckpointError

CHECKSUM_SUFFIX = ".sha256"
# in a checkpoint directory; `sha256sum -c SHA256SUMS` inside it checks it by hand
MANIFEST = "SHA256SUMS"
# atomic_path's temporaries: `.<name>.` + mkstemp's 8 random characters + `.tmp`, and nothing else
_TEMP_NAME = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; if the block succeeds, make it durable and rename it
    onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        # before the rename: after a power cut the name must not point at blocks never written
        _fsync(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would hide outputs from the group
        os.replace(tmp, path)
        _fsync(path.parent)  # the rename itself is a change to the directory
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory beside `path` (named as atomic_path's temporaries); if the block
    succeeds, seal it with a MANIFEST of its files' sha256, make it durable and rename it onto
    `path` (which must not exist: a directory cannot replace a non-empty one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        write_manifest(tmp)
        mask = current_umask()
        # every file's bytes, then the directories' entries
        for inner in sorted(tmp.rglob("*"), reverse=True):
            _fsync(inner)
            # as atomic_path: what the umask allows
            os.chmod(inner, (0o777 if inner.is_dir() else 0o666) & ~mask)
        _fsync(tmp)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 would hide the checkpoint from the group
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_dir(path: str | Path) -> None:
    """Delete a directory we wrote. It is first renamed to a temporary name, so that a kill midway
    leaves a stale temporary, never a half-deleted directory under its real name."""
    path = Path(path)
    aside = tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.replace(path, aside)  # onto the empty directory mkdtemp reserved
    shutil.rmtree(aside)


def _fsync(path: str | Path) -> None:
    """Flush a file's (or a directory's) data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (other threads may create
    files)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere it can only be read by setting it, so it is put back at once
    os.umask(mask)
    return mask


def remove_stale_temps(workdir: str | Path) -> list[Path]:
    """Delete the temporaries that killed writes left in `workdir` (atomic_path's own names only);
    return them.

    Call it before the run writes anything: a temporary of a write in progress looks the same.
    """
    stale = [p for p in Path(workdir).glob(".*.tmp")
             if _TEMP_NAME.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def write_text(path: str | Path, text: str) -> None:
    """Atomically write a text file."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def checksum_path(path: str | Path) -> Path:
    """Where the sha256 of `path` is kept: `<name>.sha256` beside it, checkable with `sha256sum
    -c`."""
    path = Path(path)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def sha256_of(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (a ViT-B state with Adam is about 1
    GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: str | Path) -> None:
    """MANIFEST in `directory`: `<sha256>  <relative path>` of every other file in it,
    in `sha256sum` format."""
    directory = Path(directory)
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    lines = [f"{sha256_of(directory / name)}  {name}\n" for name in names if name != MANIFEST]
    (directory / MANIFEST).write_text("".join(lines))


def verify_manifest(directory: str | Path) -> list[str]:
    """The files MANIFEST lists in `directory`, once each has its recorded sha256; else a
    CheckpointError naming the first one that is missing or differs (or the directory, when it has
    no manifest)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not found")
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{directory}: incomplete, no {MANIFEST} (its write was interrupted)")
    listed = [line.split(maxsplit=1) for line in manifest.read_text(errors="replace").splitlines()]
    if any(len(entry) != 2 for entry in listed):
        raise CheckpointError(f"{manifest}: damaged, a line is not `<sha256>  <file>`")
    for digest, name in listed:
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing, but listed in {MANIFEST}")
        if sha256_of(path) != digest:
            raise CheckpointError(f"{path}: damaged, its sha256 differs from the one in {MANIFEST}")
    return [name for _, name in listed]
