"""`vit eval-fewshot`'s fewshot.png: top-1 against shots per task with the spread over seeds, on a
fixed 0-100% axis above each task's chance level (1/K), the weights named in the title (a
checkpoint, or the random initialisation of its network), so that a `--random-init` baseline is
never taken for the checkpoint and two figures compare at a glance."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from vitcli.figures.canvas import new_figure
from vitcli.figures.figure7 import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NAME_CHARS = 60  # a longer checkpoint path keeps its last NAME_CHARS characters in the title
LEGEND_ROWS = 13  # more tasks than this: the legend in two columns


def weights_label(checkpoint: str, random: bool, seed: int) -> str:
    """What produced the features: the checkpoint as the user named it, or its network at random
    init."""
    name = checkpoint if len(checkpoint) <= NAME_CHARS else "..." + checkpoint[-NAME_CHARS:]
    return f"random init (seed {seed}), network of {name}" if random else name


def fewshot_figure(summary: dict[tuple[str, int], tuple[float, float]], classes: dict[str, int],
                   weights: str) -> Figure:
    """Mean top-1 (%) against shots per task (summary: (task, shots) -> (mean, std) in [0, 1]),
    error bars the std over seeds; each task's chance level, 100/K for its K classes (`classes`), a
    dotted line in the task's colour and told in its legend entry; y fixed to 0-100; `weights`
    (weights_label) in the title."""
    names = list(dict.fromkeys(t for t, _ in summary))
    columns = 1 if len(names) < LEGEND_ROWS else 2  # VTAB's 19 tasks in two
    rows = -(-(len(names) + 1) // columns)
    # the object API: no pyplot state, no GUI backend, files only; the legend beside the axes, never
    # on data
    fig = new_figure(figsize=(5.0 + 2.8 * columns, max(4.2, 0.24 * rows + 1.0)))
    ax = fig.subplots()
    drawn = []
    for name in names:
        ks = sorted(k for t, k in summary if t == name)
        m = np.array([summary[(name, k)][0] for k in ks])
        s = np.array([summary[(name, k)][1] for k in ks])
        k = classes.get(name)
        told = f" (chance 1/{k} = {100 / k:.3g}%)" if k else ""
        drawn.append(ax.errorbar(ks, 100 * m, yerr=100 * s, marker="o", capsize=3, label=name + told))
        if k:
            ax.axhline(100 / k, color=drawn[-1][0].get_color(), linestyle=":", linewidth=1.2, zorder=2.5,
                       label=f"chance {name}: 1/{k}")
    ax.set_xscale("log")
    shots = sorted({k for _, k in summary})
    ax.set_xticks(shots, [str(k) for k in shots])
    ax.minorticks_off()
    ax.set_ylim(0, 100)
    ax.set_xlabel("shots per class")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(": ".join(filter(None, ("linear few-shot", weights))), fontsize="medium", wrap=True)
    ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D  # imported when drawing, as figures.canvas says why

    key = Line2D([], [], color="0.3", linestyle=":", linewidth=1.2,
                 label="chance: 1/classes (dotted, in the task's colour)")
    ax.legend(handles=[*drawn, key], fontsize="small", handlelength=3, ncol=columns, loc="upper left",
              bbox_to_anchor=(1.02, 1.0))
    return fig


def write_fewshot_figure(summary: dict[tuple[str, int], tuple[float, float]], classes: dict[str, int],
                         weights: str, path: Path) -> None:
    """Draw and write the PNG atomically."""
    save_figure(fewshot_figure(summary, classes, weights), path)
