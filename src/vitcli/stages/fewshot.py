"""`vit eval-fewshot`: features per task (cached), every shots x seed few-shot score and the
all-data protocols (fewshot.protocols: kNN, logistic probe, ridge) on the same features; tables,
files (rank 0)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from vitcli.checkpoints.preprocessing import FEED, SIGNED
from vitcli.checkpoints.read import locate_checkpoint
from vitcli.checkpoints.transfer import load_for_eval, preprocessing_row
from vitcli.data.decoding import bad_images
from vitcli.data.rows import tasks
from vitcli.fewshot import features, protocols, report
from vitcli.fewshot.evaluate import (
    data_cfg,
    data_id,
    evaluate_task,
    load_task_split,
    open_splits,
    preprocessing,
    recipe_tasks,
)
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.runtime import finished
from vitcli.runtime.dist import Dist, setup
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.precision import resolved_for
from vitcli.runtime.run_files import FEATURES_DIR, FEWSHOT_FILE, FEWSHOT_OUTPUTS, RECIPE_FILE
from vitcli.runtime.workdir import check_workdir, refuse_other_run


def eval_fewshot(recipe: Recipe, workdir: Path, overwrite: bool = False) -> dict:
    """Score the checkpoint's frozen features on every task; rank 0 writes recipe.yaml, results.*,
    the cache. A workdir where this request finished is read, not scored again
    (vitcli.runtime.finished), unless `overwrite`. Returns what results.json holds (every run under
    `runs`), on every rank."""
    check_workdir(workdir)
    refuse_other_run(workdir, recipe.stage)
    if recipe.fewshot.cache_dir:
        check_workdir(Path(recipe.fewshot.cache_dir))
    chosen = recipe_tasks(recipe)
    dist = setup(recipe.run.device)
    auto = recipe.run.precision == "auto"
    # the cache key and the extraction see fp32 or bf16, never auto
    recipe, why = resolved_for(recipe, dist.device)
    request = finished.inputs(recipe, locate_checkpoint(recipe.init.checkpoint))
    done = finished.stored(workdir, FEWSHOT_FILE, recipe, request, overwrite, "few-shot evaluation", auto)
    if done is not None:
        if dist.is_main:
            report.show(done["runs"], done["all_data"], workdir)
        return done
    # a missing split is refused before any feature is extracted or written
    open_splits(chosen, recipe)
    console.log(f"inference in {recipe.run.precision} ({why})")
    model = load_for_eval(recipe)
    if recipe.init.random:
        console.log(f"weights: {recipe.init.checkpoint}'s network at random initialisation (run.seed="
                    f"{recipe.run.seed}); nothing is loaded")
        weights = features.state_id(model)
    else:
        console.log("{}: {}".format(*preprocessing_row(recipe, FEED)))
        # a hash of the whole file: once, not per task
        weights = features.weights_id(recipe.init.checkpoint)
    model = model.to(dist.device)
    # undecodable rows over every task's splits, extracted or read from the cache
    skipped = bad_images.Skipped()
    rows, probes = [], []
    for task in chosen:
        few, all_data = _task_rows(task, model, weights, recipe, workdir, dist, skipped)
        rows += few
        probes += all_data
    request = finished.sealed(request)
    if not dist.is_main:
        return report.results(rows, recipe, skipped, probes, request)
    if overwrite:
        finished.set_aside_results(workdir, FEWSHOT_OUTPUTS)
    write_text(workdir / RECIPE_FILE, to_yaml(recipe))
    return report.write(rows, workdir, recipe, skipped, probes, request)


def _task_rows(task: tasks.Task, model, weights: str, recipe: Recipe, workdir: Path, dist: Dist,
               skipped: bad_images.Skipped) -> tuple[list[dict], list[dict]]:
    """Features of the task's train and test splits (from the cache when there), then its few-shot
    rows and its all-data protocols' rows (fewshot.protocols), every protocol on the same
    features."""
    cache_dir = Path(recipe.fewshot.cache_dir) if recipe.fewshot.cache_dir else workdir / FEATURES_DIR
    img_size, resize, method = preprocessing(recipe)
    pre = {"img_size": img_size, "resize": resize, "resize_method": method, "precision": recipe.run.precision,
           # dSprites' 0/1 pixels decode differently since they are scaled
           "binary_pixels": task.binary_pixels}
    # [-1, 1]: the keys it had
    if recipe.data.mean != SIGNED["mean"] or recipe.data.std != SIGNED["std"]:
        pre.update(mean=recipe.data.mean, std=recipe.data.std)
    sets = []
    for split in (task.train_split, task.test_split):
        key = features.cache_key(weights, f"{task.name}:{data_id(task, recipe)}", split, pre)

        def extract(split=split):  # only on a cache miss: no decoding for a hit
            ds = load_task_split(task, recipe, split)
            return features.extract(model, ds, data_cfg(task, recipe), img_size, resize, dist,
                                    recipe.run.precision, skipped=skipped, resize_method=method)

        feats, labels, hit = features.cached(cache_dir, key, extract, write=dist.is_main, skipped=skipped,
                                            dist=dist)
        console.log(f"{task.name} {split}: {len(labels)} features {'(cached)' if hit else 'extracted'}")
        sets.append((feats, labels))
    few = (evaluate_task(sets[0], sets[1], task.num_classes, recipe, task.name)
           if "fewshot" in recipe.fewshot.protocols else [])
    return few, protocols.task_rows(sets[0], sets[1], task.num_classes, recipe.fewshot, task.name,
                                    dist.device)


def print_registry() -> list[dict]:
    """`--list-tasks`: the task registry as a table; returned as one record per task."""
    rows = [{"task": t.name, "group": t.group, "classes": t.num_classes, "source": t.source,
             "train": t.train_split, "test": t.test_split}
            for t in tasks.get_tasks("vtab") + tasks.get_tasks("standard")]
    table = Table(title="few-shot tasks")
    for col in rows[0]:
        table.add_column(col)
    for row in rows:
        table.add_row(*map(str, row.values()))
    stdout.print(table)
    return rows
