"""`vit eval-fewshot` and the in-training few-shot evaluator: frozen features -> closed-form ridge.

Features are extracted once per (weights, task, split, preprocessing) and reused for every shot count and
seed; the solver (fewshot.py) then costs milliseconds per fit.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from vitcli import data, features, fewshot, tasks
from vitcli.dist import Dist, setup
from vitcli.errors import DataError, RecipeError
from vitcli.metrics import console, stdout
from vitcli.recipe import DataConfig, Recipe


def preprocessing(recipe: Recipe) -> tuple[int, int]:
    """(img_size, resize): big_vision resizes to 256 x 256 and centre-crops 224; scaled for other sizes."""
    img_size = recipe.model.img_size
    return img_size, round(img_size * recipe.fewshot.resize / 224)


def recipe_tasks(recipe: Recipe) -> list[tasks.Task]:
    """The tasks fewshot.tasks names: registry names, `synthetic` (built-in data), or fewshot.custom.name."""
    custom = {"synthetic": tasks.synthetic_task(recipe.data.synthetic.num_classes)}
    c = recipe.fewshot.custom
    if c.name:
        if not c.source:
            raise RecipeError(f"fewshot.custom.source is empty: say where task '{c.name}' reads its data")
        num_classes = c.num_classes or data.num_classes(
            DataConfig(label_column=c.label_column),
            data.load_source(c.source, c.train_split, image_column=c.image_column, label_column=c.label_column,
                             synthetic=recipe.data.synthetic),
        )
        custom[c.name] = tasks.Task(c.name, "custom", num_classes, c.source,
                                    {"train": c.train_split, "test": c.test_split}, c.image_column, c.label_column)
    return [t for spec in recipe.fewshot.tasks for t in tasks.get_tasks(spec, custom)]


def load_task_split(task: tasks.Task, recipe: Recipe, split: str):
    """One split of a task, labels derived where the task says, from the Hub or --data-root."""
    source = tasks.task_source(task, recipe.fewshot.data_root)
    label_column = "" if task.label_rule else task.label_column  # a rule builds `label` from raw fields
    ds = data.load_source(source, split, image_column=task.image_column, label_column=label_column,
                          synthetic=recipe.data.synthetic)
    return tasks.apply_label_rule(task, ds) if task.label_rule else ds


def task_splits(task: tasks.Task, recipe: Recipe):
    """(train, test) datasets of a task."""
    return [load_task_split(task, recipe, split) for split in (task.train_split, task.test_split)]


def data_id(task: tasks.Task, recipe: Recipe) -> str:
    """Where a task's images come from, for the feature-cache key; the built-in data is defined by its config."""
    source = tasks.task_source(task, recipe.fewshot.data_root)
    if source == "synthetic":
        return f"synthetic:{json.dumps(dataclasses.asdict(recipe.data.synthetic), sort_keys=True)}"
    return source


def _data_cfg(task: tasks.Task, recipe: Recipe) -> DataConfig:
    cfg = copy.deepcopy(recipe.data)
    cfg.image_column, cfg.label_column = task.image_column, "label" if task.label_rule else task.label_column
    return cfg


def evaluate_task(train, test, num_classes: int, recipe: Recipe, name: str) -> list[dict]:
    """One row per (shots, seed): accuracy and the λ used. Shot counts a class cannot fill are skipped."""
    (x_tr, y_tr), (x_te, y_te) = train, test
    f = recipe.fewshot
    rows = []
    for shots in sorted(f.shots):
        for seed in range(f.seeds):
            try:
                idx = fewshot.sample_shots(y_tr, shots, seed, num_classes)
            except DataError as e:
                console.log(f"[yellow]{name}: skipping {shots}-shot: {e}")
                break
            cache = fewshot.precompute(x_tr[idx])
            y = fewshot.targets(y_tr[idx], num_classes)
            l2 = fewshot.choose_l2(cache, y)[0] if f.l2_reg == "auto" else float(f.l2_reg)
            logits = fewshot.predict(cache, fewshot.solve(cache, y, l2), x_te)
            acc = float(np.mean(logits.argmax(1) == y_te))
            rows.append({"task": name, "shots": shots, "seed": seed, "l2_reg": l2, "accuracy": acc})
    return rows


