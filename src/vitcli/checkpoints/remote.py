"""Checkpoints mirrored to object storage: run.ckpt_dir, an fsspec URI (s3://bucket/prefix,
gs://..., file:///..., or a plain path) that holds a copy of the newest run.keep_checkpoints
checkpoints.

The workdir stays a local path and the checkpoints are written there first, as without a mirror
(Composer's RemoteUploaderDownloader does the same: save locally, then upload): a local write is
atomic and fast, and resume, the finished-run rules and the SLURM requeue rule keep reading a POSIX
directory. Each finished checkpoint is then uploaded, its data first and its checksum object last:
an object store has no rename, so a checkpoint there counts only once its checksum object exists
(`state-<step>.pt.sha256` beside `state-<step>.pt`, `SHA256SUMS` inside `state-<step>/`), and it is
used only once the downloaded bytes match it. A remote checkpoint is removed in the opposite order
(the checksum first), so no interrupted upload or deletion ever looks complete.

`Mirror.upload` is one call, made on rank 0 once a checkpoint is in place (it may run in a writer
thread): it brings the remote in line with the workdir's newest checkpoints, uploading every one the
remote lacks (so an upload that failed catches up at the next), removing the remote's newer ones
(another branch of the run: a fallback's or a rollback's) and the ones past the local retention. A
store that went away is retried with backoff; if it still fails, a warning, and the run goes on:
the local checkpoint is intact. `Mirror.fetch_newer` is resume's side: the remote's newest complete
checkpoint newer than the workdir's, downloaded and verified into the workdir (a node's local disk
lost with the node, a requeue on another node); incomplete or damaged ones are skipped, named.

Endpoints and credentials are fsspec's and the store library's own: for S3, AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL (or FSSPEC_S3_ENDPOINT_URL) for a store that is not AWS, and
botocore's own retries (AWS_MAX_ATTEMPTS) inside each of ours. s3fs, gcsfs and their clients are
imported by fsspec when a URI names them, never by a run without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem

from vitcli.errors import CheckpointError, first_line
from vitcli.recipe.schema import Recipe
from vitcli.runtime import faults, files
from vitcli.runtime.metrics import console
from vitcli.runtime.run_dir import states_by_step

# an upload's tries, and the wait before the second (doubled before each next): 2 + 4 s
ATTEMPTS, BACKOFF_S = 3, 2.0
# written and removed at start: the store is there, and these credentials may write and delete in it
# (what uploads and retention need), as Composer's `.credentials_validated_successfully`
PROBE = ".vitcli-write-check"
# a remote object's name below the root: `state-<step>.pt[.sha256]`, or `state-<step>/<file>`
_OBJECT = re.compile(r"(state-(\d+)\.pt)(\.sha256)?|(state-(\d+))/.+")


@dataclass
class Entry:
    """One checkpoint on the remote: its name (`state-<step>.pt` or `state-<step>`), its objects
    relative to the root, and whether its checksum object is there."""

    name: str
    step: int
    objects: list[str] = field(default_factory=list)

    @property
    def checksum(self) -> str:
        """The object that completes it, uploaded last."""
        if self.is_dir:
            return f"{self.name}/{files.MANIFEST}"
        return f"{self.name}{files.CHECKSUM_SUFFIX}"

    @property
    def is_dir(self) -> bool:
        return not self.name.endswith(".pt")

    @property
    def complete(self) -> bool:
        """Its checksum object is there (and a file's data object beside it)."""
        return self.checksum in self.objects and (self.is_dir or self.name in self.objects)


def below(recipe: Recipe, name: str) -> Recipe:
    """The recipe of one of several runs a command trains in WORKDIR/<name> (a sweep's point, a VTAB
    task): its run.ckpt_dir, if set, becomes <ckpt_dir>/<name>, so that no two runs share one (each
    would take the other's checkpoints for another branch of its own, and remove them)."""
    if not recipe.run.ckpt_dir:
        return recipe
    uri = f"{recipe.run.ckpt_dir.rstrip('/')}/{name}"
    return dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, ckpt_dir=uri))


def checksum_of(path: Path) -> Path:
    """The local file that completes a checkpoint: its sidecar, or a directory's manifest."""
    return path / files.MANIFEST if path.is_dir() else files.checksum_path(path)


