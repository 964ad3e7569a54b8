"""`vit evaluate`'s confusion matrix as a PNG: true class down, predicted class across, each row
coloured by its share of the class (so a rare class reads as clearly as a common one), the counts
written in the cells while they fit, and the class names on the axes while there are few enough to
read."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vitcli.figures.canvas import new_figure
from vitcli.figures.figure7 import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_CLASSES = 100  # beyond this a cell is under a pixel wide at any sensible size: no figure
NAMED_UP_TO = 30  # class names on the axes up to this many classes, indices beyond
COUNTS_UP_TO = 20  # counts written in the cells up to this many classes


def row_normalised(confusion: np.ndarray) -> np.ndarray:
    """(K, K) shares of each true class (rows sum to 1; a class with no rows stays 0)."""
    totals = confusion.sum(axis=1, keepdims=True)
    return np.divide(confusion, totals, out=np.zeros(confusion.shape), where=totals > 0)


def confusion_figure(confusion: np.ndarray, names: list[str], title: str) -> Figure:
    """The (K, K) counts as a heat map of row shares, with counts and names where they are
    readable."""
    k = len(confusion)
    side = min(max(4.0, 0.32 * k + 2.5), 16.0)
    fig = new_figure(figsize=(side + 1.2, side))
    ax = fig.subplots()
    image = ax.imshow(row_normalised(confusion), cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    labels = names if k <= NAMED_UP_TO else None
    # every class named, or about 10 round indices
    ticks = np.arange(0, k, 1 if labels else -(-k // 10))
    ax.set_xticks(ticks, labels=labels or [str(t) for t in ticks], rotation=90 if labels else 0)
    ax.set_yticks(ticks, labels=labels or [str(t) for t in ticks])
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(title)
    if k <= COUNTS_UP_TO:
        shares = row_normalised(confusion)
        for (i, j), count in np.ndenumerate(confusion):
            if count:
                ax.text(j, i, str(count), ha="center", va="center", fontsize=8,
                        color="white" if shares[i, j] > 0.5 else "black")
    return fig


def write_confusion(confusion: np.ndarray, names: list[str], title: str, path: Path) -> None:
    """Draw and write the PNG atomically (the caller keeps to MAX_CLASSES classes)."""
    save_figure(confusion_figure(confusion, names, title), path)
