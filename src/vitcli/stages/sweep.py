"""Sweeps: a training run per point of a grid, each in WORKDIR/<point>, and one table of their final
metrics.

`--sweep KEY=V1,V2,...` (recipe/grid.py names the points; the CLI resolves every point's recipe
before the first trains) runs the points in turn through run.build.run_training, which skips a
finished one without touching a file, so a rerun trains only what is missing. Rank 0 then writes
WORKDIR/sweep.json and sweep.csv (a row per point: its swept values and every final metric of its
summary.json, the keys with a `/`) and prints a table readable at 100 columns: the swept values, the
dev and test metrics and the status, the best on the dev split (val/top1) marked where the points
have one. The CLI has refused, before this, a swept value that resolving a point's recipe replaced
(recipe.grid.check_swept: a key the starting checkpoint fixes); a workdir that holds a single run is
refused here (runtime.workdir.refuse_single_run).

A point whose training fails as it runs (a non-finite loss; on one process also the device's memory
running out) is recorded as failed and the other points still run: what a value does is the sweep's
result. The command then exits 2 naming it (a rerun trains it again). With `--sweep-point I` (a
SLURM array task) only point I runs, its failure is the task's, and the task that finds every point
finished writes the table.

`--lr-sweep` is the sweep over optim.lr that chooses: the best rate on the dev split, its test top-1
reported (a rate that diverged is left out of the choice). Without a test split none is: VTAB's
sweep (stages/vtab.py) retrains its choice and tests only that model.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import torch
from rich.table import Table

from vitcli.checkpoints import remote
from vitcli.errors import TrainingError
from vitcli.recipe.grid import Grid, Point, expand, value_text
from vitcli.recipe.layers import nest
from vitcli.recipe.resolve import derive
from vitcli.recipe.schema import Recipe
from vitcli.run.build import run_training
from vitcli.run.report import number
from vitcli.runtime.dist import Dist, setup
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.run_dir import finished
from vitcli.runtime.run_files import SWEEP_CSV, SWEEP_FILE
from vitcli.runtime.workdir import refuse_single_run

DEV = "val/top1"  # the dev split's metric the best point is chosen on (higher is better)
HELD_OUT = ("val", "test", "fewshot", "real")  # metric families shown first: what a sweep compares

Planned = list[tuple[Point, Recipe]]


def run_grid(recipe: Recipe, workdir: Path, resume: bool | None = None, overwrite: bool = False, *,
             sweep: Grid) -> dict:
    """`vit pretrain --sweep`: join the process group once, then sweep_grid."""
    return sweep_grid(sweep, workdir, setup(recipe.run.device), resume, overwrite)


def sweep_grid(grid: Grid, workdir: Path, dist: Dist, resume: bool | None = None,
               overwrite: bool = False) -> dict:
    """Every point of `grid` in turn (or grid.only alone, then the table if every point is
    finished); returns what sweep.json holds. A point that failed is a TrainingError once the others
    ran and the table is written."""
    refuse_single_run(workdir)
    if grid.only is not None:
        return _one_point(grid, workdir, dist, resume, overwrite)
    rows = _run_points(list(zip(grid.points, grid.recipes, strict=True)), workdir, dist, resume, overwrite)
    summary = table(rows, list(grid.points[0].overrides))
    publish(workdir, summary, dist, f"sweep of {len(rows)} points")
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        raise TrainingError(f"sweep: {len(failed)} of {len(rows)} points failed, first {failed[0]['point']} "
                            f"({failed[0]['error']}); the others' metrics are in {workdir / SWEEP_CSV}, and "
                            "a rerun trains only the failed ones again")
    return summary


def lr_sweep(recipe: Recipe, workdir: Path, lrs: list[float], dist: Dist, resume: bool | None = None,
             overwrite: bool = False) -> dict:
    """`--lr-sweep`: fine-tune once per learning rate into WORKDIR/optim.lr=<lr>, choose on
    data.val_split; returns what sweep.json holds: the sweep's table and best_lr, its dev/top1 and
    test/top1."""
    refuse_single_run(workdir)
    planned = [(p, derive(recipe, nest(p.overrides), dist.world_size)) for p in expand([("optim.lr", lrs)])]
    summary = table(_run_points(planned, workdir, dist, resume, overwrite), ["optim.lr"])
    if summary["best"] is None:
        why = summary["points"][0].get("error", f"no {DEV}")
        raise TrainingError(f"--lr-sweep: no learning rate trained to the end ({why}); try lower rates")
    best = next(r for r in summary["points"] if r["point"] == summary["best"])
    summary = {"best_lr": best["optim.lr"], "dev/top1": best[DEV], "test/top1": best.get("test/top1"),
               **summary}
    publish(workdir, summary, dist, "learning-rate sweep (chosen on dev)")
    return summary


def _run_points(planned: Planned, workdir: Path, dist: Dist, resume: bool | None, overwrite: bool) -> list:
    """Each point trained (or skipped, finished) in turn in WORKDIR/<point>: its table row."""
    rows = []
    for i, (point, recipe) in enumerate(planned):
        if dist.is_main:
            console.rule(f"point {i + 1}/{len(planned)}: {point.name}")
        try:
            rows.append(row(point, _train(point, recipe, workdir, dist, resume, overwrite)))
        except _failures(dist) as e:
            if dist.is_main:
                console.log(f"[red]point {point.name} failed: {e}; the sweep goes on")
            rows.append(row(point, None, f"{type(e).__name__}: {e}"))
    return rows


def _train(point: Point, recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None,
           overwrite: bool) -> dict:
    recipe = remote.below(recipe, point.name)  # each point's checkpoints in a place of their own
    return run_training(recipe, workdir / point.name, dist, resume, overwrite,
                        skip_note=f"point {point.name}: finished, skipped", table=False)


def _failures(dist: Dist) -> tuple[type[BaseException], ...]:
    """What a point's training may raise that is that point's outcome, not the sweep's end. A
    non-finite loss is seen by every process at once (the loss is averaged over them first), so
    every one goes on to the next point; running out of memory is one process's, and the others
    would wait in the old point's collectives: under torchrun it ends the sweep."""
    return (TrainingError,) if dist.world_size > 1 else (TrainingError, torch.OutOfMemoryError)


