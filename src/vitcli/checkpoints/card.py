"""The model card (README.md) of an exported folder: YAML front matter the Hub reads (library_name,
pipeline_tag, tags, the licence where the source states one, the training data, and `model-index`
with each result as dataset, split, metric and value), then the network, its training data, the
results, the preprocessing and the recipe it was trained with.

Results come from the checkpoint's run, summary.json beside its model.safetensors (val/ and test/
metrics, and the frozen-feature ones a run logs: fewshot/, knn/, linear/, ridge/), and from the
folders `vit export --results` names: `vit evaluate`'s results.json, `vit eval-fewshot`'s
results.json (its few-shot means and all-data probes), a VTAB run's vtab.json. A results.json that
records another checkpoint file (inputs.checkpoint.sha256) is refused, before anything is written.
model-index follows huggingface_hub's ModelCardData / EvalResult (name, results: task, dataset
{name, type, split}, metrics [{type, name, value}]); the tests parse it back with
huggingface_hub.ModelCard. A card with no results has no model-index and says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from vitcli.data.rows import tasks
from vitcli.errors import DataError, RecipeError
from vitcli.recipe.choices import ALL_DATA_PROTOCOLS
from vitcli.recipe.data_checks import json_object
from vitcli.runtime.files import sha256_of
from vitcli.runtime.run_files import EVALUATE_FILE, MODEL_FILE, SUMMARY_FILE, VTAB_FILE

# a metric's last name -> (model-index metric type, its display name)
METRICS = {"top1": ("accuracy", "Top 1 Accuracy"), "top5": ("top_5_accuracy", "Top 5 Accuracy"),
           "loss": ("loss", "Loss")}
# summary.json: val/top1, test/loss; fewshot/<task>/<k>shot; knn/<task>/top1 (and linear/, ridge/)
HELD_OUT = re.compile(r"(val|test)/(top1|top5|loss)")
FEWSHOT = re.compile(r"fewshot/(.+)/(\d+)shot")
PROBE = re.compile(rf"({'|'.join(ALL_DATA_PROTOCOLS)})/(.+)/(top1|top5)")
PROBE_NAMES = {"knn": "kNN", "linear": "linear probe", "ridge": "ridge probe"}


@dataclass(frozen=True)
class Result:
    """One number of the card: on `dataset`'s `split`, `metric` (the model-index type) is
    `value`."""

    dataset: str
    split: str
    metric: str
    name: str
    value: float
    source: str  # the file it was read from: summary.json (the run's), or as --results named it


@dataclass(frozen=True)
class About:
    """What the card says of the exported network, beside its results."""

    library: str  # transformers | timm: the Hub's library_name
    name: str  # model-index's name: the --out folder's
    network: str
    params: int
    class_names: list[str]
    prep: dict  # stages.export.preprocessing
    recipe: dict  # the training recipe the checkpoint carries; {} for a foreign file
    usage: list[str]  # markdown lines: how the library loads the folder
    license: str = ""  # the source's own, where it states one


def gather(weights: str, recipe: dict, folders: list[Path]) -> list[Result]:
    """The results of the checkpoint at `weights`: its run's summary.json (our workdirs), then each
    of `folders` (--results); a RecipeError naming a folder that holds none, or the results of
    another checkpoint."""
    path = Path(weights)
    data = recipe.get("data") or {}
    found = []
    if path.name == MODEL_FILE and (path.parent / SUMMARY_FILE).is_file():
        # named by the file alone: the card is published, the local path is nobody's business
        found += summary_results(json_object(path.parent / SUMMARY_FILE), data, SUMMARY_FILE)
    for folder in folders:
        found += _folder_results(Path(folder), path)
    return found


def summary_results(summary: dict, data: dict, source: str) -> list[Result]:
    """summary.json's held-out and frozen-feature metrics; the splits are the recipe's (data)."""
    dataset = str(data.get("source") or "unknown")
    splits = {"val": data.get("val_split") or "validation",
              "test": data.get("test_split") or "test"}
    out = []
    for key, value in summary.items():
        # a diverged run's NaN is no result to publish
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            continue
        if m := HELD_OUT.fullmatch(key):
            out.append(Result(dataset, splits[m[1]], *METRICS[m[2]], float(value), source))
        elif m := FEWSHOT.fullmatch(key):
            out.append(_task_result(m[1], "accuracy", f"{m[2]}-shot accuracy", value, source))
        elif m := PROBE.fullmatch(key):
            metric, name = METRICS[m[3]]
            out.append(_task_result(m[2], metric, f"{PROBE_NAMES[m[1]]} {name}", value, source))
    return out


def _folder_results(folder: Path, weights: Path) -> list[Result]:
    """The results in one --results folder: results.json (evaluate or eval-fewshot), vtab.json."""
    vtab, results = json_object(folder / VTAB_FILE), json_object(folder / EVALUATE_FILE)
    if vtab:
        return [_task_result(name, "accuracy", METRICS["top1"][1], row["test/top1"],
                             str(folder / VTAB_FILE))
                for name, row in vtab.items() if isinstance(row, dict) and "test/top1" in row]
    if not results:
        raise RecipeError(f"--results {folder}: holds no {EVALUATE_FILE} or {VTAB_FILE} (the "
                          "folder of a vit evaluate, vit eval-fewshot or VTAB run)")
    _check_same(results, folder, weights)
    source = str(folder / EVALUATE_FILE)
    if results.get("stage") == "evaluate":
        return [Result(str(results.get("data", "unknown")), str(results.get("split", "test")),
                       *METRICS[k], float(results[k]), source) for k in METRICS if k in results]
    if "summary" in results:  # eval-fewshot's
        return _fewshot_results(results, source)
    raise RecipeError(f"--results {folder}: its {EVALUATE_FILE} is neither vit evaluate's nor vit "
                      "eval-fewshot's (an evaluate --suite table: pass one of its set folders)")


def _fewshot_results(results: dict, source: str) -> list[Result]:
    """eval-fewshot's results.json: each task's few-shot means, then its all-data probes."""
    few = [_task_result(r["task"], "accuracy", f"{r['shots']}-shot accuracy (mean of seeds)",
                        r["mean"], source) for r in results["summary"]]
    probes = []
    for r in results.get("all_data", []):
        protocol = PROBE_NAMES.get(r["protocol"], r["protocol"])
        probes += [_task_result(r["task"], METRICS[k][0], f"{protocol} {METRICS[k][1]}", r[k],
                                source) for k in ("top1", "top5") if k in r]
    return few + probes


def _check_same(results: dict, folder: Path, weights: Path) -> None:
    """A RecipeError when `results` records a checkpoint file of other bytes than `weights`."""
    recorded = ((results.get("inputs") or {}).get("checkpoint") or {}).get("sha256")
    if recorded and weights.is_file() and recorded != sha256_of(weights):
        raise RecipeError(f"--results {folder}: its {EVALUATE_FILE} is of "
                          f"{results['inputs']['checkpoint'].get('path')} (another sha256), not of "
                          f"{weights}; pass the results of the checkpoint exported")


def _task_result(task: str, metric: str, name: str, value, source: str) -> Result:
    """A few-shot, probe or VTAB number on a task: its Hub dataset and test split where the task
    registry knows it, else the task's name and `test`."""
    try:
        known = tasks.get_tasks(task)[0]
        dataset, split = known.source, known.test_split
    except (DataError, KeyError, IndexError):
        dataset, split = task, "test"
    return Result(dataset, split, metric, name, float(value), source)


