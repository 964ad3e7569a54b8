"""Few-shot evaluation of one model on the recipe's tasks: frozen features -> every shots x seed score.

Shared by `vit eval-fewshot` (stages/fewshot.py, with a feature cache) and by the in-training evaluator
below (no cache: the weights change between calls). Both score through `solver.score`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator

import numpy as np
import torch

from vitcli import batches, data, tasks
from vitcli.dist import Dist
from vitcli.errors import DataError, RecipeError
from vitcli.fewshot import features, solver
from vitcli.metrics import console
from vitcli.recipe import DataConfig, Recipe


def preprocessing(recipe: Recipe) -> tuple[int, int]:
    """(img_size, resize): big_vision resizes to 256 x 256 and centre-crops 224; scaled for other sizes."""
    img_size = recipe.model.img_size
    return img_size, round(img_size * recipe.fewshot.resize / 224)


def _custom_task(recipe: Recipe) -> tasks.Task:
    c = recipe.fewshot.custom
    if not c.source:
        raise RecipeError(f"fewshot.custom.source is empty: say where task '{c.name}' reads its data")
    num_classes = c.num_classes or data.num_classes(
        DataConfig(label_column=c.label_column),
        data.load_source(c.source, c.train_split, image_column=c.image_column, label_column=c.label_column,
                         synthetic=recipe.data.synthetic),
    )
    return tasks.Task(c.name, "custom", num_classes, c.source, {"train": c.train_split, "test": c.test_split},
                      c.image_column, c.label_column)


def recipe_tasks(recipe: Recipe) -> list[tasks.Task]:
    """The tasks fewshot.tasks names: registry names, `synthetic` (built-in data), or fewshot.custom.name."""
    custom = {"synthetic": tasks.synthetic_task(recipe.data.synthetic.num_classes)}
    if recipe.fewshot.custom.name:
        custom[recipe.fewshot.custom.name] = _custom_task(recipe)
    return [t for spec in recipe.fewshot.tasks for t in tasks.get_tasks(spec, custom)]


def load_task_split(task: tasks.Task, recipe: Recipe, split: str):
    """One split of a task, labels derived where the task says, from the Hub or --data-root."""
    source = tasks.task_source(task, recipe.fewshot.data_root)
    label_column = "" if task.label_rule else task.label_column  # a rule builds `label` from raw fields
    ds = data.load_source(source, split, image_column=task.image_column, label_column=label_column,
                          synthetic=recipe.data.synthetic)
    return tasks.apply_label_rule(task, ds) if task.label_rule else ds


def data_id(task: tasks.Task, recipe: Recipe) -> str:
    """Where a task's images come from, for the feature-cache key; the built-in data is defined by its config."""
    source = tasks.task_source(task, recipe.fewshot.data_root)
    if source == "synthetic":
        return f"synthetic:{json.dumps(dataclasses.asdict(recipe.data.synthetic), sort_keys=True)}"
    return source


def data_cfg(task: tasks.Task, recipe: Recipe) -> DataConfig:
    """The recipe's data settings with the task's columns (a label rule writes `label`)."""
    cfg = copy.deepcopy(recipe.data)
    cfg.image_column, cfg.label_column = task.image_column, "label" if task.label_rule else task.label_column
    cfg.binary_pixels = task.binary_pixels
    return cfg


def evaluate_task(train, test, num_classes: int, recipe: Recipe, name: str) -> list[dict]:
    """One row per (shots, seed): accuracy and the λ used. Shot counts a class cannot fill are skipped."""
    (x_tr, y_tr), (x_te, y_te) = train, test
    f = recipe.fewshot
    rows = []
    for shots in sorted(f.shots):
        for seed in range(f.seeds):
            try:
                idx = solver.sample_shots(y_tr, shots, seed, num_classes)
            except DataError as e:
                console.log(f"[yellow]{name}: skipping {shots}-shot: {e}")
                break
            acc, l2 = solver.score(x_tr[idx], y_tr[idx], x_te, y_te, num_classes, f.l2_reg)
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

    def __init__(self, recipe: Recipe, dist: Dist):
        self.recipe, self.dist = recipe, dist
        self.tasks = recipe_tasks(recipe)
        self.splits = {t.name: [load_task_split(t, recipe, s) for s in (t.train_split, t.test_split)]
                       for t in self.tasks}  # read once, reused every run
        self.skipped = batches.Skipped()  # kept across runs: a corrupt image is warned about once

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        img_size, resize = preprocessing(self.recipe)
        for task in self.tasks:
            cfg = data_cfg(task, self.recipe)
            sets = [features.extract(model, ds, cfg, img_size, resize, self.dist, self.recipe.run.precision,
                                     skipped=self.skipped) for ds in self.splits[task.name]]
            rows = evaluate_task(sets[0], sets[1], task.num_classes, self.recipe, task.name)
            for (name, shots), (mean, _) in summarise(rows).items():
                yield f"fewshot/{name}/{shots}shot", mean
