"""Frozen-feature evaluation of one model on the recipe's tasks: features -> every shots x seed
few-shot score, and the all-data protocols (fewshot.protocols) on the same features.

Shared by `vit eval-fewshot` (stages/fewshot.py, with a feature cache) and by the in-training
evaluator below (no cache: the weights change between calls). Both score few-shot through
`solver.score`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import numpy as np
import torch

from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources, tasks
from vitcli.errors import DataError
from vitcli.fewshot import features, protocols, solver
from vitcli.recipe.schema import DataConfig, Recipe
from vitcli.runtime.dist import Dist


def preprocessing(recipe: Recipe) -> tuple[int, int, str]:
    """(img_size, resize, resize_method): big_vision resizes to 256 x 256 and centre-crops 224, and
    scales that as `int(256 / 224 * res)` (configs/proj/cappa/pretrain.py: 384 -> 438, 32 -> 36)."""
    img_size, f = recipe.model.img_size, recipe.fewshot
    return img_size, int(f.resize / 224 * img_size), f.resize_method


def _custom_task(recipe: Recipe) -> tasks.Task:
    c = recipe.fewshot.custom  # its source is given: vitcli.recipe.checks
    num_classes = c.num_classes or sources.num_classes(
        DataConfig(label_column=c.label_column),
        sources.load_source(c.source, c.train_split, image_column=c.image_column, label_column=c.label_column,
                         synthetic=recipe.data.synthetic),
    )
    return tasks.Task(c.name, "custom", num_classes, c.source, {"train": c.train_split, "test": c.test_split},
                      c.image_column, c.label_column)


def recipe_tasks(recipe: Recipe) -> list[tasks.Task]:
    """The tasks fewshot.tasks names: registry names, `synthetic` (built-in data), or
    fewshot.custom.name."""
    custom = {"synthetic": tasks.synthetic_task(recipe.data.synthetic.num_classes)}
    if recipe.fewshot.custom.name:
        custom[recipe.fewshot.custom.name] = _custom_task(recipe)
    return [t for spec in recipe.fewshot.tasks for t in tasks.get_tasks(spec, custom)]


def load_task_split(task: tasks.Task, recipe: Recipe, split: str):
    """One split of a task, labels derived where the task says, from the Hub or --data-root."""
    return sources.load_split(data_cfg(task, recipe), split)


def open_splits(chosen: list[tasks.Task], recipe: Recipe) -> None:
    """Open every task's train and test split (no image is decoded) before the first feature is
    extracted or cached: a split that is missing is one line naming the key that chose it, not an
    error after the train features were extracted and written."""
    for task in chosen:
        for role, split in (("train", task.train_split), ("test", task.test_split)):
            try:
                load_task_split(task, recipe, split)
            except DataError as e:
                key = (f"fewshot.custom.{role}_split='{split}'" if task.group == "custom"
                       else f"task {task.name}'s {role} split '{split}'")
                raise DataError(f"{key}: {e}" + (" (a slice such as train[80%:] is a split too)"
                                                  if task.group == "custom" else "")) from None


def data_id(task: tasks.Task, recipe: Recipe) -> str:
    """Where a task's images come from, for the feature-cache key; the built-in data is
    defined by its config."""
    source = tasks.task_source(task, recipe.fewshot.data_root)
    if source == "synthetic":
        return f"synthetic:{json.dumps(dataclasses.asdict(recipe.data.synthetic), sort_keys=True)}"
    return source


def data_cfg(task: tasks.Task, recipe: Recipe) -> DataConfig:
    """The recipe's data settings reading the task (sources.task_data, as VTAB fine-tuning reads
    it)."""
    return dataclasses.replace(recipe.data, **sources.task_data(task, recipe.fewshot.data_root))


def evaluate_task(train, test, num_classes: int, recipe: Recipe, name: str) -> list[dict]:
    """One row per (shots, seed): accuracy, the λ used, and the shot set's size and short classes
    (ShotSet.record). A class with fewer than `shots` train examples gives what it has, as in
    big_vision."""
    (x_tr, y_tr), (x_te, y_te) = train, test
    f = recipe.fewshot
    rows = []
    for shots in sorted(f.shots):
        for seed in range(f.seeds):
            try:
                drawn = solver.sample_shots(y_tr, shots, seed, num_classes)
            except DataError as e:  # an empty train split: no shot count can be scored
                raise DataError(f"{name}: {e}") from None
            idx = drawn.indices
            acc, l2 = solver.score(x_tr[idx], y_tr[idx], x_te, y_te, num_classes, f.l2_reg)
            rows.append({"task": name, "shots": shots, "seed": seed, "l2_reg": l2, "accuracy": acc,
                         **drawn.record()})
    return rows


def draws(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """(task, shots) -> its shot sets' record (solver.DRAW_FIELDS), the same for every seed: the
    class sizes decide it. `short_classes` > 0 marks a (task, shots) scored on fewer than shots *
    classes examples."""
    return {(r["task"], r["shots"]): {k: r[k] for k in solver.DRAW_FIELDS} for r in rows}


def summarise(rows: list[dict]) -> dict[tuple[str, int], tuple[float, float]]:
    """(task, shots) -> (mean, population std) of accuracy over seeds."""
    out = {}
    for key in sorted({(r["task"], r["shots"]) for r in rows}):
        accs = [r["accuracy"] for r in rows if (r["task"], r["shots"]) == key]
        out[key] = (float(np.mean(accs)), float(np.std(accs)))
    return out


class FewshotEvaluator:
    """Frozen-feature scores of the model being trained (no feature cache), one extraction per split
    serving every protocol of fewshot.protocols: `fewshot/<task>/<k>shot`, `knn/<task>/top1`,
    `linear/...`."""

    def __init__(self, recipe: Recipe, dist: Dist):
        self.recipe, self.dist = recipe, dist
        self.tasks = recipe_tasks(recipe)
        self.splits = {t.name: [load_task_split(t, recipe, s) for s in (t.train_split, t.test_split)]
                       for t in self.tasks}  # read once, reused every run
        # kept across runs: a corrupt image is warned about once
        self.skipped = bad_images.Skipped()

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        img_size, resize, method = preprocessing(self.recipe)
        for task in self.tasks:
            cfg = data_cfg(task, self.recipe)
            sets = [features.extract(model, ds, cfg, img_size, resize, self.dist, self.recipe.run.precision,
                                     skipped=self.skipped, resize_method=method)
                    for ds in self.splits[task.name]]
            if "fewshot" in self.recipe.fewshot.protocols:
                yield from fewshot_metrics(evaluate_task(sets[0], sets[1], task.num_classes, self.recipe,
                                                         task.name))
            scored = protocols.task_rows(sets[0], sets[1], task.num_classes, self.recipe.fewshot, task.name,
                                         self.dist.device)
            yield from protocols.metrics(scored)


def fewshot_metrics(rows: list[dict]) -> Iterator[tuple[str, float]]:
    """`fewshot/<task>/<k>shot` (mean over seeds); where a class is short also
    `.../<k>shot/short_classes` and `.../<k>shot/examples` (the shot set's size, below k *
    classes)."""
    drawn = draws(rows)
    for (name, shots), (mean, _) in summarise(rows).items():
        yield f"fewshot/{name}/{shots}shot", mean
        if drawn[(name, shots)]["short_classes"]:
            yield f"fewshot/{name}/{shots}shot/short_classes", drawn[(name, shots)]["short_classes"]
            yield f"fewshot/{name}/{shots}shot/examples", drawn[(name, shots)]["examples"]
