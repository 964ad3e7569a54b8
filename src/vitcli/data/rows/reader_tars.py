"""WebDataset tar shards (tar_shards.py) as a reader, through HF's `webdataset` builder, one shard
per tar: a .tar file or a pattern of them (the split `train`), a folder of them (split by their
names), or a `vit prepare-data --shards tar` copy (its manifest's splits, shards and class
names)."""

from __future__ import annotations

from pathlib import Path

import datasets

from vitcli.data.rows import tar_shards
from vitcli.data.rows.reader import Reader, check_split, select
from vitcli.data.rows.reader_prepared import manifest, prepared_files
from vitcli.recipe.data_checks import split_names


class TarReader(Reader):
    """Tar shards: `where` the files of a file or pattern, or a folder; `prepared` for a prepared
    copy."""

    def __init__(self, source: str, where: list[str] | Path, prepared: bool = False):
        super().__init__(source)
        self.where, self.prepared = where, prepared

    def splits(self) -> list[str]:
        if self.prepared:
            return list(manifest(self.where)["splits"])  # no shard opened
        return list(self._files())

    def _files(self) -> dict[str, list[str]]:
        """The tars of each split, a prepared copy's checked against its manifest
        (prepared_files)."""
        if self.prepared:
            return prepared_files(self.where, self.source)
        if isinstance(self.where, list):
            return {"train": self.where}
        return tar_shards.folder_splits(self.where, self.source)

    def load(self, split: str) -> datasets.Dataset:
        """The splits `split` names (HF syntax), loaded whole, which HF does by copying their images
        into its cache: fine for evaluation splits, which is what reads a tar source map-style (a
        training split streams: recipe.resolve)."""
        return select(dict(self._read(list(dict.fromkeys(split_names(split))), False)), split, self.source)

    def stream(self, split: str) -> datasets.IterableDataset:
        return self._read([split], True)[split]

    def _read(self, wanted: list[str], streaming: bool):
        """The `wanted` whole splits through HF's webdataset builder; plain tars checked to end
        whole first (a prepared copy's sizes vouch for its own: prepared_files)."""
        splits = self._files()
        for name in wanted:
            check_split(name, list(splits), self.source)
        if not self.prepared:
            tar_shards.check_whole([file for name in wanted for file in splits[name]], self.source)
        features = tar_shards.features(manifest(self.where)) if self.prepared else None
        return datasets.load_dataset("webdataset", data_files={name: splits[name] for name in wanted},
                                     features=features, streaming=streaming)
