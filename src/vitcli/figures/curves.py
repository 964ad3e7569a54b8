"""Training curves from metrics.jsonl: loss, learning rate, held-out and few-shot accuracy, several
runs overlaid.

`vit plot` (stages/plot.py) draws them for any workdirs; every training run draws its own WORKDIR/curves.png
at its end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from matplotlib.figure import Figure

from vitcli.errors import OutputError
from vitcli.figures.figure7 import save_figure
from vitcli.recipe.choices import ALL_DATA_PROTOCOLS
from vitcli.runtime.metrics import console, read_metrics
from vitcli.runtime.run_files import CURVES_FILE, METRICS_FILE, RECIPE_FILE

PANELS = ("loss", "learning rate", "held-out accuracy", "few-shot accuracy",
          "frozen features, all train data")
# one line style per split, the same in every panel (val is dashed wherever it is drawn); other keys (the
# few-shot table's shot counts) take the rest in turn
SPLIT_STYLES = {"train": "-", "val": "--", "test": ":"}
OTHER_STYLES = ("-", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (8, 2)))
LOG_LR_RATIO = 3.0  # runs whose peak learning rates differ by more share a log-scale axis


def panel(key: str) -> str | None:
    """Which panel a metrics.jsonl key belongs to (train/loss, val/top1, fewshot/x/5shot...),
    None: not drawn."""
    split, _, name = key.partition("/")
    split = split.removesuffix("_ema")  # the EMA weights' val_ema/top1 beside the trained weights' val/top1
    if split == "fewshot":
        return "few-shot accuracy"
    if split in ALL_DATA_PROTOCOLS and name.endswith("/top1"):  # fewshot.protocols' top-1
        return "frozen features, all train data"
    if name == "lr":
        return "learning rate"
    if name in ("loss", "mpp_loss"):
        return "loss"
    if split in ("val", "test") and name in ("top1", "mpp_accuracy"):
        return "held-out accuracy"
    return None


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one key over the rows that hold a finite value for it."""
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    steps, values = zip(*points) if points else ((), ())
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def curves_figure(runs: dict[str, list[dict]], losses: dict[str, str] | None = None) -> Figure:
    """One panel per kind of metric any run logged (empty ones left out); a colour per run, a line style per
    split (`style`: train solid, val dashed, test dotted, in every panel), each line named in the legend by
    its key (and run, when there are several). `losses` names each run's loss (loss_name): runs whose
    losses differ get a loss panel each, since their numbers measure different things. The learning rate
    is drawn on a log axis when the runs' peaks differ by more than LOG_LR_RATIO, where a linear one would
    flatten the smaller to the floor."""
    shown = _panels(runs, losses or {})
    colours = {label: f"C{i % 10}" for i, label in enumerate(runs)}
    fig = Figure(figsize=(4.2 * max(len(shown), 1), 3.6))
    axes = np.atleast_1d(fig.subplots(1, max(len(shown), 1), squeeze=False)).ravel()
    for ax, (title, group, keys) in zip(axes, shown):
        for label, rows in group.items():
            for i, key in enumerate(keys):
                _draw(ax, *series(rows, key), colours[label], style(key, i),
                      f"{label}: {key}" if len(runs) > 1 else key)
        if title == "learning rate" and spread(group, keys) > LOG_LR_RATIO:
            ax.set_yscale("log")
            title += " (log scale)"
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    return fig


def style(key: str, i: int):
    """The line style of metric `key`, the i-th drawn in its panel: its split's (the EMA weights' too:
    val_ema is dashed as val is, told apart by its hollow squares, `_draw`), else the i-th other one."""
    return SPLIT_STYLES.get(_split(key), OTHER_STYLES[i % len(OTHER_STYLES)])


def _split(key: str) -> str:
    return key.partition("/")[0].removesuffix("_ema")


def spread(runs: dict[str, list[dict]], keys: list[str]) -> float:
    """The largest over the smallest of the runs' peak values of `keys` (1 when fewer than two are above
    zero)."""
    peaks = [v.max() for rows in runs.values() for key in keys
             if len(v := series(rows, key)[1]) and v.max() > 0]
    return max(peaks) / min(peaks) if len(peaks) > 1 else 1.0


