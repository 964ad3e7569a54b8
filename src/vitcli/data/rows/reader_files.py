"""Parquet, arrow or JSON files (one, a glob or a brace pattern of them) as a reader: one split,
`train`."""

from __future__ import annotations

from pathlib import Path

import datasets

from vitcli.data.rows.reader import WholeReader
from vitcli.errors import DataError

_STREAM_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


class FilesReader(WholeReader):
    """The files of a file or pattern; arrow files are memory-mapped, not copied."""

    def __init__(self, source: str, files: list[str]):
        super().__init__(source)
        self.files = files

    def loaded(self) -> dict[str, datasets.Dataset]:
        kinds = {Path(p).suffix for p in self.files}
        if kinds == {".arrow"}:
            parts = [datasets.Dataset.from_file(p) for p in self.files]
            return {"train": datasets.concatenate_datasets(parts)}
        if kinds == {".parquet"}:
            return {"train": datasets.load_dataset("parquet", data_files=self.files, split="train")}
        tar = " (tar shards: a pattern that ends in .tar, e.g. DIR/*.tar)" if ".tar" in kinds else ""
        found = ", ".join(sorted(kinds))
        raise DataError(f"{self.source}: expected .parquet or .arrow files, found {found}{tar}")

    def stream(self, split: str) -> datasets.IterableDataset:
        """parquet/arrow/json file(s) as the split `train`, one shard per file."""
        kinds = {Path(p).suffix for p in self.files}
        builders = {_STREAM_BUILDERS.get(k) for k in kinds}
        if len(builders) != 1 or None in builders:
            raise DataError(f"{self.source}: expected .parquet, .arrow or .json(l) files of one kind, found "
                            f"{', '.join(sorted(kinds))}")
        if split != "train":
            raise DataError(f"{self.source}: files make one split, 'train'; data.train_split='{split}' names "
                            "another")
        return datasets.load_dataset(builders.pop(), data_files=self.files, split="train", streaming=True)
