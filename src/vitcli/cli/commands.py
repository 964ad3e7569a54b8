"""The `vit` commands. Each parses its flags into dotted recipe keys, resolves its recipe under its
own stage name and hands over to the one dispatcher, with a function that imports the stage it runs
(only when it runs: a dry run imports no torch). A command's docstring is its `--help`, one line."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from vitcli.cli import options as opt
from vitcli.cli.dispatch import (
    check_resume_flags,
    dispatch,
    dispatch_slurm,
    output_format,
    resolve_grid,
    resolve_recipe,
    resolve_search,
    searched,
)

app = typer.Typer(
    name="vit",
    help="Vision Transformers from pretraining to few-shot evaluation (Dosovitskiy et al., ICLR 2021).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.command("pretrain")
def pretrain(recipe: opt.RecipeFile = None, workdir: opt.Workdir = None,
             dry_run: opt.DryRun = False, resume: opt.Resume = None,
             overwrite: opt.Overwrite = False, slurm: opt.Slurm = False, json_out: opt.Json = False,
             sweep: opt.Sweep = None, sweep_point: opt.SweepPoint = None, preflight: opt.Preflight = False,
             preflight_steps: opt.PreflightSteps = opt.PREFLIGHT_STEPS,
             search: opt.Search = None, trials: opt.Trials = None, search_task: opt.SearchTask = None,
             overrides: opt.TrainOverrides = None) -> None:
    """Pretrain a ViT (supervised, masked patch prediction or MAE), with resumable checkpoints."""
    r = resolve_recipe("pretrain", recipe, overrides)
    grid = resolve_grid("pretrain", recipe, overrides, sweep, sweep_point)
    space = resolve_search(r, recipe, overrides, search, trials, search_task, sweep=bool(sweep),
                           overwrite=overwrite)
    check_resume_flags(resume, overwrite)
    if preflight:  # here, even with --slurm: what the job would cost, its requeues included
        return _preflight(r, workdir, dry_run, json_out, preflight_steps, grid or space, resume, overwrite)
    if slurm:
        return dispatch_slurm(r, workdir, [], dry_run=dry_run, output=output_format(json_out),
                              resume=resume, overwrite=overwrite, sweep=sweep, grid=grid,
                              search=searched(search, trials, space))

    def stage():
        from vitcli.stages.run import one_run
        from vitcli.stages.search import run_search
        from vitcli.stages.sweep import run_grid
        return run_search if space else run_grid if grid else one_run

    dispatch(stage, r, workdir=workdir, dry_run=dry_run, output=output_format(json_out),
             resume=resume, overwrite=overwrite, sweep=grid, **({"search": space} if space else {}))


@app.command("finetune")
def finetune(recipe: opt.RecipeFile = None, workdir: opt.Workdir = None, init: opt.Init = None,
             res: opt.Res = None, lr_sweep: opt.LrSweep = None, task: opt.Task = None,
             data_root: opt.DataRoot = None, dry_run: opt.DryRun = False, resume: opt.Resume = None,
             overwrite: opt.Overwrite = False, slurm: opt.Slurm = False, json_out: opt.Json = False,
             sweep: opt.Sweep = None, sweep_point: opt.SweepPoint = None, preflight: opt.Preflight = False,
             preflight_steps: opt.PreflightSteps = opt.PREFLIGHT_STEPS,
             search: opt.Search = None, trials: opt.Trials = None, search_task: opt.SearchTask = None,
             overrides: opt.TrainOverrides = None) -> None:
    """Fine-tune with the paper's transfer protocol: zero-initialised head, 2-D position-embedding
    resize."""
    flags = {"init.checkpoint": init, "model.img_size": res, "fewshot.data_root": data_root}
    r = resolve_recipe("finetune", recipe, overrides, flags, vtab=bool(task))
    from vitcli.stages.finetune import check_flags, finetune

    # here: --dry-run refuses what the run would
    space = resolve_search(r, recipe, overrides, search, trials, search_task, flags, sweep=bool(sweep),
                           overwrite=overwrite, lr_sweep=bool(lr_sweep), task=bool(task))
    lrs, chosen = check_flags(lr_sweep, task, r, bool(sweep))
    grid = resolve_grid("finetune", recipe, overrides, sweep, sweep_point, flags)
    check_resume_flags(resume, overwrite)
    if preflight:
        if lrs or chosen:
            raise typer.BadParameter("--preflight times one run: drop --lr-sweep and --task")
        return _preflight(r, workdir, dry_run, json_out, preflight_steps, grid or space, resume, overwrite)
    if slurm:  # the job runs this command with the frozen recipe: its own flags go with it
        passed = [*(["--lr-sweep", lr_sweep] if lr_sweep else []), *(["--task", task] if task else [])]
        return dispatch_slurm(r, workdir, passed, dry_run=dry_run, output=output_format(json_out),
                              resume=resume, overwrite=overwrite, sweep=sweep, grid=grid,
                              search=searched(search, trials, space))
    dispatch(lambda: finetune, r, workdir=workdir, dry_run=dry_run, output=output_format(json_out),
             resume=resume, overwrite=overwrite, lrs=lrs, chosen=chosen, sweep=grid,
             **({"search": space} if space else {}))


def _preflight(r, workdir: Path | None, dry_run: bool, json_out: bool, steps: int, grid,
               resume: bool | None = None, overwrite: bool = False) -> None:
    """--preflight: the run timed in a throwaway folder instead of run (stages.preflight); --resume
    and --overwrite decide as they would for the run (a finished run is timed only with
    --overwrite), but what is timed is always a fresh run."""
    if grid is not None:
        raise typer.BadParameter("--preflight times one run: drop --sweep or --search (or time one "
                                 "point with its values as KEY=VALUE overrides)")

    def stage():
        from vitcli.stages.preflight import preflight
        return functools.partial(preflight, steps=steps)

    dispatch(stage, r, workdir=workdir, dry_run=dry_run, output=output_format(json_out),
             resume=resume, overwrite=overwrite)


@app.command("eval-fewshot")
def eval_fewshot(recipe: opt.RecipeFile = None, workdir: opt.Workdir = None,
                 ckpt: opt.Ckpt = None, tasks: opt.Tasks = None, shots: opt.Shots = None,
                 seeds: opt.Seeds = None, l2: opt.L2 = None, protocols: opt.Protocols = None,
                 data_root: opt.DataRoot = None,
                 list_tasks: opt.ListTasks = False, random_init: opt.RandomInit = False,
                 dry_run: opt.DryRun = False, overwrite: opt.Again = False, json_out: opt.Json = False,
                 overrides: opt.FewshotOverrides = None) -> None:
    """Frozen features scored: linear few-shot by closed-form least squares (big_vision
    fewshot_lsr); with --protocols also DINO's weighted kNN, a logistic probe (CLIP's protocol) and
    ridge on all train data."""
    from vitcli.recipe.choices import TRANSFER_PROTOCOLS

    if list_tasks:
        from vitcli.stages.fewshot import print_registry

        return dispatch(lambda: print_registry, None, output=output_format(json_out))
    flags = {"init.checkpoint": ckpt, "fewshot.tasks": tasks, "fewshot.shots": shots,
             "fewshot.seeds": seeds, "fewshot.l2_reg": l2, "fewshot.data_root": data_root,
             "fewshot.protocols": ",".join(TRANSFER_PROTOCOLS) if protocols == "all" else protocols,
             "init.random": random_init or None}
    r = resolve_recipe("eval-fewshot", recipe, overrides, flags)

    def stage():
        from vitcli.stages.fewshot import eval_fewshot
        return eval_fewshot

    dispatch(stage, r, workdir=workdir, dry_run=dry_run, output=output_format(json_out), overwrite=overwrite)


@app.command("evaluate")
def evaluate(ckpt: opt.Ckpt = None, recipe: opt.RecipeFile = None, data: opt.EvalData = None,
             split: opt.EvalSplit = None, real_labels: opt.RealLabels = None, real_timm: opt.Real = False,
             imagenet_set: opt.EvalImagenetSet = None, suite: opt.Suite = None, tta: opt.Tta = None,
             calibrate_on: opt.CalibrateOn = None, workdir: opt.Workdir = None, dry_run: opt.DryRun = False,
             overwrite: opt.Again = False, json_out: opt.Json = False,
             overrides: opt.EvalOverrides = None) -> None:
    """Top-1, top-5, loss, calibration, per-class accuracy and a confusion matrix of a checkpoint's
    head on a split, or on every ImageNet set under a folder (--suite)."""
    _check_suite_flags(suite, data, split, imagenet_set, real_labels, real_timm, calibrate_on)
    flags = {"init.checkpoint": ckpt, "data.source": data, "data.test_split": split}
    r = resolve_recipe("evaluate", recipe, overrides, flags,
                       own_data=data is None and suite is None)
    if real_timm:
        from vitcli.data.rows.imagenet import REAL_FILE, require_imagenet_head

        require_imagenet_head("--real", r.init.checkpoint, r.model.num_classes)
        real_labels = REAL_FILE
    real = None
    if real_labels:  # read and checked here, so that --dry-run refuses a bad file as the run would
        from vitcli.evaluators.classify import read_real_labels

        real = read_real_labels(real_labels, r.model.num_classes)
    if suite is not None:
        from vitcli.evaluators.robustness import find_sets

        find_sets(suite)  # here too: --dry-run refuses a root without a set
    if calibrate_on is not None:  # here too, so that --dry-run refuses it as the run would
        from vitcli.stages.evaluate_extra import check_held_out

        check_held_out(calibrate_on, r.data.test_split or r.data.val_split, r.optim.loss)

    def stage():
        from vitcli.stages.evaluate import evaluate
        from vitcli.stages.suite import evaluate_suite
        return evaluate if suite is None else evaluate_suite

    named = {"imagenet_set": imagenet_set.value} if imagenet_set is not None else {}
    sets = {"root": suite} if suite is not None else {"calibrate_on": calibrate_on, **named}
    # each view once, in TTA_VIEWS' order
    views = tuple(str(v) for v in opt.TtaView if v in (tta or ()))
    dispatch(stage, r, workdir=workdir, dry_run=dry_run, output=output_format(json_out),
             real_path=real_labels, real=real, tta=views, overwrite=overwrite, **sets)


def _check_suite_flags(suite, data, split, imagenet_set, real_labels, real_timm, calibrate_on) -> None:
    """--suite picks each set's data and split; --real and --real-labels name one ReaL file."""
    if real_timm and real_labels:
        raise typer.BadParameter("--real (timm's copy) and --real-labels FILE both name ReaL's labels: "
                                 "pass one")
    given = [name for name, value in (("--data", data), ("--split", split), ("--imagenet-set", imagenet_set),
                                      ("--calibrate-on", calibrate_on)) if value is not None]
    if suite is not None and given:
        raise typer.BadParameter(f"--suite finds each set's data and split itself: drop {given[0]}")