def _panels(runs: dict[str, list[dict]], losses: dict[str, str]) -> list[tuple[str, dict, list[str]]]:
    """(title, the runs drawn, the keys drawn) of every panel with something to draw, in PANELS order.

    Within one run, train/loss and val/loss are one quantity (both come from objectives.loss_fn); across
    runs the loss panel is split by loss definition, titled with it when it is known.
    """
    out = []
    for kind in PANELS:
        groups: dict[str, dict] = {}
        for label, rows in runs.items():
            groups.setdefault(losses.get(label, "") if kind == "loss" else "", {})[label] = rows
        for name, group in groups.items():
            keys = sorted({k for rows in group.values() for k in rows_keys(rows) if panel(k) == kind},
                          key=_key_order)
            if keys:
                out.append((f"{kind} ({name})" if name else kind, group, keys))
    return out


def loss_name(workdir: Path) -> str:
    """What a run's train/loss and val/loss measure, from its recipe.yaml; "" when it has none."""
    path = Path(workdir) / RECIPE_FILE
    if not path.is_file():
        return ""
    recipe = yaml.safe_load(path.read_text()) or {}
    if recipe.get("objective") == "mpp":
        return f"masked patches, {recipe.get('mpp', {}).get('target', '')}"
    optim = recipe.get("optim", {})
    smoothing = optim.get("label_smoothing") or 0
    return f"{optim.get('loss', 'softmax')} xent" + (f", smoothing {smoothing:g}" if smoothing else "")


def _key_order(key: str) -> tuple[int, str]:
    """train before val before test (solid, dashed, dotted lines), each split's EMA after it, then by name."""
    return {"train": 0, "val": 1, "test": 2}.get(_split(key), 3), key


def _draw(ax, steps: np.ndarray, values: np.ndarray, colour: str, style: str, label: str) -> None:
    """A line; with markers when the points are few (periodic evaluations, the one final test score): dots,
    or hollow squares on a thinner line for the EMA weights' metrics (`*_ema/...`)."""
    if not len(steps):
        return
    ema = label.partition("/")[0].endswith("_ema")
    few = len(steps) <= 20
    ax.plot(steps, values, color=colour, linestyle=style, linewidth=0.9 if ema else 1.5,
            marker=("s" if ema else "o") if few else None, markersize=4 if ema else 3,
            markerfacecolor="none" if ema else colour, label=label)


def rows_keys(rows: list[dict]) -> set[str]:
    """Every metric name in the rows."""
    return {k for row in rows for k in row if k != "step"}


def run_labels(workdirs: list[Path]) -> list[str]:
    """Workdir names, or their paths where two names coincide."""
    names = [Path(w).resolve().name for w in workdirs]
    return [n if names.count(n) == 1 else str(w) for n, w in zip(names, workdirs)]


def read_run(workdir: Path) -> list[dict]:
    """The rows of WORKDIR/metrics.jsonl; a one-line error when the workdir or its metrics are missing."""
    path = Path(workdir) / METRICS_FILE
    if not Path(workdir).is_dir():
        raise OutputError(f"workdir not found: {workdir}")
    if not path.is_file():
        raise OutputError(f"{path} not found: {workdir} is not a training workdir (or has not logged yet)")
    rows = read_metrics(path)
    if not rows:
        raise OutputError(f"{path} is empty: the run has not logged a step yet")
    return rows


def write_run_curves(workdir: Path) -> None:
    """WORKDIR/curves.png at the end of a run; a failure to draw is a warning, never a failed run."""
    try:
        label = run_labels([workdir])[0]
        figure = curves_figure({label: read_run(workdir)}, {label: loss_name(workdir)})
        save_figure(figure, workdir / CURVES_FILE)
    except Exception as e:  # noqa: BLE001 - the run finished and its weights are written; a plot is a bonus
        console.log(f"[yellow]warning: {workdir / CURVES_FILE} not written ({type(e).__name__}: {e})")
