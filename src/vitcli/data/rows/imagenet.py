"""ImageNet's label spaces as timm ships them (timm/data/_info/): the 1,000 synsets in class-index
order, the WordNet lemmas that name a head of ImageNet-1k's or -21k's width, the 200-class subsets
of ImageNet-A and -R, and the ReaL labels.

Read from timm's own files (through timm.data.ImageNetInfo where it has an API, pkgutil where it has
none), never copied: timm's validate.py scores ImageNet-A/-R through the same
`imagenet_{a,r}_indices.txt`.
"""

from __future__ import annotations

import functools
import pkgutil
from pathlib import Path

import numpy as np
import timm.data
from timm.data import ImageNetInfo, infer_imagenet_subset

from vitcli.errors import DataError

NUM_CLASSES = 1000  # ImageNet-1k's head: what A, R, V2, Sketch and ReaL are scored with
SUBSET_FILES = {"imagenet-a": "imagenet_a_indices.txt", "imagenet-r": "imagenet_r_indices.txt"}
# timm's copy of ReaL's real.json (what RealLabelsImagenet reads when given no file)
REAL_FILE = Path(timm.data.__file__).parent / "_info" / "imagenet_real_labels.json"


def require_imagenet_head(flag: str, checkpoint: str, num_classes: int) -> None:
    """Refuse `flag` (--real, --suite), which scores ImageNet-1k's classes, for a head of another
    width."""
    if num_classes != NUM_CLASSES:
        raise DataError(f"{flag} scores an ImageNet-1k head ({NUM_CLASSES} classes), but {checkpoint} has "
                        f"{num_classes} classes: evaluate a {NUM_CLASSES}-class checkpoint")


def _info(name: str) -> str:
    """The text of one of timm's _info files."""
    return pkgutil.get_data("timm.data", f"_info/{name}").decode("utf-8")


@functools.cache
def synsets() -> tuple[str, ...]:
    """The 1,000 WordNet synsets (n01440764, ...) in ImageNet-1k's class-index order."""
    return tuple(ImageNetInfo("imagenet-1k").label_names())


def subset_classes(name: str) -> np.ndarray:
    """(200,) ascending ImageNet-1k class indices of ImageNet-A's or -R's classes (timm's indices
    file)."""
    return np.asarray([int(line) for line in _info(SUBSET_FILES[name]).split()], dtype=np.int64)


def head_names(num_classes: int) -> tuple[list[str], str] | None:
    """(each class's WordNet lemma, e.g. "tabby, tabby cat"; the label space, e.g. "imagenet-1k")
    for a head whose width is one of ImageNet's that timm knows (1000, 21843 Google's 21k, 21841
    22k, ...); None for any other width. The order is timm's for that width, which every checkpoint
    of that width uses."""
    subset = infer_imagenet_subset({"num_classes": num_classes})
    if subset is None:
        return None
    return ImageNetInfo(subset).label_descriptions(), subset
