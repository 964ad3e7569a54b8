"""ImageNet's robustness sets scored with an ImageNet-1k head: which set a split is, how its labels
map to the head's 1,000 classes, the classes its arg-max runs over, and where the sets lie under a
suite root.

ImageNet-A and -R hold 200 of the 1,000 classes: as their papers (Hendrycks et al. 2021) and timm's
validate.py (`--valid-labels`) score them, the logits are cut to those 200 before the softmax, top-k
and loss. ImageNet-V2 and -Sketch are scored over all 1,000. An image folder's loader numbers its
class folders alphabetically, so labels are mapped through the folder names: WordNet synsets (A, R,
Sketch, ImageNet's val) through timm's synset order, class indices (V2's folders 0..999, where '10'
sorts before '2') as numbers. Written here because timm's validate.py does this only for one
hand-given indices file and a folder of exactly its classes, and torchvision not at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from vitcli.data.rows import imagenet
from vitcli.errors import DataError
from vitcli.recipe.choices import IMAGENET_SETS

SETS = IMAGENET_SETS
TITLES = {"imagenet": "ImageNet", "imagenet-v2": "ImageNet-V2", "imagenet-a": "ImageNet-A",
          "imagenet-r": "ImageNet-R", "imagenet-sketch": "ImageNet-Sketch"}
# the folder names a suite root is searched for, in the order the table lists them: (set, folder
# name)
SUITE_FOLDERS = (
    ("imagenet", "imagenet"), ("imagenet", "imagenet-val"), ("imagenet", "val"),
    ("imagenet-v2", "imagenet-v2"), ("imagenet-v2", "imagenetv2-matched-frequency-format-val"),
    ("imagenet-v2", "imagenetv2-threshold0.7-format-val"),
    ("imagenet-v2", "imagenetv2-top-images-format-val"),
    ("imagenet-a", "imagenet-a"), ("imagenet-r", "imagenet-r"),
    ("imagenet-sketch", "imagenet-sketch"), ("imagenet-sketch", "sketch"),
)
SYNSET = re.compile(r"n\d{8}")
# a class index as V2's folders write it: no sign, no leading zero
INDEX = re.compile(r"0|[1-9]\d{0,2}")


@dataclass(frozen=True)
class Scoring:
    """How a split of an ImageNet set is scored with a 1000-class head."""

    name: str  # one of SETS
    # (S,) ascending head classes the logits are cut to (all 1000 but for A and R)
    columns: np.ndarray
    targets: np.ndarray  # (F,) each split label's position in `columns`
    labels_by: str  # how split labels were matched to head classes, for the report

    def restrict(self, logits, y):
        """(logits (B, S) of the kept classes, each label's position among them (B,)): a torch step
        of the pass, on the logits' device."""
        return logits.index_select(1, y.new_tensor(self.columns)), y.new_tensor(self.targets)[y]


def label_names(features: datasets.Features, column: str) -> list[str] | None:
    """The split's label names (an image folder's folder names), in label order; None without a
    ClassLabel."""
    feature = features.get(column) if column else None
    return [str(n) for n in feature.names] if isinstance(feature, datasets.ClassLabel) else None


def folder_classes(names: list[str]) -> tuple[np.ndarray, str] | None:
    """(the ImageNet-1k class of each name (F,), how: "synset folder names" or "class-index folder
    names") when every name is a synset of ImageNet-1k or a class index below 1000; None
    otherwise."""
    if all(SYNSET.fullmatch(n) for n in names):
        order = {s: i for i, s in enumerate(imagenet.synsets())}
        if all(n in order for n in names):
            return np.asarray([order[n] for n in names], dtype=np.int64), "synset folder names"
    elif all(INDEX.fullmatch(n) for n in names) and max(map(int, names)) < imagenet.NUM_CLASSES:
        return np.asarray([int(n) for n in names], dtype=np.int64), "class-index folder names"
    return None


def subset(name: str) -> np.ndarray:
    """(S,) the head classes a set is scored over: A's or R's 200, else all 1000."""
    return imagenet.subset_classes(name) if name in imagenet.SUBSET_FILES else np.arange(imagenet.NUM_CLASSES)


def recognise(names: list[str] | None) -> str | None:
    """The set a split's label names say it is: "imagenet-a"/"imagenet-r" for exactly their 200
    synsets, "imagenet" for other ImageNet-1k synset or class-index folders (val, V2, Sketch score
    alike); None."""
    found = folder_classes(names) if names else None
    if found is None:
        return None
    classes = set(found[0].tolist())
    for name in imagenet.SUBSET_FILES:
        if found[1] == "synset folder names" and classes == set(subset(name).tolist()):
            return name
    return "imagenet"


def scoring(name: str, names: list[str] | None, top: int) -> Scoring:
    """The Scoring of a split of set `name` whose label names are `names` (None: plain integer
    labels, the largest `top`): labels through their folder names, else by order (label i is the
    set's i-th class, as timm's validate.py assumes); a label outside the set's classes is an error
    naming it."""
    columns = subset(name)
    found = folder_classes(names) if names else None
    if found is None:
        count = len(names) if names else top + 1
        if count > len(columns) or (names and count != len(columns)):
            raise DataError(f"{TITLES[name]}: the split's {count} classes are neither WordNet synset "
                            f"folders (n01443537) nor class indices (0..999), nor the set's {len(columns)} "
                            "classes in order")
        return Scoring(name, columns, np.arange(count, dtype=np.int64), "label order")
    classes, how = found
    outside = [n for n, c in zip(names, classes.tolist()) if c not in set(columns.tolist())]
    if outside:
        raise DataError(f"class folder '{outside[0]}' is not one of {TITLES[name]}'s {len(columns)} classes "
                        f"(timm's {imagenet.SUBSET_FILES.get(name)}); is this {TITLES[name]}?")
    return Scoring(name, columns, np.searchsorted(columns, classes), how)


def detect(names: list[str] | None, top: int, head: int, own_names: list[str] | None, named: str | None,
           ckpt: str) -> Scoring | None:
    """How a split is scored: as the set `named` (--imagenet-set), else as the set its folder names
    say (recognise); None for any other split, and for the data a checkpoint was trained on (its
    stored names are the split's) or another dataset's synset folders under a head of another width
    (Imagenette's). A/R/V2/Sketch need an ImageNet-1k head: another width is an error."""
    found = named or recognise(names)
    if found is None or (named is None and own_names is not None and names == own_names):
        return None
    if named is None and found == "imagenet" and head != imagenet.NUM_CLASSES:
        return None
    if head != imagenet.NUM_CLASSES:
        how = "" if named else f" (its {len(names)} class folders are {TITLES[found]}'s)"
        raise DataError(f"the split is {TITLES[found]}{how}, scored with an ImageNet-1k head, but {ckpt} has "
                        f"{head} classes: evaluate a 1000-class checkpoint")
    return scoring(found, names, top)


def find_sets(root: Path) -> list[tuple[str, Path]]:
    """(set, folder) for each SUITE_FOLDERS name found under `root`, in that order; a root that is
    not a directory or holds none of them is an error that lists the names looked for."""
    if not root.is_dir():
        raise DataError(f"--suite {root}: not a directory")
    found = [(name, root / folder) for name, folder in SUITE_FOLDERS if (root / folder).is_dir()]
    if not found:
        names = ", ".join(folder for _, folder in SUITE_FOLDERS)
        raise DataError(f"--suite {root}: none of the folders {names} is there; put (or link) each set you "
                        "have under that name")
    return found
