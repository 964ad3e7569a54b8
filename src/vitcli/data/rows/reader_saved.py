"""A `save_to_disk` directory as a reader: a DatasetDict's splits, or a lone Dataset as the split
`train`."""

from __future__ import annotations

from pathlib import Path

import datasets

from vitcli.data.rows.reader import WholeReader


class SavedReader(WholeReader):
    """A directory with dataset_dict.json (its splits) or state.json (one Dataset),
    memory-mapped."""

    def __init__(self, source: str, path: Path):
        super().__init__(source)
        self.path = path

    def loaded(self) -> dict[str, datasets.Dataset]:
        saved = datasets.load_from_disk(str(self.path))
        return dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}
