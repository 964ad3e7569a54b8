"""A plain image folder's rows, as HF's imagefolder builder gives them, listed in seconds and kept.

`datasets.load_dataset(folder)` resolves its data files through fsspec's glob, which walks and stats
the whole tree once for each of the split patterns it tries (57 for ImageNet's layout), then writes
an arrow copy of the paths into HF's cache: about 23 minutes for ImageNet's 1.33M files (958
files/s, and 19 minutes again on every later start), where this module lists them in 2.2 s and
timm's own scan of the train split takes 9.3 s (2 CPU cores, bench/index_scan.py, docs/pretrain.md).
A plain tree,

    ROOT/<class>/<image>             the split `train`
    ROOT/<split>/<class>/<image>     <split> one of HF's split directory names (train, val, test, ...),

is listed (folder_listing.py) with one os.scandir per directory (no stat per file) into the same
Dataset: the same splits, features (image: Image(), label: ClassLabel of the class directories,
sorted), rows in the same order (sorted by path), the same image suffixes (HF's list, lower or upper
case) and the same files left out (hidden ones, others). What HF would read otherwise (metadata
files, a dataset card, deeper or mixed trees, one class, file or directory names that name a split,
archives, ...) raises NotPlain inside and `splits` returns None: reader_folder.py then asks HF's
builder as before. tests/unit/test_folder_index.py holds the two side by side.

The index is one arrow file per folder, `index_file(root)` under `cache_dir()`, never in the folder
itself (often read-only), memory-mapped when read (1.33M rows cost no copy). It records the mtime of
every directory it listed (the root, split and class directories) and is reused while they all
match: adding, removing or renaming a file changes its directory's mtime, so the next start rebuilds
it. Delete the file to force a rebuild. It is written to a temporary name and renamed into place
under a lock, so ranks or runs starting together build it once and never read half of one; where the
cache cannot be written the index lives in memory for the run, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa

from vitcli.data.rows.folder_listing import Listing, NotPlain, scan
from vitcli.runtime.environment import cache_dir  # $VITCLI_CACHE, else XDG's; `vit env` shows it
from vitcli.runtime.files import atomic_path
from vitcli.runtime.metrics import console

FORMAT = 1  # of the file and of folder_listing's rules: an index written under another is rebuilt
# A directory changed this recently may change again within the same mtime tick (coarse on NFS, 2 s
# on FAT): an index listing such a directory is used for this run but not kept.
SETTLE_NS = 2_000_000_000

def index_file(root: Path) -> Path:
    """The index of folder `root`: cache_dir()/folder-index/<its name>-<hash of its absolute
    path>.arrow."""
    root = Path(root).expanduser().resolve()
    key = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return cache_dir() / "folder-index" / f"{root.name[:64] or 'root'}-{key}.arrow"


# --- the index: one arrow table, its splits as row ranges
# --------------------------------------------------


def features(listing: Listing) -> datasets.Features:
    """HF imagefolder's features: the image's {bytes, path} and the label over every class with an
    image."""
    names = sorted({cls for split in listing.splits.values() for cls, images in split.classes if images})
    return datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})


def table(root: Path, listing: Listing) -> tuple[pa.Table, dict[str, list[int]]]:
    """The rows of every split, one after another ({bytes: None, path}, label), and each split's
    [start, stop)."""
    feats = features(listing)
    index = {cls: i for i, cls in enumerate(feats["label"].names)}
    paths, counts, ids, spans = [], [], [], {}
    for name, split in listing.splits.items():
        start, rel = len(paths), (listing.places[name] + "/" if listing.places[name] else "")
        for cls, images in split.classes:
            prefix = f"{root.as_posix()}/{rel}{cls}/"
            paths += [prefix + n for n in images]
            counts.append(len(images))
            ids.append(index.get(cls, 0))  # a class without images here adds no row
        spans[name] = [start, len(paths)]
    path = pa.array(paths, pa.string())
    image = pa.StructArray.from_arrays([pa.nulls(len(path), pa.binary()), path], names=["bytes", "path"])
    label = pa.array(np.repeat(np.asarray(ids, np.int64), counts), pa.int64())
    return pa.table([image, label], schema=feats.arrow_schema), spans


def fingerprint(root: Path, dirs: dict[str, int]) -> str:
    """The index's HF fingerprint: the same for the same folder unchanged (HF keys its caches on
    it)."""
    state = json.dumps([FORMAT, datasets.__version__, str(root), dirs], sort_keys=True)
    return hashlib.sha256(state.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def with_metadata(tab: pa.Table, root: Path, listing: Listing, spans: dict[str, list[int]]) -> pa.Table:
    """`tab` carrying what a later start checks before reusing it (schema metadata, key
    b"vitcli")."""
    hf = json.loads(tab.schema.metadata[b"huggingface"])
    hf["fingerprint"] = fingerprint(root, listing.dirs)
    ours = {"format": FORMAT, "datasets": datasets.__version__, "root": str(root), "splits": spans,
            "dirs": listing.dirs}
    meta = {b"huggingface": json.dumps(hf), b"vitcli": json.dumps(ours, ensure_ascii=False)}
    return tab.replace_schema_metadata(meta)


def write(path: Path, tab: pa.Table) -> None:
    """The table as an arrow stream file (what datasets.Dataset.from_file memory-maps),
    atomically."""
    with (atomic_path(path) as tmp, pa.OSFile(str(tmp), "wb") as sink,
          pa.ipc.new_stream(sink, tab.schema) as writer):
        writer.write_table(tab, max_chunksize=1 << 16)


def split_ranges(ds: datasets.Dataset, spans: dict[str, list[int]]) -> dict[str, datasets.Dataset]:
    """Each split as a contiguous selection of the index: a slice of its table, no indices
    mapping."""
    return {name: ds.select(range(start, stop)) for name, (start, stop) in spans.items()}


# --- reused or built
# ---------------------------------------------------------------------------------------

# the indexes this process said it reuses and the folders it said HF reads: one line each, not one
# per split
_ANNOUNCED: set[Path] = set()


def splits(root: Path) -> dict[str, datasets.Dataset] | None:
    """Every split of folder `root` from its index, reused while the folder is unchanged, else built
    (and kept); None where the folder is not a plain image tree: HF's builder reads it."""
    root = Path(root).expanduser().resolve()
    path = index_file(root)
    # ranks starting together: one builds, the others reuse it
    with exclusive(path.with_suffix(".lock")):
        return reuse(path, root) or build(root, path)


