"""`vit evaluate`'s reliability diagram as a PNG (Guo et al. 2017, Figure 1): above, each confidence
bin's accuracy as a bar against the diagonal a calibrated model would follow, the gap to the bin's
mean confidence shaded; below, how many rows each bin holds (log scale: a trained model puts most
rows in the last bins)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vitcli.figures.canvas import new_figure
from vitcli.figures.figure7 import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def reliability_figure(counts: np.ndarray, accuracy: np.ndarray, confidence: np.ndarray,
                       title: str) -> Figure:
    """Bars of accuracy (M,) per equal-width bin of [0, 1], with the bins' mean confidence (M,) and
    row counts (M,); empty bins are left blank."""
    m = len(counts)
    left = np.arange(m) / m
    held = counts > 0
    fig = new_figure(figsize=(5.0, 6.0))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.bar(left[held], accuracy[held], width=1 / m, align="edge", color="tab:blue", edgecolor="black",
            label="accuracy")
    gap_low = np.minimum(accuracy, confidence)[held]
    top.bar(left[held], np.abs(confidence - accuracy)[held], bottom=gap_low, width=1 / m, align="edge",
            color="tab:red", alpha=0.3, edgecolor="tab:red", hatch="//", label="gap to mean confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="calibrated")
    top.set_xlim(0, 1)
    top.set_ylim(0, 1)
    top.set_ylabel("accuracy")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=8)
    bottom.bar(left[held], counts[held], width=1 / m, align="edge", color="tab:gray", edgecolor="black",
               log=True)
    bottom.set_xlabel("confidence (top-1 probability)")
    bottom.set_ylabel("rows")
    return fig


def write_reliability(counts: np.ndarray, accuracy: np.ndarray, confidence: np.ndarray, title: str,
                      path: Path) -> None:
    """Draw and write the PNG atomically."""
    save_figure(reliability_figure(counts, accuracy, confidence, title), path)
