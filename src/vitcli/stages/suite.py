"""`vit evaluate --suite ROOT`: an ImageNet-1k checkpoint on every ImageNet set found under ROOT
(val, V2, A, R, Sketch: vitcli.evaluators.robustness.SUITE_FOLDERS), each scored as its paper scores
it, in one table beside the clean accuracy (and ReaL on ImageNet's val). Each set's own
results.json, recipe.yaml and report go to WORKDIR/<folder>/ (vitcli.stages.evaluate); the table to
WORKDIR/results.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.table import Table

from vitcli.data.rows import imagenet, sources
from vitcli.errors import DataError
from vitcli.evaluators import classify, robustness
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.run.report import number
from vitcli.runtime import finished
from vitcli.runtime.dist import setup
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.run_files import EVALUATE_FILE, RECIPE_FILE
from vitcli.runtime.workdir import check_workdir, refuse_other_run

# looked up at call time, as the CLI looks the stage up
from vitcli.stages import evaluate as one_set

ROW_KEYS = ("images", "imagenet_set/classes", "top1", "top5", "loss", "real/top1", "real/top5", "real/images",
            "ece", "nll", "tta/top1", "tta/top5", "skipped_images")


def evaluate_suite(recipe: Recipe, workdir: Path, root: Path, real_path: Path | None = None,
                   real: list[list[int]] | None = None, tta: tuple[str, ...] = (),
                   overwrite: bool = False) -> dict:
    """Evaluate the checkpoint on each set under `root`; `real` (read from `real_path`) scores
    ImageNet's val, else timm's copy of ReaL does when its files are ILSVRC2012_val_*; `tta`:
    evaluate's test-time views, on every set. A set this request finished is read, not evaluated
    again, unless `overwrite` (vitcli.runtime.finished), and the suite's own files are rewritten
    only when they change. Returns results.json's content."""
    check_workdir(workdir)
    refuse_other_run(workdir, recipe.stage)
    found = robustness.find_sets(root)
    imagenet.require_imagenet_head("--suite", recipe.init.checkpoint, recipe.model.num_classes)
    console.log(f"suite {root}: {', '.join(path.name for _, path in found)}")
    sets = {}
    for name, path in found:
        r = set_recipe(recipe, path)
        given = _real_for(r, real_path, real) if name == "imagenet" else {}
        results = one_set.evaluate(r, workdir / path.name, imagenet_set=name, tta=tta, overwrite=overwrite,
                                   **given)
        sets[path.name] = {"set": name, "path": str(path), "split": r.data.test_split,
                           **{k: results[k] for k in ROW_KEYS if k in results}}
        ran = results["run/precision"]  # what `auto` became, the same for every set
    results = {"stage": "evaluate", "checkpoint": recipe.init.checkpoint, "suite": str(root), "sets": sets,
               "run/precision": ran}
    if setup(recipe.run.device).is_main:
        if overwrite:
            finished.set_aside_results(workdir, (EVALUATE_FILE, RECIPE_FILE))
        texts = ((RECIPE_FILE, to_yaml(recipe)), (EVALUATE_FILE, json.dumps(results, indent=2) + "\n"))
        for name, text in texts:
            # a repeat: no write
            if not (workdir / name).is_file() or (workdir / name).read_text() != text:
                write_text(workdir / name, text)
        report(results)
    return results


def set_recipe(recipe: Recipe, path: Path) -> Recipe:
    """The recipe that reads one set: the folder as data.source with the image folder's columns, its
    split `validation` when it has one (ImageNet's val/), else its only split (an image folder of
    classes)."""
    data = dataclasses.replace(recipe.data, source=str(path), image_column="image", label_column="label",
                               label_rule="", num_classes=0)
    splits = sources.available_splits(data.source, data.synthetic)
    if "validation" not in splits and len(splits) != 1:
        raise DataError(f"{path}: splits {', '.join(splits)}; a suite set needs a 'validation' split or one "
                        "split only")
    split = "validation" if "validation" in splits else splits[0]
    return dataclasses.replace(recipe, data=dataclasses.replace(data, test_split=split, val_split=""))


def _real_for(recipe: Recipe, real_path: Path | None, real: list[list[int]] | None) -> dict:
    """evaluate's ReaL arguments for ImageNet's val: the labels given, else timm's copy when every
    file of the split is an ILSVRC2012_val_* (else none, said in a log line)."""
    if real is not None:
        return {"real_path": real_path, "real": real}
    names = sources.file_names(recipe.data, sources.load_split(recipe.data, recipe.data.test_split))
    if names and all(classify.real_file_number(n) for n in names):
        return {"real_path": imagenet.REAL_FILE,
                "real": classify.read_real_labels(imagenet.REAL_FILE, imagenet.NUM_CLASSES)}
    console.log(f"{recipe.data.source}: its files are not all ILSVRC2012_val_*: no ReaL score (pass "
                "--real-labels to match by row order)")
    return {}


def report(results: dict) -> None:
    """One table: a row per set, the clean set's first, with its top-1 difference to the clean
    one."""
    rows = results["sets"]
    clean = next((row["top1"] for row in rows.values() if row["set"] == "imagenet"), None)
    table = Table(title=f"{results['checkpoint']} on {results['suite']}")
    for col in ("folder", "set", "classes", "images", "top1", "top5", "real/top1", "top1 - clean"):
        table.add_column(col, justify="left" if col in ("folder", "set") else "right")
    for folder, row in rows.items():
        values = [row.get(k) for k in ("imagenet_set/classes", "images", "top1", "top5", "real/top1")]
        gap = None if clean is None or row["set"] == "imagenet" else row["top1"] - clean
        table.add_row(folder, robustness.TITLES[row["set"]],
                      *["-" if v is None else number(v) if isinstance(v, float) else str(v) for v in values],
                      "-" if gap is None else f"{gap:+.4f}")
    stdout.print(table)
