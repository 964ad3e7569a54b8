"""Training curves from metrics.jsonl: loss, learning rate, held-out and few-shot accuracy, several
runs overlaid.

`vit plot` (stages/plot.py) draws them for any workdirs; every training run draws its own
WORKDIR/curves.png at its end.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from vitcli.errors import OutputError
from vitcli.figures.canvas import new_figure
from vitcli.figures.figure7 import save_figure
from vitcli.recipe.choices import ALL_DATA_PROTOCOLS
from vitcli.runtime.metrics import console, read_metrics
from vitcli.runtime.run_files import CURVES_FILE, METRICS_FILE, RECIPE_FILE

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS = ("loss", "learning rate", "held-out accuracy", "few-shot accuracy",
          "frozen features, all train data")
# a colour per series and a line style per split, both the same in every panel: val is orange and
# dashed wherever it is drawn, the EMA weights' val_ema red and dashed. Keys of no split (few-shot,
# all-data protocols) take colours in turn in their panel, solid, and past ten colours the next
# style, so no two lines in a panel look alike
SPLIT_COLOURS = {"train": "C0", "val": "C1", "test": "C2", "val_ema": "C3", "test_ema": "C4"}
COLOURS = 10  # matplotlib's C0..C9
SPLIT_STYLES = {"train": "-", "val": "--", "test": ":"}
OTHER_STYLES = ("-", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (8, 2)))
# with several runs a marker shape per run tells them apart (the colour and style say the key); a
# dense line carries about MARKS of them, a line of few points (evaluations) one on every point
RUN_MARKERS = ("o", "^", "s", "D", "v", "P", "X", "*")
FEW_POINTS = 20
MARKS = 12
LOG_LR_RATIO = 3.0  # runs whose peak learning rates differ by more share a log-scale axis
# characters per line of a long panel title (a loss's description), in the medium font
TITLE_WIDTH = 52


def panel(key: str) -> str | None:
    """Which panel a metrics.jsonl key belongs to (train/loss, val/top1, fewshot/x/5shot...),
    None: not drawn."""
    split, _, name = key.partition("/")
    # the EMA weights' val_ema/top1 beside the trained weights' val/top1
    split = split.removesuffix("_ema")
    if split == "fewshot":
        return "few-shot accuracy"
    if split in ALL_DATA_PROTOCOLS and name.endswith("/top1"):  # fewshot.protocols' top-1
        return "frozen features, all train data"
    if name == "lr":
        return "learning rate"
    if name in ("loss", "mpp_loss", "mae_loss"):
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
    """One panel per kind of metric any run logged (empty ones left out); in each, a colour per
    series and a line style per split (`style`: train solid, val dashed, test dotted, in every
    panel), and with several runs a marker shape per run (`RUN_MARKERS`). The legend draws each line
    as it is drawn and names its key (and run, when there are several). `losses` says what each
    run's train/loss is (loss_name): the loss panel is titled by it, and runs whose losses differ
    get a loss panel each, since their numbers measure different things. The learning rate is drawn
    on a log axis when the runs' peaks differ by more than LOG_LR_RATIO, where a linear one would
    flatten the smaller to the floor."""
    shown = _panels(runs, losses or {})
    # with several runs, each its marker, placed a fraction of the spacing on from the last run's,
    # so lines that coincide (two runs' learning rates) still show both
    marks = {label: (RUN_MARKERS[i % len(RUN_MARKERS)], i / len(runs)) if len(runs) > 1 else None
             for i, label in enumerate(runs)}
    fig = new_figure(figsize=(4.2 * max(len(shown), 1), 3.8))
    axes = np.atleast_1d(fig.subplots(1, max(len(shown), 1), squeeze=False)).ravel()
    for ax, (title, group, keys) in zip(axes, shown):
        for label, rows in group.items():
            for i, key in enumerate(keys):
                _draw(ax, *series(rows, key), colour(key, i), style(key, i), marks[label],
                      f"{label}: {key}" if len(runs) > 1 else key)
        if title == "learning rate" and spread(group, keys) > LOG_LR_RATIO:
            ax.set_yscale("log")
            title += " (log scale)"
        text, size = _title(title)
        ax.set_title(text, fontsize=size)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        # handles 4 font sizes long: at matplotlib's 2 a dashed line with a marker on it reads as
        # solid
        ax.legend(fontsize="x-small", handlelength=4)
    return fig


def _title(title: str) -> tuple[str, str]:
    """(text, font size) of a panel's title: a short one as it is, a longer one (a loss's
    description) wrapped to the panel line by line in a smaller font."""
    if len(title) <= 40 and "\n" not in title:
        return title, "large"
    return "\n".join(textwrap.fill(line, TITLE_WIDTH) for line in title.splitlines()), "medium"


def _panel_title(kind: str, loss: str) -> str:
    """The panel's kind, with the loss it draws when known: a line per split when they differ
    ("train: ...; val: ...", `train_loss`)."""
    if not loss:
        return kind
    return "\n".join([kind, *loss.split("; ")]) if "; " in loss else f"{kind}: {loss}"


def colour(key: str, i: int) -> str:
    """The colour of metric `key`, the i-th drawn in its panel: its split's (val_ema's its own),
    else the i-th in turn."""
    return SPLIT_COLOURS.get(key.partition("/")[0], f"C{i % COLOURS}")


def style(key: str, i: int):
    """The line style of metric `key`, the i-th drawn in its panel: its split's (the EMA weights'
    too: val_ema is dashed as val is, told apart by its colour and hollow markers, `_draw`), else
    solid for the first COLOURS keys, the next style for the next COLOURS, and so on."""
    return SPLIT_STYLES.get(_split(key), OTHER_STYLES[i // COLOURS % len(OTHER_STYLES)])


def _split(key: str) -> str:
    return key.partition("/")[0].removesuffix("_ema")


def spread(runs: dict[str, list[dict]], keys: list[str]) -> float:
    """The largest over the smallest of the runs' peak values of `keys` (1 when fewer than two are
    above zero)."""
    peaks = [v.max() for rows in runs.values() for key in keys
             if len(v := series(rows, key)[1]) and v.max() > 0]
    return max(peaks) / min(peaks) if len(peaks) > 1 else 1.0


def _panels(runs: dict[str, list[dict]], losses: dict[str, str]) -> list[tuple[str, dict, list[str]]]:
    """(title, the runs drawn, the keys drawn) of every panel with something to draw, in PANELS
    order.

    Within one run, train/loss and val/loss are one quantity (both come from objectives.loss_fn);
    across runs the loss panel is split by loss definition, titled with it when it is known.
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
                out.append((_panel_title(kind, name), group, keys))
    return out