def front_matter(about: About, results: list[Result]) -> dict:
    """The card's YAML metadata, as huggingface_hub's ModelCardData reads it."""
    task = "image-classification" if about.class_names else "image-feature-extraction"
    tags = ["vision", task, "vit", "vitcli", *(["timm"] if about.library == "timm" else [])]
    meta = {"library_name": about.library, "pipeline_tag": task, "tags": tags}
    if about.license:
        meta["license"] = about.license
    source = (about.recipe.get("data") or {}).get("source")
    if source and _hub_dataset(source):
        meta["datasets"] = [source]
    if results:
        meta["model-index"] = [{"name": about.name, "results": _model_index(results)}]
    return meta


def _hub_dataset(source: str) -> bool:
    """A data.source that names a Hub dataset (org/name or name), not a path, glob or synthetic."""
    named = re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source) is not None
    return named and source != "synthetic" and not Path(source).exists()


def _model_index(results: list[Result]) -> list[dict]:
    """One model-index result per (dataset, split), its metrics in order."""
    grouped: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        grouped.setdefault((r.dataset, r.split), []).append(r)
    return [{"task": {"type": "image-classification"},
             "dataset": {"name": dataset, "type": dataset, "split": split},
             "metrics": [{"type": r.metric, "name": r.name, "value": r.value} for r in rows]}
            for (dataset, split), rows in grouped.items()]


