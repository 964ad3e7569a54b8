"""A finished evaluation is read-only to its own repetition (`vit evaluate`, `vit eval-fewshot`).

The same command again, into a workdir where it finished, prints the results stored there and writes
nothing, as `vit pretrain` does with a finished run. Another request into that workdir is refused
with one line naming the first difference, unless --overwrite: then it is evaluated again, and the
finished results are first moved to previous-<time>/ (never deleted; eval-fewshot's feature cache
stays, it is keyed by what it holds).

The request is the resolved recipe (recipe.yaml), less the keys that decide how the evaluation runs
and not what it measures (HOW_RUN), plus `inputs`, a record of what the recipe names only by a path:
the checkpoint file (the same bytes: an unchanged size and mtime, else the same sha256, so a copy or
a `touch` is the same checkpoint and a rewrite is not), local data by absolute path, and the
command's own options (--tta, ...). A data folder changed in place under the same path is not
noticed: --overwrite evaluates it again.

results.json marks a finished evaluation: each stage writes it last and atomically, after its other
files, so a run stopped before it (Ctrl-C) left none, and the same command again completes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vitcli.errors import OutputError
from vitcli.recipe.layers import flatten, to_dict, to_yaml
from vitcli.recipe.schema import Recipe
from vitcli.runtime.files import sha256_of
from vitcli.runtime.metrics import console
from vitcli.runtime.run_dir import HOW_RUN
from vitcli.runtime.run_files import RECIPE_FILE
from vitcli.runtime.workdir import set_aside

# How an evaluation runs, not what it measures, is run_dir.HOW_RUN: it may differ between a finished
# evaluation and its repeat
# Recipe keys naming a local path or a Hub name: compared as `inputs` records them (absolute, or by
# content)
PATH_KEYS = ("init.checkpoint", "data.source", "fewshot.data_root", "fewshot.custom.source")
Difference = tuple[str, object, object]  # (what, its value in the finished request, its value now)


def inputs(recipe: Recipe, weights: Path | str, **options) -> dict:
    """The record of a request's inputs: `weights` (the located checkpoint file, or the Hub name it
    is) by path, size and mtime; each PATH_KEYS value that names a local path by its absolute path;
    and `options`, the command's own. Nothing is read: `sealed` adds the checkpoint's sha256 for
    results.json."""
    flat = flatten(to_dict(recipe))
    paths = {key: _where(flat[key]) for key in PATH_KEYS[1:] if flat.get(key)}
    if isinstance(weights, str):
        checkpoint = {"name": weights}
    else:
        stat = weights.stat()
        checkpoint = {"path": str(weights.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"checkpoint": checkpoint, "paths": paths, "options": options}


def sealed(record: dict) -> dict:
    """`record` with its checkpoint file's sha256, as results.json stores it (read once, by the
    first run)."""
    checkpoint = record["checkpoint"]
    if "path" not in checkpoint:
        return record
    return {**record, "checkpoint": {**checkpoint, "sha256": sha256_of(checkpoint["path"])}}


def stored(workdir: Path, results_file: str, recipe: Recipe, now: dict, overwrite: bool, what: str,
           auto_precision: bool = False) -> dict | None:
    """The results the same request finished with in `workdir` (read from `results_file`), after
    saying so; None when there are none to reuse (nothing finished there, or `overwrite`). Another
    request's finished results are an OutputError naming the first difference and the two ways on.
    With `auto_precision` (the user's run.precision is auto) the precision auto chose then stands:
    its bf16 probe times a matmul, and on a busy machine may choose otherwise now."""
    found = _finished(workdir / results_file)
    if found is None or overwrite:
        return None
    skip = HOW_RUN + PATH_KEYS + (("run.precision",) if auto_precision else ())
    diffs = _differences(workdir, recipe, found.get("inputs") or {}, now, skip)
    if diffs:
        key, there, here = diffs[0]
        more = f", and {len(diffs) - 1} more" if len(diffs) > 1 else ""
        raise OutputError(f"{workdir} holds a finished {what} of another request ({key}: {there!r} there, "
                          f"{here!r} now{more}); use a new --workdir, or --overwrite to run it again there "
                          "(the finished results are then kept in previous-<time>/)")
    console.log(f"{workdir} holds this {what}, finished: nothing to do, its results are printed again "
                "(--overwrite runs it again)")
    return found


def set_aside_results(workdir: Path, names: tuple[str, ...]) -> None:
    """Before an --overwrite writes (rank 0): the results among `names` that are there move to
    previous-<time>/, finished or not."""
    there = [workdir / name for name in names if (workdir / name).exists()]
    if there:
        set_aside(workdir, there, outputs=False, why="the earlier results")


def _finished(path: Path) -> dict | None:
    """What a results.json holds; None when there is none, or it is not whole JSON (then it is
    redone)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _differences(workdir: Path, recipe: Recipe, saved: dict, now: dict,
                 skip: tuple[str, ...]) -> list[Difference]:
    """(key, there, now) for each way the finished request differs from this one; [] when it is the
    same."""
    diffs = []
    if not _same_checkpoint(saved.get("checkpoint") or {}, now["checkpoint"]):
        there, here = saved.get("checkpoint") or {}, now["checkpoint"]
        diffs.append(("checkpoint", _name(there), _name(here) if _name(there) != _name(here) else
                      f"{_name(here)}, rewritten since (another sha256)"))
    for group in ("paths", "options"):
        old, new = saved.get(group) or {}, now[group]
        keys = dict.fromkeys([*new, *old])
        diffs += [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]
    return diffs + _recipe_differences(workdir / RECIPE_FILE, recipe, skip)


def _recipe_differences(path: Path, recipe: Recipe, skip: tuple[str, ...]) -> list[Difference]:
    """The recipe keys (those under `skip` aside) whose value recipe.yaml does not share; a key it
    lacks (one vitcli gained since) counts as its default."""
    try:
        saved = flatten(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError, AttributeError):
        return [(str(path), "missing or damaged", "a recipe")]
    # as recipe.yaml holds it (a tuple reads back as a list), so that only values can differ
    now = flatten(yaml.safe_load(to_yaml(recipe)))
    defaults = flatten(yaml.safe_load(to_yaml(Recipe(stage=recipe.stage))))
    return [(k, saved.get(k, defaults.get(k)), v) for k, v in now.items()
            if not k.startswith(skip) and saved.get(k, defaults.get(k)) != v]


def _same_checkpoint(saved: dict, now: dict) -> bool:
    """The same weights: the same Hub name, or the same file unchanged since (size and mtime), or a
    file with the same bytes (its sha256, read only when the quick look differs)."""
    if "name" in now or "name" in saved:
        return saved.get("name") == now.get("name")
    if all(saved.get(k) == now[k] for k in ("path", "bytes", "mtime_ns")):
        return True
    return saved.get("bytes") == now["bytes"] and saved.get("sha256") == sha256_of(now["path"])


def _name(record: dict) -> str:
    return str(record.get("name") or record.get("path") or "not recorded")


def _where(value: str) -> str:
    """A local path as an absolute one (`runs/x` and `./runs/x` are one input); anything else as it
    is."""
    path = Path(value).expanduser()
    return str(path.resolve()) if path.exists() else value
