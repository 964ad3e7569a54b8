"""A directory HF infers the builder of as a reader: a plain image tree from its index
(folder_index.py: seconds, where HF's builder takes minutes at ImageNet's size), anything else
(parquet shards, metadata files) by HF's builder."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import datasets

from vitcli.data.rows import folder_index
from vitcli.data.rows.folder_listing import IMAGE_SUFFIXES
from vitcli.data.rows.reader import WholeReader, check_split, sharded


class FolderReader(WholeReader):
    """An image folder (CLASS/IMAGE or SPLIT/CLASS/IMAGE) or another directory HF reads."""

    def __init__(self, source: str, path: Path):
        super().__init__(source)
        self.path = path

    def loaded(self) -> dict[str, datasets.Dataset]:
        indexed = folder_index.splits(self.path)
        return indexed if indexed is not None else dict(datasets.load_dataset(str(self.path)))

    def stream(self, split: str) -> datasets.IterableDataset:
        indexed = folder_index.splits(self.path)
        if indexed is None:
            return datasets.load_dataset(str(self.path), split=split, streaming=True)
        check_split(split, list(indexed), self.source)
        return sharded(indexed[split])


# --- a folder with no image at all: what it holds instead
# -----------------------------------------------

SURVEYED = 100_000  # files looked at, at most, to say what a folder without images holds


def survey(root: Path, limit: int = SURVEYED) -> Counter:
    """The lower-cased suffixes of the visible files under `root` ("" for none), up to `limit`
    files."""
    found: Counter = Counter()
    for _, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in files:
            if not name.startswith("."):
                found[Path(name).suffix.lower()] += 1
        if found.total() >= limit:
            break
    return found


def no_images(root: Path) -> str | None:
    """What is wrong with a folder HF found no image in, as one line: the suffixes looked for and
    what it holds instead; None if it does hold images, or tables that may hold them (parquet,
    arrow: then the columns are what is wrong)."""
    found = survey(root)
    if any(suffix[1:] in IMAGE_SUFFIXES or suffix in (".parquet", ".arrow") for suffix in found):
        return None
    shown = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif")
    instead = ", ".join(f"{n} {s or '(no suffix)'}" for s, n in found.most_common(5))
    more = f" and {len(found) - 5} more kinds" if len(found) > 5 else ""
    return (f"no image files found under {root} (looked for {', '.join(shown)} and the other "
            f"{len(IMAGE_SUFFIXES) // 2 - len(shown)} suffixes HF's imagefolder reads, in any subfolder); "
            f"found instead: {instead or 'nothing (the folder is empty)'}{more}; an image folder holds "
            "CLASS/IMAGE or SPLIT/CLASS/IMAGE files")
