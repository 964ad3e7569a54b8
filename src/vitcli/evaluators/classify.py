"""Classification metrics from per-row predictions, as pure numpy: top-k, per-class accuracy, the
confusion matrix, and ImageNet ReaL.

ReaL (Beyer et al. 2020, "Are we done with ImageNet?") relabels the 50,000 ImageNet validation
images: its `real.json` holds one list of valid class indices per image, entry i for
ILSVRC2012_val_{i+1:08d}. An image whose list is empty (no valid label) is left out; a prediction is
right when it is in the list, and top-k is right when any of the first k is (timm's
RealLabelsImagenet, which this matches).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from vitcli.errors import DataError

REAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})")  # the validation file number, 1-based


def top_k_correct(top: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """(N,) bool: each row's label is among its first k predictions; `top` (N, >= k) is best
    first."""
    return (top[:, :k] == labels[:, None]).any(axis=1)


def confusion_matrix(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> np.ndarray:
    """(K, K) int64 counts, row = true class, column = predicted class."""
    flat = labels.astype(np.int64) * num_classes + predicted.astype(np.int64)
    return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, num_classes)


def per_class_accuracy(confusion: np.ndarray) -> list[float | None]:
    """Recall of each class, its diagonal over its row; None for a class with no rows (JSON has no
    NaN)."""
    totals = confusion.sum(axis=1)
    return [float(confusion[k, k] / n) if n else None for k, n in enumerate(totals)]


def read_real_labels(path: Path, num_classes: int) -> list[list[int]]:
    """A real.json: a JSON list with one list of class indices (each < num_classes) per validation
    image."""
    try:
        entries = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"--real-labels {path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"--real-labels {path}: not a JSON file ({e})") from None
    if not isinstance(entries, list) or not entries:
        raise DataError(f"--real-labels {path}: expected a JSON list of label lists, one per validation "
                        "image")
    for i, labels in enumerate(entries):
        # bool is an int: refused
        ints = isinstance(labels, list) and all(type(c) is int for c in labels)
        if not ints:
            raise DataError(f"--real-labels {path}: entry {i} is {labels!r}, not a list of class indices")
        bad = [c for c in labels if not 0 <= c < num_classes]
        if bad:
            raise DataError(f"--real-labels {path}: entry {i} has class {bad[0]}, but the model has "
                            f"{num_classes} classes")
    return entries


def real_file_number(name: str | None) -> int | None:
    """The 1-based number in an ILSVRC2012_val_XXXXXXXX file name (any directory, any extension)."""
    found = REAL_NAME.search(Path(name).name) if name else None
    return int(found.group(1)) if found else None


def real_entries(names: list[str | None] | None, rows: int, entries: int,
                 path: Path) -> tuple[np.ndarray, str]:
    """(the entry of each of the split's `rows` rows (N,), how they were matched: "file name" or
    "row order").

    Rows are matched by their ILSVRC2012_val number when every row's file name (`names`, None: the
    split has none) carries one, by row order when none does, and then the split must have one row
    per entry."""
    numbers = [real_file_number(n) for n in names] if names else []
    if numbers and all(n is not None for n in numbers):
        beyond = max(numbers)
        if beyond > entries:
            raise DataError(f"--real-labels {path} has {entries} entries, but the split holds "
                            f"ILSVRC2012_val_{beyond:08d}")
        return np.asarray(numbers, dtype=np.int64) - 1, "file name"
    named = [n for n in numbers if n is not None]
    if named:
        first = next(name for name, n in zip(names, numbers) if n is None)
        raise DataError(f"--real-labels: {len(named)} of the split's {len(names)} files are "
                        f"ILSVRC2012_val_* but {first} is not; evaluate a split of validation images only")
    if rows != entries:
        raise DataError(f"--real-labels {path} has {entries} entries, but the split has {rows} rows and no "
                        "ILSVRC2012_val_* file names to match them by; evaluate the whole validation split")
    return np.arange(entries, dtype=np.int64), "row order"


def real_top_k(top: np.ndarray, entries: np.ndarray, real: list[list[int]], k: int) -> tuple[int, int]:
    """(rows right, rows counted): a row counts when its ReaL list is not empty, and is right when
    one of its first k predictions (`top` (N, >= k), best first) is in that list; `entries` (N,) are
    its list indices."""
    right = counted = 0
    for predicted, entry in zip(top[:, :k].tolist(), entries.tolist(), strict=True):
        valid = real[entry]
        if valid:
            counted += 1
            right += any(p in valid for p in predicted)
    return right, counted
