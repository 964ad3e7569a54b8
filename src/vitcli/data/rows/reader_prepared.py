"""A `vit prepare-data` copy as a reader: the shards its manifest.json lists per split, each split
checked to hold the rows the manifest counts before anything trains (parquet here; a tar copy is
reader_tars.py's, with these checks)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq

from vitcli.data.rows import tar_shards
from vitcli.data.rows.reader import WholeReader, check_split
from vitcli.errors import DataError
from vitcli.recipe.data_checks import PREPARED_KIND, PREPARED_MANIFEST


class PreparedReader(WholeReader):
    """A prepared parquet copy: map-style from its shards, or streamed one shard at a time."""

    def __init__(self, source: str, path: Path):
        super().__init__(source)
        self.path = path

    def splits(self) -> list[str]:
        """The splits its manifest lists (no shard opened)."""
        return list(manifest(self.path)["splits"])

    def loaded(self) -> dict[str, datasets.Dataset]:
        return dict(datasets.load_dataset("parquet", data_files=prepared_files(self.path, self.source)))

    def stream(self, split: str) -> datasets.IterableDataset:
        files = prepared_files(self.path, self.source)
        check_split(split, list(files), self.source)
        return datasets.load_dataset("parquet", data_files={split: files[split]}, split=split, streaming=True)


def manifest(path: Path) -> dict:
    """A prepared directory's manifest.json."""
    return json.loads((path / PREPARED_MANIFEST).read_text())


def is_prepared(path: Path) -> bool:
    """A directory with a manifest.json that `vit prepare-data` wrote (another tool's file of that
    name is not one)."""
    try:
        return manifest(path).get("kind") == PREPARED_KIND
    except (OSError, ValueError, AttributeError):
        return False


def prepared_files(path: Path, source: str) -> dict[str, list[str]]:
    """A prepared directory's shard files per split, each split checked to hold the rows its
    manifest counts (from the parquet footers, or a tar's size: cheap), so a shard lost or cut short
    is named before anything trains."""
    files = {}
    for split, entry in manifest(path)["splits"].items():
        files[split] = [str(path / shard["file"]) for shard in entry["shards"]]
        missing = [f for f in files[split] if not Path(f).is_file()]
        if missing:
            raise DataError(f"{source}: shard {missing[0]} listed in {PREPARED_MANIFEST} is missing")
        rows = sum(_shard_rows(path / shard["file"], shard, source) for shard in entry["shards"])
        if rows != entry["rows"]:
            raise DataError(f"{source}: split '{split}' has {rows} rows in its shards but {entry['rows']} in "
                            f"{PREPARED_MANIFEST}; prepare the copy again (vit prepare-data --overwrite)")
    return files


def _shard_rows(file: Path, shard: dict, source: str) -> int:
    """A prepared shard's rows: a parquet footer's count; a tar's as its manifest entry says, once
    the tar has the size recorded with it. Counting a tar's members would read a header per member,
    ~2.6 million for ImageNet at every start; a tar lost, cut short or grown has another size. One
    cut short is walked (tar_shards.cut_short) to say how many examples it still holds."""
    if file.suffix != tar_shards.TAR:
        return pq.read_metadata(file).num_rows
    size = file.stat().st_size
    walked = tar_shards.cut_short(file) if size < shard["bytes"] else None
    if walked is not None:
        raise DataError(f"{source}: shard {file.name} is cut short: {walked.examples} examples readable, "
                        f"{PREPARED_MANIFEST} says {shard['rows']} ({walked.cut}); prepare the copy again "
                        "(vit prepare-data --overwrite)")
    if size != shard["bytes"]:
        raise DataError(f"{source}: shard {file} is {size} bytes but {shard['bytes']} in "
                        f"{PREPARED_MANIFEST}; prepare the copy again (vit prepare-data --overwrite)")
    return shard["rows"]