def loss_name(workdir: Path) -> str:
    """What a run's train/loss (and val/loss) measure, from its recipe.yaml (`train_loss`); "" when
    it has none."""
    path = Path(workdir) / RECIPE_FILE
    return train_loss(yaml.safe_load(path.read_text()) or {}) if path.is_file() else ""


def train_loss(recipe: dict) -> str:
    """What train/loss is under a recipe (recipe.yaml read as a dict), and what val/loss is where it
    is another quantity: the trainer's loss is `objectives.loss_fn` on mixed targets under mixup /
    CutMix, and DeiT's weighted sum with the teacher's term under distillation (train/distill.py),
    while the held-out evaluators score the plain loss_fn on their labels."""
    if recipe.get("objective") == "mpp":  # val/mpp_loss is the same masked-patch loss on val images
        target = recipe.get("mpp", {}).get("target", "mean_color")
        return f"masked patches, {target} " + ("squared error" if target == "pixels_l2" else "xent")
    # val/mae_loss is the same reconstruction loss on val images
    if recipe.get("objective") == "mae":
        normalised = recipe.get("mae", {}).get("norm_pix_loss", True)
        return "removed patches, " + ("per-patch normalised " if normalised else "") + "pixel squared error"
    optim, data, distill = (recipe.get(k, {}) for k in ("optim", "data", "distill"))
    base = "sigmoid xent (per-class BCE)" if optim.get("loss") == "sigmoid" else "softmax xent"
    if smoothing := optim.get("label_smoothing") or 0:
        base += f", smoothing {smoothing:g}"
    train = base
    mixed = [name for name, key in (("mixup", "mixup_alpha"), ("CutMix", "cutmix_alpha")) if data.get(key)]
    if mixed and data.get("mix_prob", 1.0) > 0:
        train = f"{base}, on {' / '.join(mixed)} targets"
    if (kind := distill.get("type", "none")) != "none":
        alpha = float(distill.get("alpha", 0.5))
        term = f"{kind} distillation" + (f" (tau {distill.get('tau', 1.0):g})" if kind == "soft" else "")
        train = f"{1 - alpha:g} x ({train}) + {alpha:g} x {term}"
    return base if train == base else f"train: {train}; val: {base}"


