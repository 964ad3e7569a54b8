"""One training run: a resolved recipe -> a Job for the one loop, then the report. `vit pretrain` is this.

Fine-tuning is the same run with starting weights (vitcli.checkpoints.transfer); the sweep and VTAB drivers call it
once per setting with the Dist their command created.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from rich.table import Table

from vitcli.checkpoints import state
from vitcli.checkpoints.transfer import load_init
from vitcli.checkpoints.weights import MODEL_FILE
from vitcli.data import batches, sources
from vitcli.errors import RecipeError
from vitcli.evaluators.heldout import ClassificationEvaluator, MppEvaluator
from vitcli.fewshot.evaluate import FewshotEvaluator
from vitcli.figures import curves
from vitcli.models import zoo
from vitcli.recipe.checks import check_schedule
from vitcli.recipe.data_checks import check_batch_fits
from vitcli.recipe.schema import Recipe, to_dict, to_yaml
from vitcli.runtime import files
from vitcli.runtime.dist import Dist, setup
from vitcli.runtime.metrics import console, stdout
from vitcli.runtime.precision import bf16_warning, resolved
from vitcli.runtime.workdir import check_space, check_workdir, refuse_finished, set_aside
from vitcli.train.loop import Job, train
from vitcli.train.objectives import MppModel
from vitcli.train.schedule import total_steps

# Keys that may differ between a run and its resumption: they change how a run is watched and fed, not what
# it trains. Everything else (the seed and the micro-batch included: they decide the data order, the initial
# weights and the summation order) must match.
RESUMABLE = ("run.log_every", "run.eval_every", "run.ckpt_every", "run.keep_checkpoints", "run.device",
             "run.compile", "run.activation_checkpointing", "data.num_workers", "data.eval_batch_size", "fewshot.")


def one_run(recipe: Recipe, workdir: Path, resume: bool | None = None, overwrite: bool = False) -> dict[str, float]:
    """`vit pretrain`: join the process group, then one training run."""
    return run_training(recipe, workdir, setup(recipe.run.device), resume, overwrite)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def resume_point(recipe: Recipe, workdir: Path, resume: bool | None, dist: Dist,
                 auto_precision: bool = False) -> tuple[Path, dict] | None:
    """The checkpoint to resume from (read once, handed to the trainer), or None for a fresh run.

    Automatic when the workdir holds one; refused if the recipe changed what is trained. `recipe` has its
    precision resolved; with `auto_precision` (the user's recipe said auto) a checkpoint trained at the other
    precision, on a machine that chose differently, is continued with a warning instead.
    """
    if resume is False:
        return None
    found = state.latest_good_state(workdir, verbose=dist.is_main)  # names any damaged one it skips
    if found is None and resume:
        raise RecipeError(f"--resume: no checkpoint to resume in {workdir} (expected state-<step>.pt, or a state-<step>/ directory with run.strategy=fsdp)")
    if found is not None:
        saved = found[1]["recipe"]
        if auto_precision:
            saved = _accept_precision(recipe, saved, workdir)
        _check_same_training(recipe, saved, workdir)
    return found


def _accept_precision(recipe: Recipe, saved: dict, workdir: Path) -> dict:
    """`saved` with this machine's precision, after a loud warning if the checkpoint trained at another."""
    was = saved.get("run", {}).get("precision", "fp32")  # recipes before `auto` existed defaulted to fp32
    if was != recipe.run.precision:
        console.log(f"[bold yellow]warning: {workdir} trained at {was}; run.precision=auto chooses "
                    f"{recipe.run.precision} on this machine, so the rest of the run continues at "
                    f"{recipe.run.precision} (set run.precision={was} to keep it)")
    return {**saved, "run": {**saved.get("run", {}), "precision": recipe.run.precision}}


def starts_over(resume: bool | None, overwrite: bool) -> bool | None:
    """--overwrite means a fresh run (resume False) even where a checkpoint could be resumed."""
    if overwrite and resume:
        raise RecipeError("--overwrite starts over and --resume continues the run there: pass one of them")
    return False if overwrite else resume


def _check_same_training(recipe: Recipe, saved_recipe: dict, workdir: Path) -> None:
    # a key the saved recipe lacks was added to vitcli since: it trained with that key's default
    saved = {**_flatten(to_dict(Recipe(stage=recipe.stage))), **_flatten(saved_recipe)}
    now = _flatten(to_dict(recipe))
    diffs = [k for k in now if saved.get(k) != now[k] and not k.startswith(RESUMABLE)]
    if diffs:
        k, more = diffs[0], f", and {len(diffs) - 1} more" if len(diffs) > 1 else ""
        raise RecipeError(
            f"{workdir} holds a run with a different recipe ({k}: {saved.get(k)!r} there, {now[k]!r} now{more});"
            " use a new --workdir or --no-resume"
        )


def _evaluators(r: Recipe, dist: Dist) -> tuple[list, list]:
    """(periodic, final) evaluators: held-out top-1 (or masked patch prediction, for mpp) every
    run.eval_every, on test at the end; few-shot every fewshot.every."""

    def held_out(name: str, split: str):
        ds = sources.load_split(r.data, split)
        if r.objective == "mpp":
            return MppEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision, r.mpp.target)
        return ClassificationEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision)

    periodic = [(r.run.eval_every, held_out("val", r.data.val_split))] if r.data.val_split else []
    final = [held_out("test", r.data.test_split)] if r.data.test_split else []
    if r.fewshot.every and r.fewshot.tasks:
        periodic.append((r.fewshot.every, FewshotEvaluator(r, dist)))
    return periodic, final


