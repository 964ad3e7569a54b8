"""Few-shot results: a table (task x shots, mean ± std over seeds, group and VTAB means), json, csv,
png.

A (task, shots) whose shot set lacks examples (some class has fewer than `shots` train images, as
SUN397's 397 classes over VTAB-1k's 1,000) is scored on what there is, as big_vision does, and
marked: `*` in the table with a footnote, and in results.json every run and summary row carries
classes / short_classes / empty_classes / examples (the shot set's size; shots * classes when no
class is short).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from vitcli.data.decoding import bad_images
from vitcli.data.rows import tasks
from vitcli.fewshot.evaluate import draws, summarise
from vitcli.fewshot.solver import DRAW_FIELDS
from vitcli.figures.fewshot import weights_label, write_fewshot_figure
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import Recipe
from vitcli.runtime.files import atomic_path, write_text
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_files import FEWSHOT_CSV, FEWSHOT_FILE, FEWSHOT_PLOT


def group_means(summary: dict[tuple[str, Any], tuple[float, float]]) -> dict[tuple[str, Any], float]:
    """Mean accuracy per (VTAB group or `vtab` overall, shots or protocol), over the tasks evaluated
    in that group."""
    groups = {t.name: t.group for t in tasks.get_tasks("vtab")}
    buckets: dict[tuple[str, int], list[float]] = {}
    for (name, shots), (mean, _) in summary.items():
        if name in groups:
            buckets.setdefault((f"vtab/{groups[name]}", shots), []).append(mean)
            buckets.setdefault(("vtab", shots), []).append(mean)
    return {k: float(np.mean(v)) for k, v in sorted(buckets.items())}


def write(rows: list[dict], workdir: Path, recipe: Recipe, skipped: bad_images.Skipped | None = None,
          probes: list[dict] | None = None, inputs: dict | None = None) -> dict:
    """Write results.csv and fewshot.png (with few-shot rows), then results.json, last: it marks the
    evaluation finished (vitcli.runtime.finished); print the tables. Returns what results.json
    holds. `probes`: the all-data protocols' rows (fewshot.protocols); `inputs`: the request's
    record."""
    probes = probes or []
    # an earlier run's, that results.json will
    for stale in (FEWSHOT_CSV, FEWSHOT_PLOT) if not rows else ():
        (workdir / stale).unlink(missing_ok=True)  # not describe
    if rows:
        with atomic_path(workdir / FEWSHOT_CSV) as tmp, tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["task", "shots", "seed", "l2_reg", "accuracy", *DRAW_FIELDS])
            w.writeheader()
            w.writerows(rows)
        drawn = draws(rows)
        write_fewshot_figure(summarise(rows), {t: d["classes"] for (t, _), d in drawn.items()},
                             weights_label(recipe.init.checkpoint, recipe.init.random, recipe.run.seed),
                             workdir / FEWSHOT_PLOT)
    payload = results(rows, recipe, skipped, probes, inputs)
    write_text(workdir / FEWSHOT_FILE, json.dumps(payload, indent=2) + "\n")
    show(rows, probes, workdir)
    return payload


def show(rows: list[dict], probes: list[dict], workdir: Path) -> None:
    """The tables of few-shot `rows` and all-data `probes` (as results.json stores them), and the
    files."""
    if rows:
        summary, drawn = summarise(rows), draws(rows)
        _table(summary, group_means(summary), {key: d for key, d in drawn.items() if d["short_classes"]})
    if probes:
        _probe_table(probes)
    outputs = [workdir / FEWSHOT_FILE, *((workdir / FEWSHOT_CSV, workdir / FEWSHOT_PLOT) if rows else ())]
    stdout.print(f"results: {', '.join(map(str, outputs))}")


def results(rows: list[dict], recipe: Recipe, skipped: bad_images.Skipped | None = None,
            probes: list[dict] | None = None, inputs: dict | None = None) -> dict:
    """results.json: every few-shot run, the mean ± std per (task, shots), the group means, the
    all-data protocols' rows and their group means, and the recipe; with the tally, the images left
    out because they do not decode (`data/skipped_images`) and where they are; `inputs`, the
    request's record (vitcli.runtime.finished)."""
    summary, drawn = summarise(rows), draws(rows)
    probes = probes or []
    payload = {
        "checkpoint": recipe.init.checkpoint,
        # true: the checkpoint's network with fresh weights (run.seed)
        "random_init": recipe.init.random,
        "protocols": recipe.fewshot.protocols,
        "runs": rows,
        "summary": [{"task": t, "shots": k, "mean": m, "std": s, **drawn[(t, k)]}
                    for (t, k), (m, s) in summary.items()],
        "group_means": [{"group": g, "shots": k, "mean": m} for (g, k), m in group_means(summary).items()],
        "all_data": probes,
        "all_data_group_means": [{"group": g, "protocol": p, "top1": m}
                                 for (g, p), m in group_means(_probe_summary(probes)).items()],
        "recipe": to_dict(recipe),
    }
    # "SOURCE split 'SPLIT'" -> rows, so the files can be found and repaired
    if skipped is not None:
        payload.update({"data/skipped_images": skipped.total, "skipped_rows": skipped.as_dict()})
    if inputs is not None:
        payload["inputs"] = inputs
    return payload