def _one_point(grid: Grid, workdir: Path, dist: Dist, resume: bool | None, overwrite: bool) -> dict:
    """--sweep-point I: train point I; then the table, if every point's run is finished (read from
    their workdirs: whichever array task finishes last writes it)."""
    point = grid.points[grid.only]
    if dist.is_main:
        console.rule(f"point {grid.only} of 0-{len(grid.points) - 1}: {point.name}")
    mine = _train(point, grid.recipes[grid.only], workdir, dist, resume, overwrite)
    rows = [row(p, mine if p is point else finished(workdir / p.name)) for p in grid.points]
    summary = table(rows, list(point.overrides))
    pending = sum(r["status"] == "pending" for r in rows)
    if not pending:
        publish(workdir, summary, dist, f"sweep of {len(rows)} points")
    elif dist.is_main:
        console.log(f"{len(rows) - pending} of {len(rows)} points finished: the task that finishes the last "
                    f"writes {workdir / SWEEP_CSV}")
    return summary


def row(point: Point, summary: dict | None, error: str = "") -> dict:
    """A point's table row: its name, swept values, status (finished, failed or pending) and final
    metrics."""
    status = "failed" if error else "pending" if summary is None else "finished"
    metrics = {k: v for k, v in (summary or {}).items() if "/" in k}
    return {"point": point.name, **point.overrides, "status": status, **metrics, **_error(error)}


def _error(error: str) -> dict:
    return {"error": error} if error else {}


