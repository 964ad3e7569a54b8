"""Training stages: turn a resolved recipe into a Job for the one loop, and report what came out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from vitcli import checkpoint, data
from vitcli import dist as dist_mod
from vitcli.errors import RecipeError
from vitcli.evaluators import ClassificationEvaluator
from vitcli.metrics import console
from vitcli.precision import bf16_warning
from vitcli.recipe import Recipe, check, to_dict, to_yaml
from vitcli.schedule import total_steps
from vitcli.trainer import Job, train

# Keys that may differ between a run and its resumption without changing what is being trained.
_RESUMABLE_DIFFS = ("run.", "data.num_workers", "data.eval_batch_size", "data.micro_batch_size")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume(recipe: Recipe, workdir: Path, resume: bool | None) -> bool:
    """Decide whether to resume: automatic when WORKDIR/state.pt exists, refused if the recipe changed."""
    state = workdir / checkpoint.STATE_FILE
    if resume is False or (resume is None and not state.exists()):
        return False
    if not state.exists():
        raise RecipeError(f"--resume: no checkpoint to resume in {workdir} (expected {state.name})")
    saved = _flatten(checkpoint.load_state(state)["recipe"])
    now = _flatten(to_dict(recipe))
    diffs = [k for k in now if saved.get(k) != now[k] and not k.startswith(_RESUMABLE_DIFFS)]
    if diffs:
        k = diffs[0]
        raise RecipeError(
            f"{workdir} holds a run with a different recipe ({k}: {saved.get(k)!r} there, {now[k]!r} now"
            f"{f', and {len(diffs) - 1} more' if len(diffs) > 1 else ''}); use a new --workdir or --no-resume"
        )
    return True


def build_job(recipe: Recipe, workdir: Path, dist: dist_mod.Dist):
    """Data, model, step count and evaluators for a training run."""
    from vitcli import models

    r = recipe
    if not r.schedule.steps and not r.schedule.epochs:
        raise RecipeError("set schedule.steps or schedule.epochs (both are 0)")
    train_ds = data.load_split(r.data, r.data.train_split)
    num_classes = r.model.num_classes or data.num_classes(r.data, train_ds)
    steps = total_steps(r.schedule.steps, r.schedule.epochs, len(train_ds), r.data.batch_size)
    if r.schedule.warmup_steps >= steps:
        raise RecipeError(
            f"schedule.warmup_steps={r.schedule.warmup_steps} must be smaller than the {steps} total steps"
        )
    model = models.build_model(r.model, num_classes)
    if r.init.checkpoint:
        from vitcli.transfer import load_init

        load_init(model, r, num_classes, dist)
    evaluators, final = [], []
    if r.data.val_split:
        val_ds = data.load_split(r.data, r.data.val_split)
        ev = ClassificationEvaluator("val", val_ds, r.data, r.model.img_size, dist, r.run.precision)
        evaluators.append((r.run.eval_every, ev))
    if r.data.test_split:
        test_ds = data.load_split(r.data, r.data.test_split)
        final.append(ClassificationEvaluator("test", test_ds, r.data, r.model.img_size, dist, r.run.precision))
    if r.fewshot.every and r.fewshot.tasks:
        from vitcli.fewshot_eval import FewshotEvaluator

        evaluators.append((r.fewshot.every, FewshotEvaluator(r, workdir, dist)))
    meta = models.model_spec(r.model, num_classes)
    return Job(r, workdir, model, train_ds, num_classes, steps, meta, evaluators, final)


def run_training(recipe: Recipe, workdir: Path, resume: bool | None = None) -> dict[str, float]:
    """Pretrain or finetune as the recipe says; writes recipe.yaml, metrics.jsonl, state.pt, model.safetensors."""
    from vitcli import models

    dist = dist_mod.setup(recipe.run.device)
    models.resolve_model(recipe.model)
    check(recipe, dist.world_size)
    workdir.mkdir(parents=True, exist_ok=True)
    resuming = check_resume(recipe, workdir, resume)
    if not resuming and dist.is_main:  # a fresh run must not leave a previous run's files looking current
        for stale in (checkpoint.STATE_FILE, checkpoint.MODEL_FILE, "metrics.jsonl", "summary.json"):
            (workdir / stale).unlink(missing_ok=True)
    torch.manual_seed(recipe.run.seed)  # same initial weights on every rank and every run of this recipe
    job = build_job(recipe, workdir, dist)
    if dist.is_main:
        checkpoint.write_text(workdir / "recipe.yaml", to_yaml(recipe))
        if recipe.run.precision == "bf16" and bf16_warning(dist.device.type):
            console.log(f"[yellow]warning: {bf16_warning(dist.device.type)}")
        console.log(
            f"{recipe.stage}: {recipe.model.name} ({models.count_params(job.model) / 1e6:.2f}M params), "
            f"{len(job.train_ds)} train images, {job.num_classes} classes, {job.total_steps} steps "
            f"of {recipe.data.batch_size} -> {workdir}"
        )
    t0 = time.perf_counter()
    results = train(job, dist)
    if dist.is_main:
        summary = {"stage": recipe.stage, "steps": job.total_steps, "seconds": time.perf_counter() - t0,
                   **results}
        checkpoint.write_text(workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
        report(summary, workdir)
    return results


def report(summary: dict, workdir: Path) -> None:
    """Print the final numbers as a table."""
    from rich.table import Table

    table = Table(title=f"{summary['stage']} finished in {summary['seconds']:.0f} s", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        if "/" in k:
            table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console.print(table)
    console.print(f"weights: {workdir / checkpoint.MODEL_FILE}")