def summarise(rows: list[dict]) -> dict[tuple[str, int], tuple[float, float]]:
    """(task, shots) -> (mean, population std) of accuracy over seeds."""
    out = {}
    for key in sorted({(r["task"], r["shots"]) for r in rows}):
        accs = [r["accuracy"] for r in rows if (r["task"], r["shots"]) == key]
        out[key] = (float(np.mean(accs)), float(np.std(accs)))
    return out


class FewshotEvaluator:
    """Few-shot accuracy of the model being trained, logged as `fewshot/<task>/<k>shot` (no feature cache)."""

    def __init__(self, recipe: Recipe, workdir: Path, dist: Dist):
        self.recipe, self.dist = recipe, dist
        self.tasks = recipe_tasks(recipe)
        self.splits = {t.name: task_splits(t, recipe) for t in self.tasks}  # read once, reused every run

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        img_size, resize = preprocessing(self.recipe)
        for task in self.tasks:
            cfg = _data_cfg(task, self.recipe)
            sets = [features.extract(model, ds, cfg, img_size, resize, self.dist, self.recipe.run.precision)
                    for ds in self.splits[task.name]]
            rows = evaluate_task(sets[0], sets[1], task.num_classes, self.recipe, task.name)
            for (name, shots), (mean, _) in summarise(rows).items():
                yield f"fewshot/{name}/{shots}shot", mean


def run_fewshot(recipe: Recipe, workdir: Path) -> list[dict]:
    """`vit eval-fewshot`: features per task (cached), every shots x seed solve, table + json/csv/png."""
    from vitcli import fewshot_report
    from vitcli.transfer import load_for_eval

    if not recipe.init.checkpoint:
        raise RecipeError("eval-fewshot needs weights: pass --ckpt (a workdir, .safetensors, .npz or Hub name)")
    if not recipe.fewshot.tasks:
        raise RecipeError("no tasks: pass --tasks (e.g. --tasks vtab/natural) or set fewshot.tasks")
    dist = setup(recipe.run.device)
    model = load_for_eval(recipe).to(dist.device)
    workdir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(recipe.fewshot.cache_dir) if recipe.fewshot.cache_dir else workdir / "features"
    weights_id = features.weights_id(recipe.init.checkpoint)
    img_size, resize = preprocessing(recipe)
    pre = {"img_size": img_size, "resize": resize, "precision": recipe.run.precision}
    rows = []
    for task in recipe_tasks(recipe):
        cfg = _data_cfg(task, recipe)
        sets = []
        for split in (task.train_split, task.test_split):
            key = features.cache_key(weights_id, f"{task.name}:{data_id(task, recipe)}", split, pre)

            def extract(split=split, cfg=cfg, task=task):  # only on a cache miss: no decoding for a hit
                ds = load_task_split(task, recipe, split)
                return features.extract(model, ds, cfg, img_size, resize, dist, recipe.run.precision)

            feats, labels, hit = features.cached(cache_dir, key, extract)
            console.log(f"{task.name} {split}: {len(labels)} features {'(cached)' if hit else 'extracted'}")
            sets.append((feats, labels))
        rows += evaluate_task(sets[0], sets[1], task.num_classes, recipe, task.name)
    fewshot_report.write(rows, summarise(rows), workdir, recipe)
    return rows


def print_registry() -> None:
    """`--list-tasks`: the task registry as a table."""
    from rich.table import Table

    table = Table(title="few-shot tasks")
    for col in ("task", "group", "classes", "source", "train", "test"):
        table.add_column(col)
    for t in tasks.get_tasks("vtab") + tasks.get_tasks("standard"):
        table.add_row(t.name, t.group, str(t.num_classes), t.source, t.train_split, t.test_split)
    stdout.print(table)