def _num_classes(r: Recipe, train_ds) -> int:
    """The head's width: the recipe's, else the data's (checked against the labels); 0 for mpp (no labels).
    A streamed split cannot be scanned for its largest label before training: its ClassLabel decides."""
    if r.objective == "mpp":
        return 0
    num_classes = r.model.num_classes or sources.num_classes(r.data, train_ds)
    if not r.data.streaming:
        check_labels(train_ds, r, num_classes)
    return num_classes


def check_labels(train_ds, r: Recipe, num_classes: int) -> None:
    """Every train label must have a logit: a head smaller than the labels would fail deep in the loss."""
    top = int(batches.labels(train_ds, r.data.label_column).max())
    if top >= num_classes:
        key = "model.num_classes" if r.model.num_classes else "data.num_classes"
        raise RecipeError(f"{key}={num_classes}, but the train split has label {top}; set {key}={top + 1} or "
                          "more (model.num_classes=0 takes the data's own count)")


def build_job(r: Recipe, workdir: Path, dist: Dist, start: tuple[Path, dict] | None = None) -> Job:
    """Data, model (with its starting weights), step count and evaluators for a training run."""
    train_ds = sources.load_stream(r.data) if r.data.streaming else sources.load_split(r.data, r.data.train_split)
    if not r.data.streaming:  # before anything is written: the split's size is known only now
        check_batch_fits(len(train_ds), r.data.batch_size, f"{r.data.source} split '{r.data.train_split}'")
    num_classes = _num_classes(r, train_ds)
    steps = r.schedule.steps or total_steps(0, r.schedule.epochs, len(train_ds), r.data.batch_size)
    check_schedule(r.schedule.warmup_steps, steps, derived=not r.schedule.steps)
    model = zoo.build_model(r.model, num_classes)
    if r.init.checkpoint:
        load_init(model, r, num_classes, dist)
    if r.objective == "mpp":  # the ViT is exported headless: masked patch prediction trains no classifier
        model = MppModel(model, r.mpp, r.model.patch_size)
    periodic, final = _evaluators(r, dist)
    meta = zoo.model_spec(r.model, num_classes)
    return Job(r, workdir, model, train_ds, num_classes, steps, meta, periodic, final, start)


def run_training(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
                 overwrite: bool = False) -> dict[str, float]:
    """Train as the recipe says; writes recipe.yaml, metrics.jsonl, state, model.safetensors (rank 0).

    Everything is checked before the first file is touched: the workdir, the resume decision, the data,
    the model and its starting weights, the free space. A finished run in the workdir is replaced only
    with `overwrite`, and its files are moved aside (never deleted) once the new run has started cleanly.
    """
    check_workdir(workdir)
    auto = recipe.run.precision == "auto"
    recipe, why = resolved(recipe, dist.device)  # the one place `auto` becomes fp32 or bf16
    start = resume_point(recipe, workdir, starts_over(resume, overwrite), dist, auto)
    if start is None:
        refuse_finished(workdir, overwrite)
    torch.manual_seed(recipe.run.seed)  # same initial weights on every rank and every run of this recipe
    job = build_job(recipe, workdir, dist, start)
    check_space(workdir, checkpoint_bytes(job), "training with its checkpoints")
    if dist.is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        files.remove_stale_temps(workdir)  # killed writes of an earlier run: ours only, by their pattern
        state.remove_stale_dirs(workdir)  # and killed sharded saves (.state-<step>.*.tmp/ directories)
        if start is None:
            set_aside(workdir)
        files.write_text(workdir / "recipe.yaml", to_yaml(recipe))
        _announce(job, dist, why)
    t0 = time.perf_counter()
    results = train(job, dist)
    if dist.is_main:
        summary = {"stage": recipe.stage, "steps": job.total_steps, "seconds": time.perf_counter() - t0,
                   "run/precision": recipe.run.precision, **results}
        files.write_text(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
        curves.write_run_curves(workdir)  # warns rather than fails: the run is done
        report(summary, workdir)
    return results


def checkpoint_bytes(job: Job) -> int:
    """Disk a run needs at most: run.keep_checkpoints states and one being written (weights plus the
    optimizer's slots: Adam keeps two per weight, SGD momentum one), and the final model, all fp32."""
    weights = 4 * zoo.count_params(job.model)
    slots = 2 if job.recipe.optim.name == "adamw" else 1
    return (job.recipe.run.keep_checkpoints + 1) * weights * (1 + slots) + weights


def _announce(job: Job, dist: Dist, why: str) -> None:
    r = job.recipe
    if r.run.precision == "bf16" and bf16_warning(dist.device):
        console.log(f"[yellow]warning: {bf16_warning(dist.device)}")
    console.log(
        f"{r.stage}: {r.model.name} ({zoo.count_params(job.model) / 1e6:.2f}M params), "
        f"{'streamed' if r.data.streaming else len(job.train_ds)} train images, "
        f"{f'masked patch prediction ({r.mpp.target})' if r.objective == 'mpp' else f'{job.num_classes} classes'}, "
        f"{job.total_steps} steps "
        f"of {r.data.batch_size}, {r.run.precision} ({why}){', compiled' if r.run.compile else ''} -> {job.workdir}"
    )


def report(summary: dict, workdir: Path) -> None:
    """Print the final numbers as a table."""
    table = Table(title=f"{summary['stage']} finished in {summary['seconds']:.0f} s", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        if "/" in k:
            table.add_row(k, number(v) if isinstance(v, float) else str(v))
    stdout.print(table)
    stdout.print(f"weights: {workdir / MODEL_FILE}")


def number(v: float) -> str:
    """4 decimals, but small values (a final learning rate of 3e-6) in 3 significant digits, not `0.0000`."""
    return f"{v:.3g}" if v and abs(v) < 1e-3 else f"{v:.4f}"
