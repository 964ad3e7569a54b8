"""WebDataset tar shards: which tars a brace pattern or a folder names, their columns as the recipe
names them, and writing one shard.

A WebDataset shard is a plain tar whose members are the fields of its examples, `KEY.EXT`, the
members of one key adjacent: `00000042.jpg` + `00000042.cls` is one labelled image (timm's and
OpenCLIP's layout; the `.cls` member is the class id as decimal text). sources.py reads shards
through Hugging Face's `webdataset` builder, one shard per tar, whose columns are the members'
extensions (`jpg`, `cls`, `json`, ...) and `__key__`, `__url__`.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import datasets

from vitcli.errors import DataError

TAR = ".tar"
# vit prepare-data's --format -> its image members' extension
IMAGE_MEMBER = {"jpeg": "jpg", "png": "png"}
LABEL_MEMBER = "cls"
# the image members WebDataset writers name (timm, OpenCLIP)
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")
BLOCK = tarfile.BLOCKSIZE  # 512: a tar is headers and payloads padded to it, then two zero blocks


def expand_braces(pattern: str) -> list[str]:
    """Every path a brace pattern names, in order, as the shell (and WebDataset) expands it: `{a,b}`
    alternatives and `{000..146}` ranges, nested or several in a row. A range keeps zero padding: a
    bound written with a leading zero pads every number to the wider bound's width. Text without a
    brace group, or an unbalanced brace, is itself."""
    start = pattern.find("{")
    end = _closing(pattern, start) if start >= 0 else None
    if end is None:
        return [pattern]
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    alternatives = _alternatives(body)
    if alternatives is None:  # `{x}`: this brace is text; what follows it may still hold groups
        return [head + "{" + rest for rest in expand_braces(pattern[start + 1:])]
    rests = expand_braces(tail)
    return [head + part + rest for alt in alternatives for part in expand_braces(alt) for rest in rests]


def _closing(text: str, start: int) -> int | None:
    """The index of the brace closing the one at `start`, or None."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return None


def _alternatives(body: str) -> list[str] | None:
    """The inside of one brace group: a numeric range, else its top-level comma-separated parts;
    None for a group with neither (`{x}`), which the shell keeps as text."""
    numbers = _RANGE.fullmatch(body)
    if numbers:
        a, b = numbers.groups()
        padded = any(len(v.lstrip("-")) > 1 and v.lstrip("-").startswith("0") for v in (a, b))
        width = max(len(a), len(b)) if padded else 0
        step = 1 if int(b) >= int(a) else -1
        return [f"{n:0{width}d}" for n in range(int(a), int(b) + step, step)]
    parts, depth, begin = [], 0, 0
    for i, c in enumerate(body):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(body[begin:i])
            begin = i + 1
    return [*parts, body[begin:]] if parts else None


def folder_splits(folder: Path, source: str) -> dict[str, list[str]]:
    """The .tar files in `folder` per split, split by their names as HF splits a folder's files
    (`train-*`, `imagenet1k-train-*`, `validation-*`, `val-*`, `test-*`, ...; none named so: all
    `train`); a tar that names no split while others do is an error, not dropped."""
    tars = sorted(str(p) for p in folder.glob(f"*{TAR}") if p.is_file())
    by_name = datasets.data_files.DataFilesDict.from_patterns(
        datasets.data_files.get_data_patterns(str(folder)), base_path=str(folder))
    splits = {}
    for name, files in by_name.items():
        named = set(files)
        splits[str(name)] = [f for f in tars if f in named]
    # a README.md named a split alone
    splits = {name: files for name, files in splits.items() if files}
    unsplit = sorted(set(tars) - {f for files in splits.values() for f in files})
    if unsplit:
        raise DataError(f"{source}: {Path(unsplit[0]).name} names no split while others do (train-*, "
                        "validation-*, test-*, ...); rename it, or name the shards with a pattern")
    return splits


def features(manifest: dict) -> datasets.Features:
    """A `vit prepare-data --shards tar` copy's columns as HF's webdataset builder yields them, from
    its manifest, the class names in a ClassLabel (given these, the builder infers nothing: from the
    .cls members alone the labels would be bare integers)."""
    image = {IMAGE_MEMBER[manifest["format"]]: datasets.Image()}
    names = manifest["label_names"]
    label = {LABEL_MEMBER: datasets.ClassLabel(names=names)} if names else {}
    return datasets.Features({**image, **label, "__key__": datasets.Value("string"),
                              "__url__": datasets.Value("string")})


