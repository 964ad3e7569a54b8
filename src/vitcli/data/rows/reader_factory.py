"""Which reader a data.source gets, decided once for loading and streaming (timm's
reader_factory.py): what the source names (source_kind), then one reader per kind
(create_reader)."""

from __future__ import annotations

import glob
from pathlib import Path

from vitcli.data.rows import tar_shards
from vitcli.data.rows.reader import Reader
from vitcli.data.rows.reader_files import FilesReader
from vitcli.data.rows.reader_folder import FolderReader
from vitcli.data.rows.reader_hub import HubReader
from vitcli.data.rows.reader_prepared import PreparedReader, is_prepared, manifest
from vitcli.data.rows.reader_saved import SavedReader
from vitcli.data.rows.reader_synthetic import SyntheticReader
from vitcli.data.rows.reader_tars import TarReader
from vitcli.errors import DataError
from vitcli.recipe.data_checks import names_tar_shards
from vitcli.recipe.schema import SyntheticConfig


def create_reader(source: str, synthetic: SyntheticConfig) -> Reader:
    """The reader of `source` (the built-in data drawn by `synthetic`)."""
    kind, where = source_kind(source)
    if kind == "synthetic":
        return SyntheticReader(synthetic)
    if kind == "prepared":
        tars = manifest(where).get("shards") == "tar"  # `--shards tar`, not parquet
        return TarReader(source, where, prepared=True) if tars else PreparedReader(source, where)
    readers = {"hub": HubReader, "files": FilesReader, "shards": TarReader, "saved": SavedReader,
               "folder": FolderReader}
    return readers[kind](source) if where is None else readers[kind](source, where)


def source_kind(source: str) -> tuple[str, list[str] | Path | None]:
    """What a data.source names: ("synthetic", None), ("hub", None), or a local ("files", the files
    of a file, glob or brace pattern), ("shards", the WebDataset .tar files of a file or pattern, or
    a folder of them), ("saved", a save_to_disk directory), ("prepared", a `vit prepare-data`
    directory, parquet or tar) or ("folder", a directory HF infers the builder of: imagefolder,
    parquet shards, ...). A missing path is an error."""
    if source == "synthetic":
        return "synthetic", None
    path, pattern = Path(source).expanduser(), any(c in source for c in "*?[{")
    if not pattern and not path.exists():
        if _looks_like_path(source):
            raise DataError(f"dataset path not found: {source}")
        return "hub", None
    if pattern or path.is_file():
        files = _pattern_files(source) if pattern else [str(path)]
        return ("shards" if names_tar_shards(source) else "files"), files
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return "saved", path
    if is_prepared(path):
        return "prepared", path
    if names_tar_shards(source):
        return "shards", path
    return "folder", path


def _looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else (./x, /x, a/b/c, x.parquet) is meant as a
    path."""
    suffix = Path(source).suffix
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or suffix in (".parquet", ".arrow")


def _pattern_files(source: str) -> list[str]:
    """The files a glob or brace pattern names, in order: braces expanded first
    (tar_shards.expand_braces), then each part globbed. A part with no glob that names no file is an
    error, not dropped: a brace pattern lists the shards a dataset has, and a lost one would go
    unnoticed."""
    files = [file for part in tar_shards.expand_braces(source) for file in _part_files(part, source)]
    if not files:
        raise DataError(f"dataset path not found: {source} (the glob matches no file)")
    return files


def _part_files(part: str, source: str) -> list[str]:
    """The files one expanded part of `source` names: a glob's matches, sorted, or the one file it
    is."""
    path = str(Path(part).expanduser())
    if any(c in part for c in "*?["):
        return sorted(glob.glob(path))
    if not Path(path).is_file():
        raise DataError(f"{source}: {part} is not a file")
    return [path]