def _key_order(key: str) -> tuple[int, str]:
    """train before val before test (solid, dashed, dotted lines), each split's EMA after it, then
    by name."""
    return {"train": 0, "val": 1, "test": 2}.get(_split(key), 3), key


def _draw(ax, steps: np.ndarray, values: np.ndarray, colour: str, style, run: tuple[str, float] | None,
          label: str) -> None:
    """A line. One run: markers only when the points are few (periodic evaluations, the one final
    test score), dots. Several (`run`: its marker and phase): the run's marker on every point of a
    short line, on about MARKS points of a dense one, starting `phase` of the spacing in. The EMA
    weights' metrics (`*_ema/...`) draw theirs hollow (squares for one run) on a thinner line."""
    if not len(steps):
        return
    # the key, after any "run: "
    ema = label.rpartition(": ")[-1].partition("/")[0].endswith("_ema")
    few = len(steps) <= FEW_POINTS
    run_marker, phase = run or (None, 0.0)
    every = 1 if few else max(1, len(steps) // MARKS)
    ax.plot(steps, values, color=colour, linestyle=style, linewidth=0.9 if ema else 1.5,
            marker=run_marker or (("s" if ema else "o") if few else None),
            markevery=(int(phase * every), every), markersize=5 if run_marker else 4 if ema else 3,
            markerfacecolor="none" if ema else colour, label=label)


def rows_keys(rows: list[dict]) -> set[str]:
    """Every metric name in the rows."""
    return {k for row in rows for k in row if k != "step"}


def run_labels(workdirs: list[Path]) -> list[str]:
    """Workdir names, or their paths where two names coincide."""
    names = [Path(w).resolve().name for w in workdirs]
    return [n if names.count(n) == 1 else str(w) for n, w in zip(names, workdirs)]


def read_run(workdir: Path) -> list[dict]:
    """The rows of WORKDIR/metrics.jsonl; a one-line error when the workdir or its metrics are
    missing."""
    path = Path(workdir) / METRICS_FILE
    if not Path(workdir).is_dir():
        raise OutputError(f"workdir not found: {workdir}")
    points = sorted(p.parent.name for p in Path(workdir).glob(f"*/{METRICS_FILE}"))
    if not path.is_file() and points:  # a sweep's workdir: its points are the runs
        named = " ".join(str(Path(workdir) / p) for p in points[:4])
        more = f" (and its {len(points) - 4} other points)" if len(points) > 4 else ""
        raise OutputError(f"{path} not found: {workdir} holds a sweep, whose points are the runs: "
                          f"plot them: vit plot {named}{more}")
    if not path.is_file():
        raise OutputError(f"{path} not found: {workdir} is not a training workdir (or has not logged yet)")
    rows = read_metrics(path)
    if not rows:
        raise OutputError(f"{path} is empty: the run has not logged a step yet")
    return rows


def write_run_curves(workdir: Path) -> None:
    """WORKDIR/curves.png at the end of a run; a failure to draw is a warning, never a failed
    run."""
    try:
        label = run_labels([workdir])[0]
        figure = curves_figure({label: read_run(workdir)}, {label: loss_name(workdir)})
        save_figure(figure, workdir / CURVES_FILE)
    except Exception as e:  # noqa: BLE001 - the run finished and its weights are written; a plot is a bonus
        console.log(f"[yellow]warning: {workdir / CURVES_FILE} not written ({type(e).__name__}: {e})")
