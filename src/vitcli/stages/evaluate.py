"""`vit evaluate`: a checkpoint's own head on one split: top-1, top-5, the recipe's loss, per-class
accuracy, a confusion matrix, and ImageNet ReaL with --real-labels; WORKDIR/results.json and
confusion.png (rank 0).

The network is the checkpoint as it is (head and representation layer), at the resolution and with
the eval preprocessing it was trained with (vitcli.checkpoints.complete.trained_with), which recipe
keys override. The split is shared over torchrun's processes and its per-row predictions gathered
back in row order, so the numbers do not depend on how many processes ran it; images that do not
decode are left out and counted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from vitcli.checkpoints.complete import trained_precision
from vitcli.checkpoints.read import locate_checkpoint, read_checkpoint
from vitcli.checkpoints.transfer import (
    class_names,
    head_names,
    load_for_eval,
    preprocessing_row,
    scored_weights,
)
from vitcli.data.batching import batches
from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources
from vitcli.errors import DataError
from vitcli.evaluators import calibration, classify, robustness
from vitcli.evaluators.inference import in_row_order, sharded_pass
from vitcli.figures.confusion import MAX_CLASSES, write_confusion
from vitcli.recipe.layers import to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.run.report import number
from vitcli.runtime import finished
from vitcli.runtime.dist import Dist, all_reduce_sum, setup
from vitcli.runtime.files import sha256_of, write_text
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.precision import resolved_for
from vitcli.runtime.run_files import CONFUSION_PLOT, EVALUATE_FILE, EVALUATE_OUTPUTS, RECIPE_FILE
from vitcli.runtime.workdir import check_workdir, refuse_other_run
from vitcli.stages import evaluate_extra
from vitcli.train.losses import loss_fn

TOP_K = 5  # top-5 is reported when the head has at least this many classes


def evaluate(recipe: Recipe, workdir: Path, real_path: Path | None = None,
             real: list[list[int]] | None = None, imagenet_set: str | None = None, tta: tuple[str, ...] = (),
             calibrate_on: str | None = None, overwrite: bool = False) -> dict:
    """Evaluate the checkpoint on data.test_split (else val_split); `real`: `real_path`'s ReaL lists
    (classify.read_real_labels); `imagenet_set`: robustness.SETS's, else detected; `tta`: test-time
    views (evaluators.tta); `calibrate_on`: a split to fit a temperature on (evaluate_extra). A
    request finished in `workdir` is read back, unless `overwrite`. Returns results.json's dict."""
    check_workdir(workdir)
    refuse_other_run(workdir, recipe.stage)
    dist = setup(recipe.run.device)
    auto = recipe.run.precision == "auto"
    recipe, why = resolved_for(recipe, dist.device, trained_precision(recipe.init.checkpoint))
    split = recipe.data.test_split or recipe.data.val_split
    evaluate_extra.check_held_out(calibrate_on, split, recipe.optim.loss)
    request = _request(recipe, real_path, imagenet_set, tta, calibrate_on)
    done = finished.stored(workdir, EVALUATE_FILE, recipe, request, overwrite, "evaluation", auto)
    if done is not None:
        if dist.is_main:
            report(done)
        return done
    ds = sources.load_split(recipe.data, split)
    # before the long pass
    held = sources.load_split(recipe.data, calibrate_on) if calibrate_on else None
    num_classes = recipe.model.num_classes
    scoring = _checked_scoring(ds, held, recipe, imagenet_set, split, calibrate_on)
    entries = _real_entries(ds, recipe, real_path, real) if real else None  # before the long pass
    loaded = read_checkpoint(recipe.init.checkpoint)
    split_names = sources.class_names(recipe.data, ds, num_classes) if scoring is None else None
    # said early
    other_names = _other_names(class_names(loaded, num_classes), split_names, recipe, split)
    model = load_for_eval(recipe, recipe.model.num_classes).to(dist.device)
    console.log(f"evaluate: {recipe.init.checkpoint} ({num_classes} classes, {recipe.model.img_size} px) on "
                f"{sources.origin(ds)}, {len(ds)} images in {recipe.run.precision} ({why})")
    console.log("{}: {}".format(*preprocessing_row(recipe)))
    skipped = bad_images.Skipped()
    k = min(TOP_K, num_classes if scoring is None else len(scoring.columns))
    columns = None if scoring is None else torch.as_tensor(scoring.columns, device=dist.device)
    extra = evaluate_extra.per_row(recipe.optim.loss == "softmax", tuple(tta), held is not None, k, columns)
    rows, top, probs, labels, loss_sum, (nll, tta_top, logits) = predictions(model, ds, recipe, dist, skipped,
                                                                              k, extra, scoring)
    names, names_from = head_names(loaded, num_classes)
    # the split's labels are the head's classes: its names are theirs
    if names is None and scoring is None:
        names, names_from = split_names, "split"
    results = {"stage": "evaluate", "checkpoint": recipe.init.checkpoint, "data": recipe.data.source,
               "split": split, "images": len(rows), "classes": num_classes,
               **scores(top, labels, loss_sum, num_classes, names), "run/precision": recipe.run.precision,
               **evaluate_extra.calibration_results(top, probs, labels, nll),
               **evaluate_extra.tta_results(tta_top, labels, tuple(tta), k >= TOP_K)}
    _describe(results, names_from if names is not None else None, other_names, loaded, scoring)
    if held is not None:
        results.update(_temperature(model, held, calibrate_on, recipe, dist, logits, top, labels, scoring))
    if entries is not None:
        results.update(real_scores(top, entries[0][rows], real, entries[1]))
    if skipped.total:
        results["skipped_images"] = skipped.total
    results["inputs"] = finished.sealed(request)
    if dist.is_main:
        _save(results, (top, probs, labels), names, recipe, workdir, overwrite)
    return results