def _probe_summary(probes: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    """(task, protocol) -> (top1, 0): the shape group_means averages."""
    return {(r["task"], r["protocol"]): (r["top1"], 0.0) for r in probes}


def _probe_table(probes: list[dict]) -> None:
    """Top-1 (top-5) per task and protocol, with the VTAB group means."""
    names = list(dict.fromkeys(r["protocol"] for r in probes))
    table = Table(title="frozen features, all train data: top-1 (top-5)")
    table.add_column("task")
    for name in names:
        table.add_column(name, justify="right")
    by = {(r["task"], r["protocol"]): r for r in probes}
    cell = lambda r: f"{100 * r['top1']:.1f}" + (f" ({100 * r['top5']:.1f})" if "top5" in r else "")
    for task in dict.fromkeys(r["task"] for r in probes):
        table.add_row(task, *[cell(by[(task, p)]) if (task, p) in by else "-" for p in names])
    means = group_means(_probe_summary(probes))
    for group in dict.fromkeys(g for g, _ in means):
        table.add_row(f"[bold]{group} mean",
                      *[f"{100 * means[(group, p)]:.1f}" if (group, p) in means else "-" for p in names])
    stdout.print(table)


def footnote(name: str, shots: int, draw: dict) -> str:
    """The table's note on a short (task, shots): which classes fell short and how big the shot set
    is."""
    short, empty, classes = draw["short_classes"], draw["empty_classes"], draw["classes"]
    which = ("had no train example" if short == empty else
             f"had fewer than {shots} train examples" + (f" ({empty} had none)" if empty else ""))
    size = f"{draw['examples']} examples, not {shots * classes}"
    return f"* {name} {shots}-shot: {short} of {classes} classes {which}: {size}"


def _table(summary: dict, means: dict, short: dict) -> None:
    all_shots = sorted({k for _, k in summary} | {k for _, k in means})
    table = Table(title="linear few-shot accuracy (mean ± std over seeds)")
    table.add_column("task")
    for k in all_shots:
        table.add_column(f"{k}-shot", justify="right")
    for name in dict.fromkeys(t for t, _ in summary):
        cells = []
        for k in all_shots:
            mean_std = summary.get((name, k))
            mark = "*" if (name, k) in short else ""
            cells.append(f"{100 * mean_std[0]:.1f} ± {100 * mean_std[1]:.1f}{mark}" if mean_std else "-")
        table.add_row(name, *cells)
    for group in dict.fromkeys(g for g, _ in means):
        table.add_row(f"[bold]{group} mean",
                      *[f"{100 * means[(group, k)]:.1f}" if (group, k) in means else "-" for k in all_shots])
    stdout.print(table)
    for (name, k), draw in short.items():  # scored on what the classes have, as big_vision: say so
        stdout.print(footnote(name, k, draw), soft_wrap=True, markup=False)
