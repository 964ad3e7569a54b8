"""VTAB-1k fine-tuning: the paper's protocol per task (train on train800val200, test on test), and a table.

Protocol (paper App. B.1.1 / Zhai et al. 2019): 2,500 steps, lr 0.01, batch 512, 384 px, SGD momentum 0.9;
`val200` is the split for choosing hyper-parameters (with --lr-sweep, the final run trains on train800 and
is picked on val200). The protocol values sit below the recipe file, so a recipe can still change them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from vitcli import checkpoint, tasks
from vitcli.metrics import stdout
from vitcli.recipe import Recipe

PROTOCOL = {"schedule": {"steps": 2500, "warmup_steps": 200}, "optim": {"lr": 0.01},
            "data": {"batch_size": 512}, "model": {"img_size": 384}}


def task_recipe(recipe: Recipe, task: tasks.Task, data_root: str, sweep: bool) -> Recipe:
    """The recipe for one VTAB task: its data, its classes, its splits."""
    r = copy.deepcopy(recipe)
    d = r.data
    d.source = tasks.task_source(task, data_root)
    d.image_column, d.label_rule = task.image_column, task.label_rule
    d.label_column = "label" if task.label_rule else task.label_column  # a rule writes `label`
    d.num_classes = task.num_classes
    d.train_split = task.splits["train800"] if sweep else task.splits["train800val200"]
    d.val_split = task.splits["val200"] if sweep else ""
    d.test_split = task.splits["test"]
    r.model.num_classes = task.num_classes
    return r


def run_vtab(recipe: Recipe, workdir: Path, spec: str, resume: bool | None = None,
             lr_sweep: str | None = None) -> dict:
    """Fine-tune on every VTAB task in `spec` (`vtab`, `vtab/natural`, `vtab/dtd`), print and save the table."""
    from vitcli.stages import run_training
    from vitcli.transfer import parse_lrs, sweep

    chosen = [t for t in tasks.get_tasks(spec) if t.name.startswith("vtab/")]
    results = {}
    for task in chosen:
        out = workdir / task.name.split("/")[1]
        if lr_sweep:
            summary = sweep(task_recipe(recipe, task, recipe.fewshot.data_root, True), out, parse_lrs(lr_sweep),
                            resume)
            results[task.name] = {"group": task.group, "test/top1": summary["test/top1"], "lr": summary["best_lr"]}
        else:
            got = run_training(task_recipe(recipe, task, recipe.fewshot.data_root, False), out, resume)
            results[task.name] = {"group": task.group, "test/top1": got.get("test/top1"), "lr": recipe.optim.lr}
    checkpoint.write_text(workdir / "vtab.json", json.dumps(results, indent=2) + "\n")
    _table(results)
    return results


def _table(results: dict) -> None:
    from rich.table import Table

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