def _request(recipe: Recipe, real_path: Path | None, imagenet_set: str | None, tta: tuple[str, ...],
             calibrate_on: str | None) -> dict:
    """What makes this evaluation the one a workdir may hold finished (vitcli.runtime.finished): the
    recipe, the checkpoint file, and the options that change what is scored."""
    return finished.inputs(recipe, locate_checkpoint(recipe.init.checkpoint), tta=list(tta),
                           calibrate_on=calibrate_on, imagenet_set=imagenet_set,
                           real_labels=real_path and f"{Path(real_path).resolve()} {sha256_of(real_path)}")


def _checked_scoring(ds, held, recipe: Recipe, imagenet_set: str | None, split: str,
                     calibrate_on: str | None) -> robustness.Scoring | None:
    """How the split is scored (None: its labels are the head's own, then checked against the head,
    as the held-out split's are)."""
    scoring = _scoring(ds, recipe, imagenet_set)
    if scoring is None:
        _check_labels(ds, recipe, split)
        if held is not None:
            _check_labels(held, recipe, calibrate_on)
    return scoring


def _save(results: dict, scored: tuple, names, recipe: Recipe, workdir: Path, overwrite: bool) -> None:
    """The files, results.json last; with `overwrite` the finished ones set aside first. `scored`:
    (top, probs, labels) of the long pass."""
    top, probs, labels = scored
    if overwrite:
        finished.set_aside_results(workdir, EVALUATE_OUTPUTS)
    evaluate_extra.write_plot(results, top, probs, labels, workdir)
    _write(results, top, labels, names, recipe, workdir)


def _describe(results: dict, names_from: str | None, other_names: dict, loaded, scoring) -> None:
    """What results.json says of what was scored, in place: where the class names come from, how
    many differ from the split's, which weights (live or EMA), and an ImageNet set's classes
    (per_class cut to them)."""
    if names_from is not None:
        results["class_names_from"] = names_from
    results.update(other_names)
    if scored_weights(loaded):
        results["weights"] = scored_weights(loaded)
    if scoring is not None:
        results.update({"imagenet_set": scoring.name, "imagenet_set/classes": len(scoring.columns),
                        "imagenet_set/labels_by": scoring.labels_by})
        # A's and R's 200: the other 800 rows could only be empty
        scored = set(scoring.columns.tolist())
        results["per_class"] = [row for row in results["per_class"] if row["class"] in scored]


def _temperature(model, held, held_split: str, recipe: Recipe, dist: Dist, logits: np.ndarray,
                 top: np.ndarray, labels: np.ndarray, scoring: robustness.Scoring | None) -> dict:
    """ts/...: a temperature fitted on the held-out split's logits (its own pass; an ImageNet set's
    cut to its classes, as the evaluated split's), applied to the evaluated split's `logits` (N, K)
    for ECE and NLL after scaling."""
    extra = evaluate_extra.per_row(True, (), True, 1)
    found = predictions(model, held, recipe, dist, bad_images.Skipped(), 1, extra, scoring)
    held_labels, held_logits = found[3], found[5][2]
    temperature = calibration.fit_temperature(held_logits, held_labels)
    console.log(f"evaluate: temperature {temperature:.4f} fitted on split '{held_split}' "
                f"({len(held_labels)} images)")
    return evaluate_extra.scaled_results(temperature, held_split, len(held_labels), logits, top, labels)


