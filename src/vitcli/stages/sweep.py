"""Learning-rate sweep: one fine-tune per rate, the best on the dev split wins, its test top-1 is reported.

Runs without a test split report none: VTAB's sweep (stages/vtab.py) tests only the model it retrains.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from rich.table import Table

from vitcli.recipe.resolve import derive
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist
from vitcli.runtime.files import atomic_path, write_text
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_files import SWEEP_CSV, SWEEP_FILE, sweep_run
from vitcli.stages.run import run_training

COLUMNS = ["lr", "dev/top1", "test/top1"]


def sweep(recipe: Recipe, workdir: Path, lrs: list[float], dist: Dist, resume: bool | None = None,
          overwrite: bool = False) -> dict:
    """Fine-tune once per learning rate into WORKDIR/lr_<lr>; pick on data.val_split;
    rank 0 writes sweep.*."""
    rows = []
    for lr in lrs:
        r = derive(recipe, {"optim": {"lr": lr}}, dist.world_size)
        results = run_training(r, workdir / sweep_run(lr), dist, resume, overwrite)
        rows.append({"lr": lr, "dev/top1": results.get("val/top1"), "test/top1": results.get("test/top1")})
    best = max(rows, key=lambda row: row["dev/top1"])
    summary = {"best_lr": best["lr"], "dev/top1": best["dev/top1"], "test/top1": best["test/top1"],
               "runs": rows}
    if dist.is_main:
        _write(workdir, summary)
        _print(rows, best)
    return summary


def _write(workdir: Path, summary: dict) -> None:
    write_text(workdir / SWEEP_FILE, json.dumps(summary, indent=2) + "\n")
    with atomic_path(workdir / SWEEP_CSV) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(summary["runs"])


def _print(rows: list[dict], best: dict) -> None:
    table = Table(title="learning-rate sweep (chosen on dev)")
    for col in ("lr", "dev top-1", "test top-1"):
        table.add_column(col, justify="right")
    for row in rows:
        mark = " *" if row is best else ""
        test = "" if row["test/top1"] is None else f"{row['test/top1']:.4f}"
        table.add_row(f"{row['lr']:g}{mark}", f"{row['dev/top1']:.4f}", test)
    stdout.print(table)
