"""A plain image folder's rows, as HF's imagefolder builder gives them, listed in seconds and kept.

`datasets.load_dataset(folder)` resolves its data files through fsspec's glob, which walks and stats
the whole tree once for each of the split patterns it tries (57 for ImageNet's layout), then writes
an arrow copy of the paths into HF's cache: about 23 minutes for ImageNet's 1.33M files (958
files/s, and 19 minutes again on every later start), where this module lists them in 2.2 s and
timm's own scan of the train split takes 9.3 s (2 CPU cores, bench/index_scan.py, docs/pretrain.md).
A plain tree,

    ROOT/<class>/<image>             the split `train`
    ROOT/<split>/<class>/<image>     <split> one of HF's split directory names (train, val, test, ...),

is listed here with one os.scandir per directory (no stat per file) into the same Dataset: the same
splits, features (image: Image(), label: ClassLabel of the class directories, sorted), rows in the
same order (sorted by path), the same image suffixes (HF's list, lower or upper case) and the same
files left out (hidden ones, others). What HF would read otherwise (metadata files, a dataset card,
deeper or mixed trees, one class, file or directory names that name a split, archives, ...) raises
NotPlain inside and `splits` returns None: reader_folder.py then asks HF's builder as before.
tests/unit/test_folder_index.py holds the two side by side.

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
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
from datasets import config as hf_config
from datasets.data_files import FILES_TO_IGNORE, NON_WORDS_CHARS, SPLIT_KEYWORDS
from datasets.packaged_modules.audiofolder.audiofolder import AudioFolder
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder
from datasets.packaged_modules.meshfolder.meshfolder import MeshFolder
from datasets.packaged_modules.niftifolder.niftifolder import NiftiFolder
from datasets.packaged_modules.pdb.pdb import PdbFolder
from datasets.packaged_modules.pdffolder.pdffolder import PdfFolder
from datasets.packaged_modules.videofolder.videofolder import VideoFolder

from vitcli.errors import DataError
from vitcli.runtime.files import atomic_path
from vitcli.runtime.metrics import console

FORMAT = 1  # of the file and of the rules below: an index written under another is rebuilt
# A directory changed this recently may change again within the same mtime tick (coarse on NFS, 2 s
# on FAT): an index listing such a directory is used for this run but not kept.
SETTLE_NS = 2_000_000_000

# --- what HF's imagefolder builder reads (datasets.data_files, datasets.packaged_modules), as rules
# here --- "val": "validation"
SPLIT_OF_DIR = {kw: str(split) for split, kws in SPLIT_KEYWORDS.items() for kw in kws}
SPLIT_ORDER = [str(split) for split in SPLIT_KEYWORDS]  # HF lists the splits it finds in this order
_LOWER_IMAGE_SUFFIXES = frozenset(ImageFolder.EXTENSIONS)  # .jpg, .png, ... (61 of them)
# an image's suffix without its dot: HF's list in lower or upper case (x.JPEG, not x.Jpeg: HF skips
# that file)
IMAGE_SUFFIXES = frozenset(word for s in _LOWER_IMAGE_SUFFIXES for word in (s[1:], s[1:].upper()))
# The suffixes HF's builder inference counts as data (a file with none of them is no data file to
# HF). HF keeps its table private (datasets.packaged_modules._ALL_ALLOWED_EXTENSIONS) and builds it
# as here: each folder builder's public EXTENSIONS in lower and upper case, and the suffixes of each
# other builder (csv, json, parquet, text, webdataset, ...; lance's metadata files).
# tests/unit/test_folder_index.py holds it against the installed release's, so that a release adding
# a builder is noticed.
_FOLDER_BUILDERS = (PdbFolder, ImageFolder, AudioFolder, VideoFolder, MeshFolder, PdfFolder, NiftiFolder)
_OTHER_DATA_SUFFIXES = (
    ".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".parquet", ".geoparquet", ".gpq", ".arrow", ".txt",
    ".conll", ".conllu", ".tar", ".xml", ".hdf5", ".h5", ".eval", ".toml", ".md", ".lance", ".tsfile",
    ".vortex", ".fa", ".fasta", ".fna", ".ffn", ".faa", ".frn", ".afa", ".gb", ".gbk", ".genbank", ".fq",
    ".fastq", ".cif", ".mmcif", ".zip", ".idx", ".txn", ".manifest")
# suffix -> the folder builder that reads it: a later one wins a suffix two claim (.mpg: video, not
# image)
_FOLDER_OF = {case: b for b in _FOLDER_BUILDERS for s in b.EXTENSIONS for case in (s, s.upper())}
_DATA_SUFFIXES = frozenset(_OTHER_DATA_SUFFIXES) | set(_FOLDER_OF)
# what imagefolder keeps of a folder's data files: the images it reads, either case, and archives
_IMAGEFOLDER_SUFFIXES = (*(s for s, builder in _FOLDER_OF.items() if builder is ImageFolder), ".zip")
_KEYWORDS = "|".join(sorted(SPLIT_OF_DIR, key=len, reverse=True))
_SEP = f"[{NON_WORDS_CHARS}]"
# a directory HF's split patterns (**/val/**, **/val[-._ 0-9]*/**, **/*[-._ 0-9]val/**, ...) would
# match
_SPLIT_IN_DIR_NAME = re.compile(rf"(?:^|{_SEP})(?:{_KEYWORDS})(?:{_SEP}|$)")
# a file name its split patterns (**/val[-._ 0-9]*, **/*[-._ 0-9]val[-._ 0-9]*) would, in "/"-joined
# names
_SPLIT_IN_FILE_NAME = re.compile(rf"(?<=[{NON_WORDS_CHARS}/])(?:{_KEYWORDS}){_SEP}")
# every keyword holds one of these: str.find for them, then the regex where one is, takes 0.08 s
# over 1.28M ImageNet names, one regex search over them 0.67 s
_SPLIT_WORDS = ("train", "val", "dev", "test", "eval")
# file names that make HF read another layout (its `logs` and `harbor` patterns) and card files at
# the root
_OTHER_LAYOUT_NAMES = ("/task.toml/", "/instruction.md/", ".eval/")
_ROOT_CARDS = (hf_config.REPOCARD_FILENAME, hf_config.REPOYAML_FILENAME, hf_config.DATASETDICT_INFOS_FILENAME)
# the filter HF applies to a folder's data files once it has chosen imagefolder
# (DataFilesList.filter)
_KEPT_BY_HF = re.compile(
    ".*(" + "|".join(map(re.escape, _IMAGEFOLDER_SUFFIXES)) + r")(\..+)?$")
_METADATA_NAME = re.compile(r".*[\/]?(" + "|".join(map(re.escape, ImageFolder.METADATA_FILENAMES)) + ")$")


class NotPlain(Exception):
    """The folder is not a plain image tree: HF's builder reads it (the message says why)."""


