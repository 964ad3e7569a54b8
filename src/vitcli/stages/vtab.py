"""VTAB-1k fine-tuning: the paper's protocol per task (train on train800val200, test on test), and a
table.

Protocol (paper App. B.1.1 / Zhai et al. 2019): resolve.VTAB_PROTOCOL sits below the recipe file, so
a recipe can still change it. `val200` is the split for choosing hyper-parameters: with --lr-sweep
each rate trains on train800 into TASK/optim.lr=<lr> and is scored on val200 (not on test), then the
chosen rate trains again on all 1,000 images, train800val200, into TASK/final, and that model's test
top-1 is the task's result. Every run resumes or is skipped as run.build.run_training decides, so a
rerun after completion trains nothing again.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from vitcli.checkpoints import remote
from vitcli.data.rows import sources, tasks
from vitcli.errors import DataError, RecipeError
from vitcli.recipe.resolve import derive
from vitcli.recipe.schema import Recipe
from vitcli.run.build import run_training
from vitcli.runtime.dist import Dist
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_files import VTAB_FILE, VTAB_FINAL_RUN
from vitcli.stages.sweep import lr_sweep


def vtab_tasks(spec: str) -> list[tasks.Task]:
    """The VTAB-1k tasks `--task` names (`vtab`, `vtab/natural`, `vtab/dtd`); anything else is an
    error."""
    try:
        chosen = [t for t in tasks.get_tasks(spec) if t.name.startswith("vtab/")]
    except DataError as e:
        raise RecipeError(f"--task {spec}: {e}") from None
    if not chosen:
        raise RecipeError(f"--task {spec}: not a VTAB-1k task; use vtab, vtab/<group> or vtab/<name> "
                          f"(e.g. vtab/cifar100); other datasets fine-tune with data.source")
    return chosen


def task_recipe(recipe: Recipe, task: tasks.Task, sweep_lr: bool, world_size: int = 1) -> Recipe:
    """The recipe for one VTAB task: its data, its classes, its splits (a sweep's runs: train800,
    scored on val200 and never tested; otherwise train800val200, tested)."""
    data = {
        **sources.task_data(task, recipe.fewshot.data_root),
        "train_split": task.splits["train800"] if sweep_lr else task.splits["train800val200"],
        "val_split": task.splits["val200"] if sweep_lr else "",
        "test_split": "" if sweep_lr else task.splits["test"],
    }
    return derive(recipe, {"data": data, "model": {"num_classes": task.num_classes}}, world_size)


def run_vtab(recipe: Recipe, workdir: Path, chosen: list[tasks.Task], dist: Dist, resume: bool | None = None,
             lrs: list[float] | None = None, overwrite: bool = False) -> dict:
    """Fine-tune on every task in `chosen`, one workdir each; rank 0 prints the table and writes
    vtab.json."""
    # all found
    planned = [(task, task_recipe(recipe, task, bool(lrs), dist.world_size)) for task in chosen]
    results = {}
    for task, r in planned:
        out = workdir / task.name.split("/")[1]
        try:
            # each task's checkpoints in a place of their own
            found = _run_task(remote.below(recipe, out.name), task, remote.below(r, out.name), out,
                              lrs, dist, resume, overwrite)
        # the data layer names the file and split; say which task they were for
        except DataError as e:
            raise DataError(f"{task.name}: {e}") from None
        results[task.name] = {"group": task.group, **found}
    if dist.is_main:
        write_text(workdir / VTAB_FILE, json.dumps(results, indent=2) + "\n")
        _table(results)
    return results


def _run_task(recipe: Recipe, task: tasks.Task, r: Recipe, out: Path, lrs: list[float] | None, dist: Dist,
              resume: bool | None, overwrite: bool) -> dict:
    """One task's lr and test top-1. With `lrs`: the sweep's runs on train800 choose the lr on
    val200 (kept as val/top1), then that lr trains on train800val200 into OUT/final, which alone is
    tested."""
    if not lrs:
        return {"lr": r.optim.lr, "test/top1": run_training(r, out, dist, resume, overwrite).get("test/top1")}
    summary = lr_sweep(r, out, lrs, dist, resume, overwrite)
    final = derive(task_recipe(recipe, task, False, dist.world_size), {"optim": {"lr": summary["best_lr"]}},
                   dist.world_size)
    final = remote.below(final, VTAB_FINAL_RUN)
    results = run_training(final, out / VTAB_FINAL_RUN, dist, resume, overwrite)
    return {"lr": summary["best_lr"], "val/top1": summary["dev/top1"], "test/top1": results.get("test/top1")}


def _table(results: dict) -> None:
    swept = any("val/top1" in r for r in results.values())
    table = Table(title="VTAB-1k fine-tuning, test top-1" + (" (lr chosen on val200)" if swept else ""))
    for col in ("task", "group", "lr", *(["val200 top-1"] if swept else []), "test top-1"):
        table.add_column(col)
    for name, r in results.items():
        val = [f"{100 * r['val/top1']:.1f}"] if swept else []
        table.add_row(name, r["group"], f"{r['lr']:g}", *val, f"{100 * r['test/top1']:.1f}")
    groups = sorted({r["group"] for r in results.values()})
    for g in groups + ["all"]:
        accs = [r["test/top1"] for r in results.values() if g in ("all", r["group"])]
        blank = [""] * (2 + swept)
        table.add_row(f"[bold]mean {g}", *blank, f"{100 * sum(accs) / len(accs):.1f}")
    stdout.print(table)