def _other_names(own: list[str] | None, split_names: list[str] | None, recipe: Recipe, split: str) -> dict:
    """Warn, once, when the checkpoint's own class names and the split's (its ClassLabel, an image
    folder's folders) differ beyond spelling: a Fashion-MNIST head scored on MNIST digits would
    otherwise call digit 0 "tshirt" in silence. A warning and `class_names/differ` (how many) in
    results.json, not a refusal: one dataset's copies name their classes differently ("T-shirt/top",
    "tshirt", "0") and that evaluation is right; a label beyond the head, which is certainly another
    dataset, is refused (_check_labels). Where either side has no names (foreign weights, integer
    labels, a label rule) there is nothing to compare."""
    if own is None or split_names is None:
        return {}
    # "T-shirt/top" and "tshirt_top" are one name
    mine, theirs = ([re.sub(r"[^0-9a-z]", "", n.lower()) for n in names] for names in (own, split_names))
    differ = [k for k, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
    if not differ:
        return {}
    shown = "; ".join(f"label {k}: '{own[k]}' in the checkpoint, '{split_names[k]}' in the split"
                      for k in differ[:3]) + ("; ..." if len(differ) > 3 else "")
    order = " (the same names in another order)" if sorted(mine) == sorted(theirs) else ""
    console.log(f"[yellow]warning: {len(differ)} of {len(own)} class names of {recipe.init.checkpoint} "
                f"differ from {recipe.data.source} split '{split}'{order} ({shown}): is this the data it was "
                "trained on? Labels are scored by their index")
    return {"class_names/differ": len(differ)}


def _check_labels(ds, recipe: Recipe, split: str) -> None:
    """Every label of the split must have a logit: a label beyond the head is another dataset's."""
    top = int(batches.labels(ds, recipe.data.label_column).max())
    if top >= recipe.model.num_classes:
        raise DataError(f"{recipe.data.source} split '{split}' has label {top}, but the head of "
                        f"{recipe.init.checkpoint} has {recipe.model.num_classes} classes: this is not the "
                        "data it was trained on")


def _scoring(ds, recipe: Recipe, named: str | None) -> robustness.Scoring | None:
    """How the split is scored when it is an ImageNet set (robustness.detect); None otherwise."""
    column = recipe.data.label_column
    own = class_names(read_checkpoint(recipe.init.checkpoint), recipe.model.num_classes)
    top = int(batches.labels(ds, column).max())
    return robustness.detect(robustness.label_names(ds.features, column), top, recipe.model.num_classes, own,
                             named, recipe.init.checkpoint)


def predictions(model: torch.nn.Module, ds, recipe: Recipe, dist: Dist, skipped: bad_images.Skipped,
                k: int, extra=None, scoring: robustness.Scoring | None = None) -> tuple:
    """(rows (N,), top-k classes (N, k) best first, their probabilities (N, k), labels (N,), loss
    summed over the rows) of the split in row order, on every rank; probabilities are the loss's own
    (softmax, or sigmoid for a sigmoid-loss model). Undecodable rows are left out and join
    `skipped`, which names each once (this rank's own tally stays quiet). With `extra(model, x,
    logits, y)`, which returns more per-row arrays of a batch (each (B, ...)), those too, gathered
    in row order, as a sixth element (a tuple). With `scoring` (an ImageNet set) the logits are cut
    to its classes (`extra` sees them cut) and the classes and labels returned are the head's. A
    collective call."""
    loss = loss_fn(recipe.optim)
    own = bad_images.Skipped(warn=False)

    def per_batch(model, i, x, y):
        logits = model(x).float()  # (B, K)
        if scoring is not None:
            # (B, S) of the set's classes; y: positions among them
            logits, y = scoring.restrict(logits, y)
        probs = logits.softmax(-1) if recipe.optim.loss == "softmax" else logits.sigmoid()
        p, idx = probs.topk(k, dim=-1)  # (B, k), best first
        more = extra(model, x, logits, y) if extra else ()
        return idx.cpu().numpy(), p.cpu().numpy(), y.cpu().numpy(), *more, loss(logits, y).item() * len(y)

    parts = sharded_pass(model, ds, recipe.data, recipe.model.img_size, dist, recipe.run.precision, per_batch,
                         own)
    columns = range(len(parts[0]) - 1) if parts else ()  # the per-row arrays; the loss sum last
    arrays = tuple(np.concatenate([part[j] for part in parts]) for j in columns) if parts else None
    (loss_sum,) = all_reduce_sum([sum(part[-1] for part in parts)], dist)
    gathered = in_row_order(arrays, own.rows, len(ds), dist, skipped)
    if gathered is None:  # an empty split (load_split refuses one; a caller's own Dataset may be)
        raise DataError(f"{sources.origin(ds)}: no images")
    if scoring is not None:  # positions among the set's classes -> the head's classes
        gathered = (gathered[0], scoring.columns[gathered[1]], gathered[2], scoring.columns[gathered[3]],
                    *gathered[4:])
    return (*gathered[:4], loss_sum, *((tuple(gathered[4:]),) if extra else ()))


def scores(top: np.ndarray, labels: np.ndarray, loss_sum: float, num_classes: int,
           names: list[str] | None) -> dict:
    """top1, top5 (with >= 5 classes), mean loss and per-class accuracy of gathered predictions."""
    n = max(len(labels), 1)
    out = {"top1": float(classify.top_k_correct(top, labels, 1).sum() / n)}
    if num_classes >= TOP_K:
        out["top5"] = float(classify.top_k_correct(top, labels, TOP_K).sum() / n)
    out["loss"] = loss_sum / n
    confusion = classify.confusion_matrix(labels, top[:, 0], num_classes)
    out["per_class"] = [{"class": k, "name": names[k] if names else str(k), "images": int(confusion[k].sum()),
                         "top1": acc} for k, acc in enumerate(classify.per_class_accuracy(confusion))]
    return out


def _real_entries(ds, recipe: Recipe, path: Path, real: list[list[int]]) -> tuple[np.ndarray, str]:
    """Each row's ReaL entry and how rows were matched (by ILSVRC2012_val file number, else row
    order)."""
    return classify.real_entries(sources.file_names(recipe.data, ds), len(ds), len(real), path)


def real_scores(top: np.ndarray, entries: np.ndarray, real: list[list[int]], matched_by: str) -> dict:
    """real/top1 (and real/top5 with 5 predictions per row) over the rows whose ReaL list is not
    empty."""
    out = {}
    for k in (1, TOP_K) if top.shape[1] >= TOP_K else (1,):
        right, counted = classify.real_top_k(top, entries, real, k)
        out[f"real/top{k}"] = right / max(counted, 1)
    out["real/images"] = counted  # rows with a valid label; empty lists are left out, as ReaL does
    out["real/matched_by"] = matched_by
    return out


def _write(results: dict, top: np.ndarray, labels: np.ndarray, names: list[str] | None, recipe: Recipe,
           workdir: Path) -> None:
    """recipe.yaml, confusion.png (up to MAX_CLASSES classes), results.json; then the report (rank
    0)."""
    k = results["classes"]
    if k <= MAX_CLASSES:
        title = (f"{Path(recipe.init.checkpoint).name} on {results['data']} {results['split']}: "
                 f"top-1 {results['top1']:.3f}")
        write_confusion(classify.confusion_matrix(labels, top[:, 0], k), names or [str(i) for i in range(k)],
                        title, workdir / CONFUSION_PLOT)
        results["confusion_png"] = str(workdir / CONFUSION_PLOT)
    else:
        console.log(f"{k} classes: no {CONFUSION_PLOT} (drawn up to {MAX_CLASSES})")
    write_text(workdir / RECIPE_FILE, to_yaml(recipe))
    write_text(workdir / EVALUATE_FILE, json.dumps(results, indent=2) + "\n")
    report(results)


def robustness_line(results: dict) -> str:
    """How an ImageNet set was scored, for the report's first line; "" for any other split."""
    name = results.get("imagenet_set")
    if name is None:
        return ""
    over = f"its {results['imagenet_set/classes']} classes" if results["imagenet_set/classes"] < 1000 else (
        "all 1000 classes")
    return (f"; scored as {robustness.TITLES[name]} over {over} (labels by "
            f"{results['imagenet_set/labels_by']})")


def report(results: dict) -> None:
    """The numbers as a table; per-class accuracy as a second one when there are few classes."""
    matched = results.get("real/matched_by")
    stdout.print(f"{results['checkpoint']} on {results['images']} images of {results['data']} split "
                 f"'{results['split']}'" + (f"; ReaL labels matched by {matched}" if matched else "")
                 + robustness_line(results))
    table = Table(title="evaluate")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("top1", "top5", "loss", *evaluate_extra.REPORTED, "real/top1", "real/top5", "real/images",
                "skipped_images"):
        if key in results:
            value = results[key]
            table.add_row(key, number(value) if isinstance(value, float) else str(value))
    stdout.print(table)
    if results["classes"] <= 30:
        per_class = Table(title="per-class top-1")
        for col in ("class", "name", "images", "top1"):
            per_class.add_column(col, justify="left" if col == "name" else "right")
        for row in results["per_class"]:
            acc = "-" if row["top1"] is None else f"{row['top1']:.4f}"
            per_class.add_row(str(row["class"]), row["name"], str(row["images"]), acc)
        stdout.print(per_class)