def named_columns(ds, image_column: str, label_column: str):
    """A split (Dataset or IterableDataset) read by HF's webdataset builder (its `__key__` and
    `__url__` say so) with its members' columns under the recipe's names, so that a standard
    WebDataset (`KEY.jpg` + `KEY.cls`) trains with the default data.image_column=image and
    data.label_column=label: the image is the one image column, else the one of IMAGE_MEMBERS (a
    `KEY.seg.png` mask beside a `KEY.jpg` is no rival); the label is `cls`. A name the recipe gives
    that exists is used as it is; any other split is returned as it is. What stays ambiguous is
    sources._check_columns' to report, with the columns there are."""
    columns = ds.features or {}
    if "__key__" not in columns or "__url__" not in columns:
        return ds
    renames = {}
    if image_column not in columns:
        images = [c for c, f in columns.items() if isinstance(f, datasets.Image)]
        images = images if len(images) == 1 else [c for c in images if c in IMAGE_MEMBERS]
        if len(images) == 1:
            renames[images[0]] = image_column
    if label_column and label_column not in columns and LABEL_MEMBER in columns:
        renames[LABEL_MEMBER] = label_column
    return ds.rename_columns(renames) if renames else ds


def example_key(row: int) -> str:
    """An example's key: its row in the split, zero-padded so that keys sort as rows do; no dot (a
    key ends at its first dot) and no leading `.` or `__` (HF's tar reader skips such members as
    hidden)."""
    return f"{row:08d}"


def write_shard(path: Path, examples: Iterable[tuple[str, bytes, int | None]], image_ext: str) -> None:
    """One shard of (key, encoded image, label) examples in order: per example `KEY.<image_ext>`,
    then `KEY.cls` unless its label is None. A POSIX ustar archive whose headers hold nothing of
    this machine or this moment (mtime 0, owner 0:0 without names, mode 0644), so the same examples
    make the same bytes."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, image, label in examples:
            _add(tar, f"{key}.{image_ext}", image)
            if label is not None:
                _add(tar, f"{key}.{LABEL_MEMBER}", str(label).encode())


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)  # mtime 0, uid/gid 0, empty uname/gname: TarInfo's defaults
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


# --- a shard cut short: named before anything trains
# -----------------------------------------------------


@dataclass(frozen=True)
class Walked:
    """What a walk over a tar's headers found: the examples whose members all lie inside the file,
    and where it ends early (None: it is whole)."""

    examples: int
    cut: str | None


def ends_whole(path: Path) -> bool:
    """Whether a tar ends as every writer (tarfile, GNU tar, WebDataset's TarWriter) ends one: a
    whole number of blocks, the last two zero. One read of 1 KiB: a tar cut short mid-file ends in
    its last member's bytes instead."""
    size = os.path.getsize(path)
    if size < 2 * BLOCK or size % BLOCK:
        return False
    with open(path, "rb") as f:
        f.seek(size - 2 * BLOCK)
        return not any(f.read(2 * BLOCK))


def walk(path: Path) -> Walked:
    """Walk a tar's headers without reading a payload (tarfile seeks past each): where it is cut
    (inside a member, inside a header, or after a member without the closing zero blocks every
    writer adds), and the examples (keys: a member's name up to its first dot) before the cut, the
    last one left out since its other members may be what is lost."""
    size, keys, cut, last = os.path.getsize(path), [], None, None
    with tarfile.open(path, "r:") as tar:
        for member in _headers(tar):
            if member is None:
                cut = f"it ends inside the padding after {last}"
                break
            key, last = member.name.rsplit("/", 1)[-1].split(".", 1)[0], member.name
            keys += [key] if not keys or keys[-1] != key else []
            if member.offset_data + member.size > size:
                cut = f"it ends inside member {member.name} at byte {size - member.offset_data}"
                break
        end = tar.offset  # where the next header would start
    tail = _tail(path, end) if cut is None else b""
    if any(tail):
        cut = f"it ends inside the header after {last}"
    elif cut is None and len(tail) < 2 * BLOCK:
        cut = f"it ends after {last} without the two zero blocks that close a tar"
    return Walked(len(keys) - 1 if cut else len(keys), cut)


def _headers(tar: tarfile.TarFile):
    """The tar's members in order, then None where tarfile cannot seek to the next header (past the
    end: the file ends inside the padding of the member before)."""
    try:
        yield from tar
    except tarfile.ReadError:
        yield None


def _tail(path: Path, start: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read()


def cut_short(path: Path) -> Walked | None:
    """None for a tar that ends whole (ends_whole, else a walk over its headers finds nothing
    missing); else what the walk found."""
    if ends_whole(path):
        return None
    try:
        walked = walk(path)
    except tarfile.TarError as e:
        return Walked(0, f"it is not a readable tar ({e})")
    return walked if walked.cut else None


def check_whole(files: Iterable[str], source: str) -> None:
    """Every tar shard of a source ends whole, or a DataError naming the first that does not and how
    many examples it still holds (HF's reader would stop at the cut without a word and train on the
    rest)."""
    for file in files:
        walked = cut_short(Path(file))
        if walked is not None:
            raise DataError(f"{source}: {Path(file).name} is cut short: {walked.examples} examples "
                            f"readable, then {walked.cut}; copy or write the shard again")
