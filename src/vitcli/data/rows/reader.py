"""A reader: one kind of data.source behind one interface (reader_factory.py picks it; timm's
readers have this shape), and the HF split syntax every reader's `load` takes: slices and `+`
(`train[:98%]`, `train[:800]+validation`), resolved by `datasets.ReadInstruction` so percentages
round exactly as HF does; a slice reaching past the end of its split, or selecting nothing, is an
error (HF would clamp it silently: a short local copy of a VTAB task).
"""

from __future__ import annotations

import re

import datasets

from vitcli.errors import DataError
from vitcli.recipe.data_checks import split_names

# shards a saved or synthetic split is cut into: a multiple of the usual world sizes
STREAM_SHARDS = 64


class Reader:
    """The splits of one source: their names, the rows a split spec names, one whole split as a
    stream. `local`: a source on this machine, whose read errors sources.py turns into one line."""

    local = True

    def __init__(self, source: str):
        self.source = source

    def splits(self) -> list[str]:
        """The names of every split the source has."""
        raise NotImplementedError

    def load(self, split: str) -> datasets.Dataset:
        """The rows `split` names (HF split syntax)."""
        raise NotImplementedError

    def stream(self, split: str) -> datasets.IterableDataset:
        """One whole split as a stream whose images stay encoded."""
        raise NotImplementedError


class WholeReader(Reader):
    """A source read with all its splits at once (a saved directory, files, a folder, a prepared
    parquet copy): `load` selects from them, `stream` streams one from its memory-mapped arrow."""

    def loaded(self) -> dict[str, datasets.Dataset]:
        """Every split, loaded (memory-mapped)."""
        raise NotImplementedError

    def splits(self) -> list[str]:
        return list(self.loaded())

    def load(self, split: str) -> datasets.Dataset:
        return select(self.loaded(), split, self.source)

    def stream(self, split: str) -> datasets.IterableDataset:
        splits = self.loaded()
        check_split(split, list(splits), self.source)
        return sharded(splits[split])


def check_split(split: str, available: list[str], source: str) -> None:
    """A whole split the source has, or a DataError naming the ones it has."""
    if split not in available:
        raise DataError(f"{source}: no split '{split}'; available: {', '.join(available)}")


def sharded(ds: datasets.Dataset) -> datasets.IterableDataset:
    """A loaded split streamed from its memory-mapped arrow, cut into STREAM_SHARDS shards."""
    return ds.to_iterable_dataset(num_shards=max(1, min(STREAM_SHARDS, len(ds))))


def select(splits: dict[str, datasets.Dataset], split: str, source: str) -> datasets.Dataset:
    """Apply an HF split spec (slices, percentages, `+`) to already loaded splits."""
    missing = [name for name in split_names(split) if name not in splits]
    if missing:
        check_split(missing[0], list(splits), source)
    sizes = {k: len(v) for k, v in splits.items()}
    try:
        spans = datasets.ReadInstruction.from_spec(split).to_absolute(sizes)
    except (ValueError, AssertionError) as e:
        hint = "use e.g. train, train[:98%], train[:800]"
        raise DataError(f"{source}: bad split '{split}' ({e}); {hint}") from None
    for part, span in zip(split.split("+"), spans):  # HF gives one span per `+` part, in order
        _check_rows(part.strip(), span, sizes[span.splitname], source)
    parts = [splits[s.splitname].select(range(s.from_, s.to)) for s in spans]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


_BOUNDS = re.compile(r"\[\s*(-?\d+)?\s*(%?)\s*:\s*(-?\d+)?\s*(%?)\s*\]")  # train[a:b], [a%:], [:b]


def _check_rows(part: str, span, rows: int, source: str) -> None:
    """A slice reaching past its split, or selecting nothing, is an error: HF clamps
    `train[65931:66131]` on 4,000 rows to an empty selection and `train[3900:4100]` to 100 rows
    without a word."""
    match = _BOUNDS.search(part)
    if not match:
        return  # a whole split: an empty one is sources._check's to report
    # row numbers
    bounds = [int(v) for v, pct in (match.group(1, 2), match.group(3, 4)) if v and not pct]
    past = any(abs(b) > rows for b in bounds)
    if past:
        raise DataError(f"{source}: split slice '{part}' reaches past the end of split '{span.splitname}' "
                        f"({rows} rows): this copy is shorter than the slice expects; use a complete copy or "
                        "a smaller slice")
    if span.from_ >= span.to:  # in a `+` concatenation nothing else would notice
        raise DataError(f"{source}: split slice '{part}' is empty (split '{span.splitname}' has {rows} "
                        "rows); give a slice that selects rows")
