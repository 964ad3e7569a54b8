"""The built-in data (synthetic.py) as a reader: its fixed splits train, validation and test."""

from __future__ import annotations

import datasets

from vitcli.data.rows.reader import Reader, select, sharded
from vitcli.data.rows.synthetic import SPLIT_IDS, make_synthetic, split_size
from vitcli.errors import DataError
from vitcli.recipe.data_checks import split_names
from vitcli.recipe.schema import SyntheticConfig


class SyntheticReader(Reader):
    """data.source=synthetic, drawn by data.synthetic's sizes and seed."""

    local = False

    def __init__(self, synthetic: SyntheticConfig):
        super().__init__("synthetic")
        self.synthetic = synthetic

    def splits(self) -> list[str]:
        """The splits with images (a size of 0 leaves one out)."""
        return [name for name in SPLIT_IDS if split_size(self.synthetic, name)]

    def load(self, split: str) -> datasets.Dataset:
        names = list(dict.fromkeys(split_names(split)))
        unknown = [n for n in names if n not in SPLIT_IDS]
        if unknown:
            raise DataError(f"synthetic: no split '{unknown[0]}'; available: {', '.join(SPLIT_IDS)}")
        return select({n: make_synthetic(self.synthetic, n) for n in names}, split, "synthetic")

    def stream(self, split: str) -> datasets.IterableDataset:
        return sharded(make_synthetic(self.synthetic, split))