@contextlib.contextmanager
def exclusive(lock: Path):
    """Hold an flock on `lock` for the block; without one where the cache cannot be written or
    locked."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):  # ENOLCK: a file system without locks
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def stored(path: Path, root: Path) -> dict | None:
    """What the index at `path` recorded (its schema metadata), if it is `root`'s under today's
    rules."""
    with pa.memory_map(str(path)) as source:
        ours = json.loads(pa.ipc.open_stream(source).schema.metadata[b"vitcli"])
    recorded = (ours.get("format"), ours.get("datasets"), ours.get("root"))
    return ours if recorded == (FORMAT, datasets.__version__, str(root)) else None


def changed(root: Path, dirs: dict[str, int]) -> str | None:
    """The first recorded directory whose mtime is not the recorded one (or that is gone), else
    None."""
    for rel, mtime_ns in dirs.items():
        try:
            if os.stat(root / rel).st_mtime_ns == mtime_ns:
                continue
        except OSError:
            pass
        return str(root / rel)
    return None


def reuse(path: Path, root: Path) -> dict[str, datasets.Dataset] | None:
    """The index at `path` if the folder is as it recorded; None (to build it) if absent, stale or
    damaged."""
    try:
        ours = stored(path, root)
        stale = changed(root, ours["dirs"]) if ours else "vitcli's index format or the datasets release"
        if stale:
            console.log(f"folder index: {stale} changed since {path} was built; building it again")
            return None
        ds = datasets.Dataset.from_file(str(path))
        if len(ds) != max(stop for _, stop in ours["splits"].values()):
            raise ValueError(f"{len(ds)} rows")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, pa.ArrowException) as e:
        console.log(f"[yellow]warning: folder index {path} is unreadable or damaged ({type(e).__name__}); "
                    "building it again")
        return None
    if path not in _ANNOUNCED:
        _ANNOUNCED.add(path)
        console.log(f"folder index: reused {path} ({len(ds):,} images of {root})")
    return split_ranges(ds, ours["splits"])


def build(root: Path, path: Path) -> dict[str, datasets.Dataset] | None:
    """List the folder and write its index to `path` (in memory where it cannot be kept); None if
    the folder is not a plain image tree."""
    t0, started = time.perf_counter(), time.time_ns()
    try:
        listing = scan(root)
        tab, spans = table(root, listing)
        tab = with_metadata(tab, root, listing, spans)
    # a name that is not UTF-8 cannot be an arrow string
    except (NotPlain, UnicodeEncodeError) as e:
        if root not in _ANNOUNCED:
            _ANNOUNCED.add(root)
            console.log(f"{root} is not a plain image folder ({e}): HF's imagefolder builder reads it")
        return None
    recent = [str(root / rel) for rel, mtime_ns in listing.dirs.items() if mtime_ns > started - SETTLE_NS]
    kept = keep(path, tab, recent)
    _ANNOUNCED.add(path)
    where = f"kept in {path}" if kept else "for this run only"
    console.log(f"folder index: {len(tab):,} images of {root} ({', '.join(spans)}) built in "
                f"{time.perf_counter() - t0:.1f} s, {where}")
    return split_ranges(datasets.Dataset.from_file(str(path)) if kept else datasets.Dataset(tab), spans)


def keep(path: Path, tab: pa.Table, recent: list[str]) -> bool:
    """Write the index to `path`, unless a directory changed too recently to trust its mtime or the
    cache cannot be written (then it is used from memory, with a warning)."""
    if recent:
        console.log(f"folder index not kept: {recent[0]} changed less than {SETTLE_NS / 1e9:.0f} s ago")
        return False
    try:
        write(path, tab)
    except OSError as e:
        console.log(f"[yellow]warning: cannot write the folder index to {path.parent} ({e.strerror or e}); "
                    "it lives in memory for this run (VITCLI_CACHE=DIR puts it elsewhere)")
        return False
    return True