@app.command("predict")
def predict(images: opt.Images, ckpt: opt.Ckpt = None, top_k: opt.TopK = 5,
            batch_size: opt.BatchSize = None, json_out: opt.Json = False, csv_out: opt.Csv = False,
            recipe: opt.RecipeFile = None, overrides: opt.Set = None) -> None:
    """Top-k classes of image files with a checkpoint's head, with its class names where it stores
    them."""
    output = output_format(json_out, csv_out)
    flags = {"init.checkpoint": ckpt, "data.eval_batch_size": batch_size}
    r = resolve_recipe("predict", recipe, overrides, flags)

    def stage():
        from vitcli.stages.predict import predict
        return predict

    dispatch(stage, r, images, top_k, output=output)


@app.command("resize-posemb")
def resize_posemb(ckpt: opt.Ckpt, out: opt.ResizeOut = None, res: opt.NewRes = None,
                  grid: opt.Grid = None, old_grid: opt.OldGrid = None, patch: opt.Patch = None,
                  method: opt.Method = opt.PosembMethod.bilinear, overwrite: opt.ReplaceFile = False,
                  dry_run: opt.Plan = False, json_out: opt.Json = False) -> None:
    """Resize a checkpoint's position embedding to a new resolution or grid, offline."""

    def stage():
        from vitcli.stages.resize import run_resize
        return run_resize

    dispatch(stage, None, ckpt, out=out, res=res, grid=grid, old_grid=old_grid, patch=patch,
             method=method.value, overwrite=overwrite, dry_run=dry_run, output=output_format(json_out))