def model_card(about: About, results: list[Result]) -> str:
    """README.md: the front matter, then what the network is, what it was trained on and how, its
    results, its preprocessing and its recipe."""
    meta = yaml.safe_dump(front_matter(about, results), sort_keys=False, allow_unicode=True)
    heads = f"{len(about.class_names)} classes" if about.class_names else "no head (features out)"
    size = about.prep["size"]
    arch = ["## Architecture", "", f"- {about.network}; {about.params:,} parameters; {heads}",
            f"- input {size} x {size} px"]
    parts = [["---", meta.rstrip(), "---"], [f"# {about.name}"], about.usage, arch,
             *_training(about.recipe), _results(results), _preprocessing(about.prep),
             _recipe(about.recipe)]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"


def _results(results: list[Result]) -> list[str]:
    """The results table, or the line saying there are none (and so no model-index)."""
    if not results:
        return ["## Results", "", (f"None recorded: the checkpoint's run has no held-out metrics "
                                   f"in {SUMMARY_FILE} and no --results folder was given, so the "
                                   "card has no model-index.")]
    rows = [f"| {r.dataset} | {r.split} | {r.name} | {r.value:.4g} |" for r in results]
    sources = ", ".join(f"`{s}`" for s in sorted({r.source for r in results}))
    return ["## Results", "", f"From {sources} (the model-index above).", "",
            "| dataset | split | metric | value |", "|---|---|---|---|", *rows]


def _preprocessing(prep: dict) -> list[str]:
    """What the pixels go through, as our eval transform runs it."""
    sides = "the shorter side" if prep["crop_mode"] == "center" else "both sides (squashed)"
    return ["## Preprocessing", "", (
        f"As vitcli evaluates: {sides} resized to {prep['resize_shorter_side']} px "
        f"({prep['interpolation']}), centre crop {prep['size']} px (its offset rounded half to "
        f"even, as torchvision's CenterCrop), then (x / 255 - mean) / std with mean "
        f"{prep['mean']}, std {prep['std']}.")]


def _recipe(recipe: dict) -> list[str]:
    """The training recipe the checkpoint carries, as a YAML block; nothing for a foreign file."""
    if not recipe:
        return []
    text = yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True).rstrip()
    said = "The resolved recipe the checkpoint was trained with, as its metadata holds it:"
    return ["## Recipe", "", said, "", "```yaml", text, "```"]


def _training(recipe: dict) -> list[list[str]]:
    """The card's data and training sections, from the recipe our checkpoints carry."""
    if not recipe:
        return [["## Training", "", "The checkpoint carries no training recipe (a foreign file)."]]
    data, optim, sched = (recipe.get(k, {}) for k in ("data", "optim", "schedule"))
    init = recipe.get("init", {}).get("checkpoint")
    splits = ", ".join(f"{what} `{data[key]}`" for what, key in
                       (("train", "train_split"), ("validation", "val_split"),
                        ("test", "test_split")) if data.get(key))
    how = (f"- {optim.get('name')}, lr {optim.get('lr')}, weight decay "
           f"{optim.get('weight_decay')}, {optim.get('loss')} loss, batch {data.get('batch_size')}")
    steps = (f"- {sched.get('steps')} steps, {sched.get('warmup_steps')} warmup, "
             f"{sched.get('decay')} decay")
    stage = f"- `vit {recipe.get('stage', '?')}`" + (f" from `{init}`" if init else "")
    return [["## Data", "", f"- source: `{data.get('source', '?')}`",
             f"- splits: {splits or 'none named'}"],
            ["## Training", "", stage, how, steps]]
