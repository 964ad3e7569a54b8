"""A plain image folder listed as HF's imagefolder builder would list it, without its glob: the
rules of datasets.data_files and datasets.packaged_modules (which files are images, which directory
names are splits, what makes HF read a folder otherwise), then one os.scandir per directory into a
Listing (splits, classes, their images, every directory's mtime). What HF would read otherwise
raises NotPlain: folder_index.py, which keeps the listing as an index, then hands the folder to HF.
tests/unit/test_folder_index.py holds the two side by side.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

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