@app.command("inspect")
def inspect(ckpt: opt.Ckpt, out: opt.Figures, data: opt.InspectData = None,
            split: opt.InspectSplit = "test", images: opt.InspectImages = 128,
            json_out: opt.Json = False, overrides: opt.InspectOverrides = None) -> None:
    """The ViT paper's Figure 7 (filters, position similarity, attention distance); MAE's Figure 2;
    DINO's Figure 1.

    Writes OUT/embedding_filters.png, position_similarity.png, attention_distance.png and
    attention_distance.json; for an MAE run (objective: mae) also mae_reconstruction.png, MAE's
    Figure 2 (held-out images masked and reconstructed); for a DINO run (objective: dino) also
    dino_attention.png, DINO's Figure 1 (the class token's last-layer attention per head on
    held-out images); and prints a summary of the model (or everything as JSON with --json).
    """
    # data.label_column "": any image dataset will do, labelled or not
    flags = {"init.checkpoint": ckpt, "data.source": data, "data.label_column": ""}
    r = resolve_recipe("inspect", None, overrides, flags)

    def stage():
        from vitcli.stages.inspect import inspect
        return inspect

    dispatch(stage, r, out, split=split, images=images, output=output_format(json_out))


@app.command("plot")
def plot(workdirs: opt.Workdirs, out: opt.CurvesOut = None) -> None:
    """Training curves (loss, learning rate, held-out and few-shot accuracy) of one or more runs in one PNG."""  # noqa: E501

    def stage():
        from vitcli.stages.plot import plot
        return plot

    dispatch(stage, None, workdirs, out)