def local_checkpoints(workdir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the workdir's complete checkpoints (beside their checksum, or sealed by their
    manifest), newest first; nothing is read."""
    found = [(step, p) for step, paths in states_by_step(workdir).items() for p in paths
             if not p.name.endswith(files.CHECKSUM_SUFFIX) and checksum_of(p).is_file()]
    return sorted(found, key=lambda found: found[0], reverse=True)


class Mirror:
    """The remote copy of a run's checkpoints under `uri`, keeping the `keep` newest."""

    def __init__(self, uri: str, keep: int = 1):
        self.uri, self.keep = uri.rstrip("/"), keep
        try:  # a fresh client: fsspec's cached one may point at an endpoint since changed
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, skip_instance_cache=True)
        except (ValueError, ImportError) as e:  # an unknown protocol, its library not installed
            raise CheckpointError(f"run.ckpt_dir={uri}: {first_line(e)}") from None
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)  # folders to make; a bucket has none
        # A store that drops a connection mid-request leaves aiohttp's own write task failed, and
        # asyncio prints its traceback ("Task exception was never retrieved") from fsspec's loop
        # thread, after s3fs has already seen the error and we retry or warn: one line says it all
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    def where(self, name: str) -> str:
        """A remote object's URI, for messages."""
        return f"{self.uri}/{name}"

    def check(self) -> None:
        """Before anything is trained: one line naming the URI and the error unless a small object
        can be written and removed there (the bucket exists, the credentials may write and delete,
        the server answers)."""
        try:
            self._put_bytes(PROBE, b"vitcli checks it may write here\n")
            self.fs.rm_file(f"{self.root}/{PROBE}")
        except Exception as e:  # noqa: BLE001 - each store its own errors (botocore's: no OSError)
            raise CheckpointError(f"run.ckpt_dir={self.uri}: cannot write there "
                                  f"({first_line(e, named=True)}); check the bucket, the "
                                  "credentials and the endpoint (AWS_ENDPOINT_URL for a store "
                                  "that is not AWS)") from None

    def entries(self) -> dict[str, Entry]:
        """The remote's checkpoints by name, listed afresh (another process may have changed it)."""
        self.fs.invalidate_cache()
        found: dict[str, Entry] = {}
        prefix = f"{self.root}/"
        for path in self.fs.find(self.root):
            match = _OBJECT.fullmatch(path.removeprefix(prefix))
            if match:
                name, step = (match[1], match[2]) if match[1] else (match[4], match[5])
                found.setdefault(name, Entry(name, int(step))).objects.append(match[0])
        return found

    def upload(self, path: Path) -> bool:
        """Mirror the workdir of the checkpoint `path` (just written, its newest): `sync`, tried
        ATTEMPTS times with backoff. False, after a warning, when the store stays unreachable: the
        run goes on (the local checkpoint is intact) and the next upload catches up."""
        for attempt in range(ATTEMPTS):
            try:
                self.sync(Path(path).parent)
                return True
            except Exception as e:  # noqa: BLE001 - a store that went away must not kill the run
                error = first_line(e, named=True)
            if attempt + 1 < ATTEMPTS:
                time.sleep(BACKOFF_S * 2 ** attempt)
        console.log(f"[yellow]warning: could not upload {Path(path).name} to {self.uri} after "
                    f"{ATTEMPTS} tries ({error}); the local checkpoint is intact, the next upload "
                    "catches up")
        return False

    def sync(self, workdir: Path) -> None:
        """The remote made to hold the workdir's `keep` newest complete checkpoints: newer remote
        ones (another branch of the run) removed first, then each missing or different one uploaded,
        newest first, then the ones past retention removed."""
        local = local_checkpoints(workdir)[: self.keep]
        if not local:  # nothing here to stand for what the store holds: it is left as it is
            return
        remote, kept, newest = self.entries(), {p.name for _, p in local}, local[0][0]
        stale = [e for e in remote.values() if e.name not in kept]
        for entry in (e for e in stale if e.step >= newest):
            self._remove(entry)
        for step, path in local:
            if not self._holds(remote.get(path.name), path):
                self._upload_one(step, path, remote.get(path.name))
        for entry in (e for e in stale if e.step < newest):
            self._remove(entry)

    def _holds(self, entry: Entry | None, path: Path) -> bool:
        """Whether the remote holds this very checkpoint: complete, with the same checksum."""
        if entry is None or not entry.complete:
            return False
        return self.fs.cat_file(f"{self.root}/{entry.checksum}") == checksum_of(path).read_bytes()

    def _upload_one(self, step: int, path: Path, old: Entry | None) -> None:
        """One checkpoint: whatever the remote had under its name goes first, then the data, then
        the checksum object (the `store` fault strikes between them, as a store going away)."""
        if old is not None:
            self._remove(old)
        checksum = checksum_of(path)
        data = ([path] if not path.is_dir() else
                sorted(p for p in path.rglob("*") if p.is_file() and p != checksum))
        for file in data:
            self._put(file, file.relative_to(path.parent).as_posix())
        if faults.armed("store", step, 0, path.parent):
            raise ConnectionError(f"injected: the object store went away before {checksum.name}")
        self._put(checksum, checksum.relative_to(path.parent).as_posix())

    def _remove(self, entry: Entry) -> None:
        """A remote checkpoint, its checksum object first: never a checksum beside partial data."""
        for name in sorted(entry.objects, key=lambda name: name != entry.checksum):
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(f"{self.root}/{name}")

    def _put(self, file: Path, name: str) -> None:
        self._folder_of(name)
        self.fs.put_file(str(file), f"{self.root}/{name}")

    def _put_bytes(self, name: str, data: bytes) -> None:
        self._folder_of(name)
        self.fs.pipe_file(f"{self.root}/{name}", data)

    def _folder_of(self, name: str) -> None:
        """The folder an object `name` goes into, on a file system (an object store has none)."""
        if self.local:
            self.fs.makedirs(f"{self.root}/{name}".rsplit("/", 1)[0], exist_ok=True)

    def fetch_newer(self, workdir: Path, than: int) -> Path | None:
        """The remote's newest complete checkpoint of a step after `than`, downloaded into the
        workdir and verified against its checksum object; the incomplete and damaged ones newer
        than it are skipped, each named in a warning. None when the remote has none to give."""
        for entry in sorted(self.entries().values(), key=lambda e: e.step, reverse=True):
            if entry.step <= than:
                break
            if not entry.complete:
                console.log(f"[yellow]warning: {self.where(entry.name)}: incomplete, no "
                            f"{entry.checksum} (its upload was interrupted); skipped")
                continue
            try:
                fetched = self._download(entry, Path(workdir) / entry.name)
            except CheckpointError as e:
                console.log(f"[yellow]warning: {e}; skipped")
                continue
            newest = f"state-{than}" if than else "none"
            console.log(f"fetched {entry.name} from {self.uri}: newer than the workdir's newest ({newest})")
            return fetched
        return None

    def _download(self, entry: Entry, target: Path) -> Path:
        """`entry` into `target` (one rename, as the workdir's own writes), its bytes checked
        against its checksum object before they get the checkpoint's name."""
        try:
            (self._download_dir if entry.is_dir else self._download_file)(entry, target)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's own errors, each its own type
            raise CheckpointError(f"{self.where(entry.name)}: cannot download "
                                  f"({first_line(e, named=True)})") from None
        return target

    def _download_file(self, entry: Entry, target: Path) -> None:
        recorded = self.fs.cat_file(f"{self.root}/{entry.checksum}").decode(errors="replace")
        with files.atomic_path(target) as tmp:
            self._get(entry.name, tmp)
            if recorded.split()[:1] != [files.sha256_of(tmp)]:
                raise CheckpointError(f"{self.where(entry.name)}: damaged, its sha256 differs "
                                      f"from the one in {entry.checksum}")
        files.write_text(files.checksum_path(target), recorded)  # last, as checkpoints.state writes

    def _download_dir(self, entry: Entry, target: Path) -> None:
        with files.atomic_dir(target) as tmp:  # sealed again by its own manifest, the same lines
            for name in entry.objects:
                self._get(name, tmp / name.removeprefix(f"{entry.name}/"))
            try:
                files.verify_manifest(tmp)
            except CheckpointError as e:  # named by its URI, not by the temporary download
                raise CheckpointError(str(e).replace(str(tmp), self.where(entry.name))) from None

    def _get(self, name: str, local: Path) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        self.fs.get_file(f"{self.root}/{name}", str(local))

    def set_aside(self) -> str | None:
        """A fresh run's start: the remote's checkpoints (an earlier run's) moved into
        `previous-<time>/` beside them, checksums first, so that none is resumed by mistake. Where
        they went, or None when there were none."""
        try:
            found = self.entries()
            if not found:
                return None
            names = {n.removeprefix(f"{self.root}/") for n in self.fs.ls(self.root, detail=False)}
            stamp = time.strftime("%Y%m%d-%H%M%S")
            kept = next(name for n in itertools.count()
                        if (name := f"previous-{stamp}{f'-{n}' if n else ''}") not in names)
            for entry in found.values():
                for name in sorted(entry.objects, key=lambda name: name != entry.checksum):
                    self._folder_of(f"{kept}/{name}")
                    self.fs.mv(f"{self.root}/{name}", f"{self.root}/{kept}/{name}")
        except Exception as e:  # noqa: BLE001 - the store's own errors, each its own type
            raise CheckpointError(f"run.ckpt_dir={self.uri}: cannot set the previous run's "
                                  f"checkpoints aside ({first_line(e, named=True)})") from None
        console.log(f"the previous run's checkpoints in {self.uri} are kept in {self.where(kept)}")
        return self.where(kept)