def cache_dir() -> Path:
    """Where vitcli keeps what it derives from data: $VITCLI_CACHE, else $XDG_CACHE_HOME/vitcli,
    else ~/.cache/vitcli."""
    if os.environ.get("VITCLI_CACHE"):
        return Path(os.environ["VITCLI_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vitcli"


def index_file(root: Path) -> Path:
    """The index of folder `root`: cache_dir()/folder-index/<its name>-<hash of its absolute
    path>.arrow."""
    root = Path(root).expanduser().resolve()
    key = hashlib.sha256(str(root).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return cache_dir() / "folder-index" / f"{root.name[:64] or 'root'}-{key}.arrow"


# --- listing
# -------------------------------------------------------------------------------------------


@dataclass
class Listed:
    """One directory: its mtime (taken before listing it), visible subdirectories and files,
    sorted."""

    mtime_ns: int
    dirs: list[str]
    files: list[str]
    broken: list[str] = field(default_factory=list)  # links to nothing, by path


def check_links(listed: Listed) -> None:
    """A broken link where class (or split) directories live is refused: HF's glob, like os.scandir,
    sees nothing there, so the class would vanish and every class sorted after it take another label
    id, without a word (a checkpoint's head then reads its classes shifted)."""
    if listed.broken:
        path = listed.broken[0]
        raise DataError(f"{path} is a broken link (to {os.readlink(path)}): its class would be left out and "
                        "the classes after it renumbered; restore its target, or remove the link")


def list_dir(path: Path) -> Listed:
    """`path`'s entries from one os.scandir: its d_type tells files from directories without a stat
    each (a link to a file counts as a file; a broken link is listed apart, check_links).
    Directories HF skips (hidden, __special__) are left out; a link to a directory, which HF's glob
    does not follow, is NotPlain."""
    # first: a file added while we list shows as a newer mtime next time
    mtime = os.stat(path).st_mtime_ns
    with os.scandir(path) as it:
        entries = list(it)
    files = [e.name for e in entries if e.is_file()]
    dirs, broken = [], []
    if len(files) < len(entries):  # not only files: look at the others
        dirs = [e for e in entries if not e.name.startswith((".", "__")) and e.is_dir()]
        broken = [e.path for e in entries if e.is_symlink() and not e.is_dir() and not e.is_file()]
    linked = [e.path for e in dirs if e.is_symlink()]
    if linked:
        raise NotPlain(f"{linked[0]} is a link to a directory")
    return Listed(mtime, sorted(e.name for e in dirs), sorted(files), sorted(broken))


def images_in(files: list[str]) -> list[str]:
    """The names (sorted as `files`) HF reads as images: one suffix, from its list, lower or upper
    case."""
    # partition: everything after the first dot, so "a.b.jpg" is no plain image; 0.8 s for 1.28M
    # names, 1.2 with rfind and count
    return [n for n in files if n.partition(".")[2] in IMAGE_SUFFIXES and n[0] != "."]


def other_suffixes(path: str, name: str) -> list[str]:
    """What a file that is not a plain image adds to HF's count of suffixes (it picks the builder
    from the commonest one): nothing for a file HF skips (hidden, no data suffix in its exact case,
    README.md...); its lower-cased suffixes for a data file imagefolder drops (a .txt, a .csv).
    NotPlain where imagefolder would read it: an image with several suffixes, an archive, a metadata
    file."""
    suffixes = name.split(".")[1:]
    data = any(f".{s}" in _DATA_SUFFIXES for s in suffixes)
    if name.startswith(".") or name in FILES_TO_IGNORE or not data:
        return []
    lower = [f".{s.lower()}" for s in suffixes]
    read = set(lower) & (_LOWER_IMAGE_SUFFIXES | {".zip"}) or _METADATA_NAME.match(path)
    if read or _KEPT_BY_HF.match(path):
        raise NotPlain(f"HF's imagefolder reads {path} (an archive, a metadata file or an image's name)")
    return lower


@dataclass
class Split:
    """One split's listing: (class, its image names) in path order, and what its other files
    count."""

    classes: list[tuple[str, list[str]]] = field(default_factory=list)
    other: Counter = field(default_factory=Counter)
    names: list[str] = field(default_factory=list)  # every visible file name, for the name checks


@dataclass
class Listing:
    """A plain folder: its splits in HF's order and every directory listed, relative path ->
    mtime."""

    splits: dict[str, Split]
    places: dict[str, str]  # split -> its directory under the root ("": the root holds the classes)
    dirs: dict[str, int]


def layout(root: Listed) -> dict[str, str]:
    """split -> its directory under the root ("" when the root holds the classes of the one
    split)."""
    if any(name in root.files for name in _ROOT_CARDS):
        raise NotPlain("it has a dataset card (README.md, .huggingface.yaml or dataset_infos.json)")
    named = [d for d in root.dirs if d in SPLIT_OF_DIR]
    if not named:
        if "data" in root.dirs:  # HF's data/<split>-00000-of-00001.* shard names
            raise NotPlain("a directory 'data' at its root (HF's data/<split>-00000-of-00001.* shards)")
        return {"train": ""}
    if len(named) < len(root.dirs):
        raise NotPlain(f"its root holds split directories ({', '.join(named)}) and others")
    splits = {SPLIT_OF_DIR[d]: d for d in named}
    if len(splits) < len(named):
        raise NotPlain(f"two directories for one split among {', '.join(named)}")
    return {s: splits[s] for s in SPLIT_ORDER if s in splits}


def list_split(root: Path, rel: str, top: Listed, dirs: dict[str, int]) -> Split:
    """One split directory (`top`, listed already) and its class directories; their mtimes into
    `dirs`."""
    split, base = Split(), root / rel
    if images_in(top.files):
        raise NotPlain(f"{base / images_in(top.files)[0]} lies beside the class directories")
    add_other(split, base, top.files, [])
    # HF sorts whole paths: "a-b/x" before "a/x"
    for cls in sorted(top.dirs, key=lambda d: d + "/"):
        if _SPLIT_IN_DIR_NAME.search(cls):
            raise NotPlain(f"HF reads the class directory {base / cls} as a split of its own")
        listed = list_dir(base / cls)
        dirs[f"{rel}/{cls}" if rel else cls] = listed.mtime_ns
        if listed.dirs:
            raise NotPlain(f"{base / cls / listed.dirs[0]} is a directory inside a class directory")
        images = images_in(listed.files)
        split.classes.append((cls, images))
        if len(images) == len(listed.files):
            split.names += images
        else:
            add_other(split, base / cls, listed.files, images)
    return split


def add_other(split: Split, folder: Path, files: list[str], images: list[str]) -> None:
    """Count the suffixes of the `files` that are not `images` into split.other; the visible names
    into split.names."""
    plain = set(images)
    for name in files:
        if name not in plain:
            split.other.update(other_suffixes(str(folder / name), name))
    split.names += [n for n in files if not n.startswith(".")]


def check_names(names: list[str], single: bool) -> None:
    """File names that would make HF read another layout, or (one split) a split of its own."""
    joined = "/" + "/".join(names) + "/"
    found = [name for name in _OTHER_LAYOUT_NAMES if name in joined]
    if found:
        raise NotPlain(f"a file named like '{found[0].strip('/')}' (HF's logs or harbor layouts)")
    if single and any(_keyword_at(joined, word) for word in _SPLIT_WORDS):
        raise NotPlain("a file name names a split (HF's **/*_val_* patterns)")


def _keyword_at(joined: str, word: str) -> bool:
    """`word` starts one of HF's split keywords somewhere in `joined` names, as its patterns match
    it."""
    at = joined.find(word)
    while at >= 0:
        if _SPLIT_IN_FILE_NAME.match(joined, at):
            return True
        at = joined.find(word, at + 1)
    return False


def check_builder(split_name: str, split: Split) -> None:
    """HF picks a split's builder from its commonest data-file suffix: images must outnumber any
    other."""
    if not split.other:
        return
    images = Counter(n[n.rfind("."):].lower() for _, names in split.classes for n in names)
    suffix, count = split.other.most_common(1)[0]
    if not images or count >= max(images.values()):
        raise NotPlain(f"split '{split_name}' holds as many {suffix} files as images of one kind")


def scan(root: Path) -> Listing:
    """Every split of a plain folder, listed and checked against what HF would read; NotPlain if not
    one."""
    top = list_dir(root)
    check_links(top)
    dirs = {"": top.mtime_ns}
    places = layout(top)
    single = places == {"train": ""}
    if not single:
        check_names([n for n in top.files if not n.startswith(".")], single)
    splits = {}
    for name, rel in places.items():
        listed = top if not rel else list_dir(root / rel)
        check_links(listed)
        if rel:
            dirs[rel] = listed.mtime_ns
        splits[name] = list_split(root, rel, listed, dirs)
        check_names(splits[name].names, single)
        check_builder(name, splits[name])
    check_labels(splits)
    return Listing(splits, places, dirs)


def check_labels(splits: dict[str, Split]) -> None:
    """Every split has images, and HF labels them: two classes or more (from its first split on)."""
    for name, split in splits.items():
        if not any(images for _, images in split.classes):
            raise NotPlain(f"split '{name}' holds no image")
    first = next(iter(splits.values()))
    if sum(1 for _, images in first.classes if images) < 2:
        raise NotPlain("one class: HF gives no label column")


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
