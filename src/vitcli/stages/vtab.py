"""VTAB-1k fine-tuning: the paper's protocol per task (train on train800val200, test on test), and a table.

Protocol (paper App. B.1.1 / Zhai et al. 2019): resolve.VTAB_PROTOCOL sits below the recipe file, so a
recipe can still change it. `val200` is the split for choosing hyper-parameters: with --lr-sweep each run
trains on train800 and is picked on val200.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from vitcli import tasks
from vitcli.checkpoints.files import write_text
from vitcli.dist import Dist
from vitcli.errors import DataError, RecipeError
from vitcli.metrics import stdout
from vitcli.recipe import Recipe
from vitcli.resolve import derive
from vitcli.stages.run import run_training
from vitcli.stages.sweep import sweep


def vtab_tasks(spec: str) -> list[tasks.Task]:
    """The VTAB-1k tasks `--task` names (`vtab`, `vtab/natural`, `vtab/dtd`); anything else is an error."""
    try:
        chosen = [t for t in tasks.get_tasks(spec) if t.name.startswith("vtab/")]
    except DataError as e:
        raise RecipeError(f"--task {spec}: {e}") from None
    if not chosen:
        raise RecipeError(f"--task {spec}: not a VTAB-1k task; use vtab, vtab/<group> or vtab/<name> "
                          f"(e.g. vtab/cifar100); other datasets fine-tune with data.source")
    return chosen


def task_recipe(recipe: Recipe, task: tasks.Task, sweep_lr: bool, world_size: int = 1) -> Recipe:
    """The recipe for one VTAB task: its data, its classes, its splits."""
    data = {
        "source": tasks.task_source(task, recipe.fewshot.data_root),
        "image_column": task.image_column, "label_rule": task.label_rule,
        "label_column": "label" if task.label_rule else task.label_column,  # a rule writes `label`
        "num_classes": task.num_classes,
        "train_split": task.splits["train800"] if sweep_lr else task.splits["train800val200"],
        "val_split": task.splits["val200"] if sweep_lr else "",
        "test_split": task.splits["test"],
    }
    return derive(recipe, {"data": data, "model": {"num_classes": task.num_classes}}, world_size)


def run_vtab(recipe: Recipe, workdir: Path, chosen: list[tasks.Task], dist: Dist, resume: bool | None = None,
             lrs: list[float] | None = None, overwrite: bool = False) -> dict:
    """Fine-tune on every task in `chosen`, one workdir each; rank 0 prints the table and writes vtab.json."""
    results = {}
    for task in chosen:
        out, r = workdir / task.name.split("/")[1], task_recipe(recipe, task, bool(lrs), dist.world_size)
        if lrs:
            summary = sweep(r, out, lrs, dist, resume, overwrite)
            top1, lr = summary["test/top1"], summary["best_lr"]
        else:
            top1, lr = run_training(r, out, dist, resume, overwrite).get("test/top1"), r.optim.lr
        results[task.name] = {"group": task.group, "test/top1": top1, "lr": lr}
    if dist.is_main:
        write_text(workdir / "vtab.json", json.dumps(results, indent=2) + "\n")
        _table(results)
    return results


def _table(results: dict) -> None:
    table = Table(title="VTAB-1k fine-tuning, test top-1")
    for col in ("task", "group", "lr", "top-1"):
        table.add_column(col)
    for name, r in results.items():
        table.add_row(name, r["group"], f"{r['lr']:g}", f"{100 * r['test/top1']:.1f}")
    groups = sorted({r["group"] for r in results.values()})
    for g in groups + ["all"]:
        accs = [r["test/top1"] for r in results.values() if g in ("all", r["group"])]
        table.add_row(f"[bold]mean {g}", "", "", f"{100 * sum(accs) / len(accs):.1f}")
    stdout.print(table)