@app.command("prepare-data")
def prepare_data(source: opt.Source, out: opt.OutDir, max_size: opt.MaxSize = 256,
                 splits: opt.Splits = None, fmt: opt.ImageFormat = "jpeg",
                 quality: opt.Quality = 95, shards: opt.Shards = "parquet", workers: opt.Workers = 0,
                 seed: opt.ShuffleSeed = 0, recipe: opt.RecipeFile = None, overwrite: opt.Replace = False,
                 dry_run: opt.Plan = False, json_out: opt.Json = False,
                 overrides: opt.DataOverrides = None) -> None:
    """A pre-resized copy of a dataset (parquet or tar shards + manifest.json) that data.source=OUT
    reads faster."""
    from vitcli.data.rows.prepare import Options
    from vitcli.stages.prepare import prepare_data

    options = Options(max_size=max_size, format=fmt, quality=quality, workers=workers, shards=shards,
                      seed=seed)
    # the splits copied are --splits: the recipe's own split keys play no part and are not checked
    flags = {"data.source": source, "data.train_split": "", "data.val_split": "",
             "data.test_split": ""}
    r = resolve_recipe("prepare-data", recipe, overrides, flags)
    dispatch(lambda: prepare_data, r, out, splits=splits, options=options, overwrite=overwrite,
             dry_run=dry_run, output=output_format(json_out))


@app.command("export")
def export(ckpt: opt.Ckpt, fmt: opt.Format, out: opt.OutDir, overwrite: opt.Replace = False,
           dry_run: opt.Plan = False, json_out: opt.Json = False,
           overrides: opt.NetworkOverrides = None, results: opt.ResultsDirs = None) -> None:
    """Export a checkpoint for Hugging Face transformers, ONNX runtimes or timm."""
    r = resolve_recipe("export", None, overrides, {"init.checkpoint": ckpt})

    def stage():
        from vitcli.stages.export import export
        return export

    dispatch(stage, r, fmt.value, out, overwrite=overwrite, dry_run=dry_run,
             output=output_format(json_out), results=results or [])


@app.command("env")
def env(json_out: opt.Json = False) -> None:
    """This machine in one block for a bug report: versions, Python, OS, CPU, threads, GPUs, the
    launcher's and SLURM's variables, the cache, the HF offline flags (secrets redacted)."""

    def stage():
        from vitcli.stages.env import env
        return env

    dispatch(stage, None, output=output_format(json_out))


def _one_line_paragraphs(doc: str | None) -> str | None:
    """A docstring's paragraphs each as one line: Typer's rich help keeps the line breaks that wrap
    a docstring at 100 columns in the source, which then break its lines mid-sentence at 80."""
    if doc is None:
        return None
    return "\n\n".join(" ".join(p.split()) for p in doc.strip().split("\n\n"))


for _command in app.registered_commands:
    _command.help = _command.help or _one_line_paragraphs(_command.callback.__doc__)
COMMANDS = tuple(c.name for c in app.registered_commands)


def _version(value: bool) -> None:
    """`vit --version`: vitcli's, torch's and timm's versions and the device a run would use; then
    exit."""
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    def known(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    sys.stdout.write(f"vitcli {known('vitcli')}\ntorch {known('torch')}\ntimm {known('timm')}\n"
                     f"device {_device()}\n")
    raise typer.Exit()


def _device() -> str:
    """What run.device=auto picks: the CUDA device's name, else the CPU with its cores and model.
    Without an NVIDIA driver torch cannot see a GPU, so only then is torch imported (seconds) to
    ask."""
    if Path("/proc/driver/nvidia").exists() or any(Path("/dev").glob("nvidia[0-9]*")):
        import torch

        if torch.cuda.is_available():
            return f"cuda ({torch.cuda.get_device_name(0)})"
    import platform

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux: the marketing name
        lines = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        model = next(lines, model)
    return f"cpu ({os.cpu_count()} cores, {model})"


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print vitcli's, torch's and timm's versions and the device a run would use, and "
             "exit.")
    ] = False,
) -> None:
    """Vision Transformers from pretraining to few-shot evaluation (Dosovitskiy et al., ICLR
    2021)."""