def table(rows: list[dict], keys: list[str]) -> dict:
    """What sweep.json holds: the swept keys, the best point on the dev split (None where no point
    has one), the failed points and every row."""
    dev = [r for r in rows if isinstance(r.get(DEV), (int, float))]
    best = max(dev, key=lambda r: r[DEV])["point"] if dev else None  # a tie: the first listed
    return {"keys": keys, "best": best, "failed": [r["point"] for r in rows if r["status"] == "failed"],
            "points": rows}


def publish(workdir: Path, summary: dict, dist: Dist, title: str) -> None:
    """Rank 0: sweep.json and sweep.csv (each only if it changed, so a rerun that trained nothing
    touches no file), and the table on stdout."""
    if not dist.is_main:
        return
    _write_if_changed(workdir / SWEEP_FILE, json.dumps(summary, indent=2) + "\n")
    _write_if_changed(workdir / SWEEP_CSV, as_csv(summary))
    stdout.print(_rich_table(summary, title))
    stdout.print(f"sweep: {workdir / SWEEP_CSV}")


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    write_text(path, text)


def as_csv(summary: dict) -> str:
    """sweep.csv: a row per point; point, the swept keys, status, then every metric any point has (a
    point without it leaves its cell empty), and error where a point failed."""
    rows = summary["points"]
    columns = ["point", *summary["keys"], "status", *metric_columns(rows)]
    columns += ["error"] * any("error" in r for r in rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def metric_columns(rows: list[dict]) -> list[str]:
    """Every metric of any row, first seen first, the held-out ones (val, test, few-shot) in
    front."""
    seen = list(dict.fromkeys(k for r in rows for k in r if "/" in k))
    return sorted(seen, key=lambda k: k.split("/")[0] not in HELD_OUT)


def _rich_table(summary: dict, title: str) -> Table:
    """The sweep's table, readable at 100 columns: a row per point, its swept values, the dev and
    test metrics (shown_metrics) and its status, no cell wrapped; below it each failed point's error
    (its first line) and how many more metrics sweep.csv holds. The best point on the dev split is
    marked *."""
    rows, keys = summary["points"], summary["keys"]
    shown = shown_metrics(rows)
    more = len(metric_columns(rows)) - len(shown)
    notes = [f"{i} failed: {_message(r)}" for i, r in enumerate(rows) if r["status"] == "failed"]
    notes += [f"{more} more metrics of each point in {SWEEP_CSV}"] * bool(more)
    title += f", best on {DEV} marked *" if summary["best"] else ""
    # min_width: a title longer than a narrow table's columns on one line, not wrapped to them
    t = Table(title=title, caption="\n".join(notes) or None, caption_justify="left",
              min_width=len(title))
    for col in ["#", *keys, *shown]:
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("status", no_wrap=True)
    for i, r in enumerate(rows):
        mark = " *" if r["point"] == summary["best"] else ""
        values = [value_text(r[k]) for k in keys]
        t.add_row(f"{i}{mark}", *values, *(_cell(r.get(k)) for k in shown), r["status"])
    return t


def shown_metrics(rows: list[dict]) -> list[str]:
    """The metrics the table shows: the dev split's (val/top1, else the objective's first val
    metric: val/mpp_loss, val/mae_loss) and the test split's alike."""
    found = metric_columns(rows)
    return [m for m in (_first(found, "val"), _first(found, "test")) if m]


def _first(metrics: list[str], split: str) -> str | None:
    named = [m for m in metrics if m.split("/")[0] == split]
    return f"{split}/top1" if f"{split}/top1" in named else next(iter(named), None)


def _message(r: dict) -> str:
    """A failed point's error as the table's note gives it: its first line, without the exception's
    name (sweep.csv keeps the whole error)."""
    error = (str(r.get("error", "")).strip().splitlines() or [""])[0]
    name, sep, message = error.partition(": ")
    return message if sep and name.isidentifier() else error


def _cell(v) -> str:
    if v is None:  # a failed or pending point's metric
        return ""
    return number(v) if isinstance(v, float) else str(v)
