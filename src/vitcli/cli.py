"""`vit`: the command line. Commands parse and hand over; nothing here imports torch, so
`--help` is instant."""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from vitcli.errors import Interrupted, Terminated, VitcliError

# Typer labels flags `<bool>` as if they took a value (`--dry-run <bool>`); a flag takes none, so show no
# type. A private method: some Typer releases lack it (0.27.2 raised AttributeError at import), and then
# the label stays as Typer draws it.
_display_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _display_type is not None:
    typer.core.TyperOption.display_type_rich = lambda self, ctx: (
        None if self.is_flag else _display_type(self, ctx)
    )

app = typer.Typer(
    name="vit",
    help="Vision Transformers from pretraining to few-shot evaluation (Dosovitskiy et al., ICLR 2021).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)

RecipeOpt = Annotated[
    Path | None, typer.Option("--recipe", "-r", help="YAML recipe; omitted: built-in defaults.")
]
WorkdirOpt = Annotated[
    Path | None, typer.Option("--workdir", "-w", help="Run directory; default runs/<stage>-<time>.")
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the resolved recipe as YAML and exit.")]
JsonOpt = Annotated[bool, typer.Option(
    "--json", help="Print the results as JSON on stdout instead of tables "
                   "(logs and progress stay on stderr).")]
ResumeOpt = Annotated[
    bool | None,
    typer.Option("--resume/--no-resume", help="Resume from the latest good WORKDIR/state-<step>.pt "
                 "(default: when there is one)."),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", help="Start over in a workdir that holds a run, finished or not "
                       "(its files are moved to previous-<time>/, not deleted).")
]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Recipe overrides by dotted path: optim.lr=1e-3 data.batch_size=64")
]
FewshotOverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Recipe overrides by dotted path: fewshot.l2_reg=auto data.eval_batch_size=256")
]


COMMANDS = ("pretrain", "finetune", "eval-fewshot", "evaluate", "predict", "resize-posemb", "inspect", "plot",
            "prepare-data", "export")
# default workdirs are runs/<name>-<time>; the stage's name otherwise
WORKDIR_NAMES = {"eval-fewshot": "fewshot"}


def _workdir(workdir: Path | None, stage: str) -> Path:
    return workdir or Path("runs") / f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resolve(stage: str, recipe: Path | None, overrides: list[str] | None, flags: dict, vtab: bool = False,
             base=None):
    """The checked recipe; torch is imported only if the recipe needs it (after every torch-free check).
    `base()`: what the checkpoint says of itself, below the recipe file (evaluate, predict)."""
    from vitcli.recipe.resolve import resolve

    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the batch must split over it
    return resolve(stage, recipe, list(overrides or []), flags, vtab=vtab, world_size=world_size,
                   complete=_complete, base=base)


def _trained_with(ckpt: str | None, own_data: bool):
    """A function giving the checkpoint's resolution and, for ours, the preprocessing (and data) it was
    trained with; {} without --ckpt (the recipe check then asks for it)."""

    def layer() -> dict:
        if not ckpt:
            return {}
        from vitcli.checkpoints.complete import trained_with

        return trained_with(ckpt, own_data)

    return layer


def _complete(recipe, user_heads: bool):
    from vitcli.checkpoints.complete import complete

    return complete(recipe, user_heads)


def _dry_run(r) -> None:
    """The recipe as YAML on stdout (what recipe.yaml will hold, `auto`s aside); on stderr, what each `auto`
    of run.precision and run.compile becomes on this machine. Deciding that needs torch (is there a GPU, does
    this CPU run bf16): it is imported only now, every check passed, and only when a recipe says `auto`."""
    from vitcli.recipe.schema import to_yaml

    sys.stdout.write(to_yaml(r))
    if "auto" in (r.run.precision, r.run.compile):
        from vitcli.runtime.dist import pick_device
        from vitcli.runtime.precision import auto_choices

        for line in auto_choices(r, pick_device(r.run.device)):
            sys.stderr.write(f"# {line}\n")


@contextlib.contextmanager
def _tables_off(json_out: bool):
    """With --json, stdout carries the JSON alone: the result tables are printed nowhere."""
    if not json_out:
        yield
        return
    from vitcli.runtime.metrics import stdout

    with open(os.devnull, "w") as sink:
        stdout.file = sink  # a file, not `quiet`: dist.setup sets quiet per rank
        try:
            yield
        finally:
            stdout.file = None  # back to whatever sys.stdout is


def _stage(driver: str, r, dry_run: bool, workdir: Path | None, json_out: bool, **flags) -> None:
    """What every training and evaluation command does once it has its recipe: --dry-run prints it; else the
    stage (`module.function`, imported only now: the dry run needs no torch) runs into the workdir, and with
    --json what it returns (its results file's content) is printed, by rank 0 alone."""
    if dry_run:
        return _dry_run(r)
    module, name = driver.rsplit(".", 1)
    run = getattr(importlib.import_module(module), name)
    with _tables_off(json_out):
        results = run(r, _workdir(workdir, WORKDIR_NAMES.get(r.stage, r.stage)), **flags)
    if json_out:
        _emit_json(results)


def _check_resume_flags(resume: bool | None, overwrite: bool) -> None:
    from vitcli.runtime.workdir import check_resume_flags

    check_resume_flags(resume, overwrite)  # before the dry run, which would otherwise accept the pair


def _emit_json(results: dict | list) -> None:
    """What a stage returned, as JSON on stdout (rank 0 only: every rank returns it, one prints it)."""
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(json.dumps(results, indent=2) + "\n")


@app.command()
def pretrain(
    recipe: RecipeOpt = None,
    workdir: WorkdirOpt = None,
    dry_run: DryRunOpt = False,
    resume: ResumeOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """Pretrain a ViT (supervised or masked patch prediction), with progress, metrics and resumable checkpoints."""  # noqa: E501
    r = _resolve("pretrain", recipe, overrides, {})
    _check_resume_flags(resume, overwrite)
    _stage("vitcli.stages.run.one_run", r, dry_run, workdir, json_out, resume=resume, overwrite=overwrite)


@app.command()
def finetune(
    recipe: RecipeOpt = None,
    workdir: WorkdirOpt = None,
    init: Annotated[
        str | None, typer.Option(help="Starting weights: workdir, .safetensors, Google .npz or Hub name.")
    ] = None,
    res: Annotated[
        int | None, typer.Option(help="Fine-tuning resolution (position embedding resized).")
    ] = None,
    lr_sweep: Annotated[
        str | None, typer.Option(help="Comma-separated learning rates; best on the dev split wins.")
    ] = None,
    task: Annotated[str | None, typer.Option(
        help="VTAB-1k protocol, VTAB names only: vtab (all 19), vtab/natural|specialized|structured or "
             "vtab/<name>, e.g. vtab/cifar100. Other datasets fine-tune with data.source.")] = None,
    data_root: Annotated[str | None, typer.Option(
        help="With --task: a local VTAB root, DIR/<task> per task (e.g. DIR/svhn) "
             "instead of the Hub.")] = None,
    dry_run: DryRunOpt = False,
    resume: ResumeOpt = None,
    overwrite: OverwriteOpt = False,
    json_out: JsonOpt = False,
    overrides: OverridesArg = None,
) -> None:
    """Fine-tune with the paper's transfer protocol: zero-initialised head, 2-D position-embedding resize."""
    flags = {"init.checkpoint": init, "model.img_size": res, "fewshot.data_root": data_root}
    r = _resolve("finetune", recipe, overrides, flags, vtab=bool(task))
    from vitcli.stages.finetune import check_flags

    lrs, chosen = check_flags(lr_sweep, task, r)  # here, so that --dry-run refuses what the run would
    _check_resume_flags(resume, overwrite)
    _stage("vitcli.stages.finetune.finetune", r, dry_run, workdir, json_out, resume=resume,
           overwrite=overwrite, lrs=lrs, chosen=chosen)


@app.command("eval-fewshot")
def eval_fewshot(
    recipe: RecipeOpt = None,
    workdir: WorkdirOpt = None,
    ckpt: Annotated[
        str | None, typer.Option(help="Weights: workdir, .safetensors, .npz or Hub name.")
    ] = None,
    tasks: Annotated[str | None, typer.Option(help="vtab, vtab/natural, vtab/cifar100,vtab/dtd, ...")] = None,
    shots: Annotated[str | None, typer.Option(help="Shot counts, e.g. 1,5,10,25.")] = None,
    seeds: Annotated[int | None, typer.Option(help="Shot-set draws per shot count.")] = None,
    l2: Annotated[str | None, typer.Option(help="Ridge strength, or 'auto' (leave-one-out).")] = None,
    data_root: Annotated[str | None, typer.Option(help="One directory per task instead of the Hub.")] = None,
    list_tasks: Annotated[
        bool, typer.Option("--list-tasks", help="Print the task registry and exit.")
    ] = False,
    random_init: Annotated[bool, typer.Option(
        "--random-init", help="Score --ckpt's network with fresh weights (run.seed): the baseline.")] = False,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
    overrides: FewshotOverridesArg = None,
) -> None:
    """Linear few-shot accuracy by closed-form least squares on frozen features (big_vision fewshot_lsr)."""
    if list_tasks:
        from vitcli.stages.fewshot import print_registry

        return print_registry()
    flags = {"init.checkpoint": ckpt, "fewshot.tasks": tasks, "fewshot.shots": shots, "fewshot.seeds": seeds,
             "fewshot.l2_reg": l2, "fewshot.data_root": data_root, "init.random": random_init or None}
    r = _resolve("eval-fewshot", recipe, overrides, flags)
    _stage("vitcli.stages.fewshot.eval_fewshot", r, dry_run, workdir, json_out)


EvalOverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Recipe overrides by dotted path: data.eval_crop_pct=0.875 run.precision=fp32")
]
CkptOpt = Annotated[
    str | None, typer.Option(help="Weights with their head: workdir, .safetensors, .npz or Hub name.")
]


@app.command()
def evaluate(
    ckpt: CkptOpt = None,
    recipe: RecipeOpt = None,
    data: Annotated[str | None, typer.Option(
        help="Images to evaluate on (any data.source); default: the checkpoint's training data.")] = None,
    split: Annotated[str | None, typer.Option(
        help="Split to evaluate (HF syntax); default data.test_split, else data.val_split.")] = None,
    real_labels: Annotated[Path | None, typer.Option(
        help="ImageNet ReaL real.json: also report real/top1 on the ImageNet validation split.")] = None,
    workdir: WorkdirOpt = None,
    dry_run: DryRunOpt = False,
    json_out: JsonOpt = False,
    overrides: EvalOverridesArg = None,
) -> None:
    """Top-1, top-5, loss, per-class accuracy and a confusion matrix of a checkpoint's head on a split."""
    flags = {"init.checkpoint": ckpt, "data.source": data, "data.test_split": split}
    r = _resolve("evaluate", recipe, overrides, flags, base=_trained_with(ckpt, own_data=data is None))
    real = None
    if real_labels:  # read and checked here, so that --dry-run refuses a bad file as the run would
        from vitcli.evaluators.classify import read_real_labels

        real = read_real_labels(real_labels, r.model.num_classes)
    _stage("vitcli.stages.evaluate.evaluate", r, dry_run, workdir, json_out, real_path=real_labels, real=real)


@app.command()
def predict(
    images: Annotated[list[Path], typer.Argument(help="Image files, and folders searched recursively.")],
    ckpt: CkptOpt = None,
    top_k: Annotated[int, typer.Option(min=1, help="Classes shown per image.")] = 5,
    batch_size: Annotated[
        int | None, typer.Option(help="Images per forward pass (data.eval_batch_size).")
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print a JSON list of records instead of a table.")
    ] = False,
    csv_out: Annotated[bool, typer.Option(
        "--csv", help="Print CSV rows path,rank,class_index,class_name,probability instead of a table.")
    ] = False,
    recipe: RecipeOpt = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="Recipe override by dotted path, e.g. --set run.device=cpu (repeatable).")] = None,
) -> None:
    """Top-k classes of image files with a checkpoint's head, with its class names where it stores them."""
    if json_out and csv_out:
        _fail("--json and --csv both ask for the output format: pass one", 2)
    flags = {"init.checkpoint": ckpt, "data.eval_batch_size": batch_size}
    r = _resolve("predict", recipe, overrides, flags, base=_trained_with(ckpt, own_data=False))
    from vitcli.stages.predict import as_csv
    from vitcli.stages.predict import predict as run

    with _tables_off(json_out or csv_out):
        records = run(r, images, top_k)
    if json_out:
        _emit_json(records)
    elif csv_out and int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(as_csv(records))


@app.command("resize-posemb")
def resize_posemb(
    ckpt: Annotated[
        str, typer.Argument(help="Checkpoint: vitcli workdir or file, timm .safetensors, Google .npz.")
    ],
    out: Annotated[Path | None, typer.Option(
        help="Output .safetensors; default: beside the source as <name>_<H>x<W>.safetensors "
             "(a Hub model: in the current directory).")] = None,
    res: Annotated[int | None, typer.Option(help="New resolution (grid = res / patch).")] = None,
    grid: Annotated[str | None, typer.Option(help="New grid as HxW, e.g. 24x24.")] = None,
    patch: Annotated[int | None, typer.Option(help="Patch size, if the checkpoint does not say.")] = None,
    method: Annotated[str, typer.Option(help="bilinear (big_vision) or bicubic (timm).")] = "bilinear",
    dry_run: Annotated[bool, typer.Option(
        "--dry-run",
        help="Check everything and print what would change and where it would go; write nothing.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Resize a checkpoint's position embedding to a new resolution or grid, offline."""
    from vitcli.stages.resize import run_resize

    with _tables_off(json_out):
        rows = run_resize(ckpt, out=out, res=res, grid=grid, patch=patch, method=method, dry_run=dry_run)
    if json_out:
        sys.stdout.write(json.dumps(dict(rows), indent=2) + "\n")


@app.command()
def inspect(
    ckpt: Annotated[str, typer.Argument(help="ViT weights: workdir, .safetensors, Google .npz or Hub name.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for the figures (created if needed).")],
    data: Annotated[
        str | None, typer.Option(help="Images for the attention distances: any data.source (dataset "
                                 "dir, parquet files, Hub id); default: the built-in synthetic data.")
    ] = None,
    split: Annotated[str, typer.Option(help="Split of the --data source to read.")] = "test",
    images: Annotated[
        int, typer.Option(min=1, help="Images averaged over for the attention distances.")
    ] = 128,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the numbers as JSON instead of a table.")
    ] = False,
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Recipe overrides by dotted path, e.g. model.num_heads=3 for a "
                                         "foreign file that does not tell, data.image_column=img")
    ] = None,
) -> None:
    """The paper's Figure 7: patch-filter components, position-embedding similarity, attention distance.

    Writes OUT/embedding_filters.png, position_similarity.png, attention_distance.png and
    attention_distance.json, and prints a summary of the model (or everything as JSON with --json).
    """
    from vitcli.stages.inspect import inspect as run

    with _tables_off(as_json):
        report = run(ckpt, out, source=data, split=split, images=images, overrides=list(overrides or []))
    if as_json:
        _emit_json(report.as_dict())


@app.command()
def plot(
    workdirs: Annotated[list[Path], typer.Argument(help="Training workdirs holding metrics.jsonl.")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="PNG to write; default WORKDIR/curves.png for one "
                                  "workdir, ./curves.png for several.")
    ] = None,
) -> None:
    """Training curves (loss, learning rate, held-out and few-shot accuracy) of one or more runs in one PNG."""  # noqa: E501
    from vitcli.stages.plot import plot as run

    run(workdirs, out)


@app.command("prepare-data")
def prepare_data(
    source: Annotated[str, typer.Argument(help="Any data.source: synthetic, an image folder, a save_to_disk "
                                          "directory, parquet files or a glob, a Hub id.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write (new, or empty).")],
    max_size: Annotated[int, typer.Option(
        help="Shorter side at most this many pixels; smaller images are copied unchanged.")] = 256,
    splits: Annotated[str | None, typer.Option(
        help="Comma-separated splits to copy, e.g. train,validation; default: every split.")] = None,
    fmt: Annotated[str, typer.Option("--format", help=(
        "jpeg (re-encoded at --quality) or png (lossless, larger: the exact-pixels option, since an image "
        "column holds encoded images, not raw arrays)."))] = "jpeg",
    quality: Annotated[int, typer.Option(help="JPEG quality, 1-100.")] = 95,
    workers: Annotated[int, typer.Option(help="Processes that resize (0: this one).")] = 0,
    recipe: RecipeOpt = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a non-empty --out (it is renamed to <name>.previous-<time>, not "
        "deleted).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check everything and print what would be written; write nothing.")] = False,
    json_out: JsonOpt = False,
    overrides: Annotated[list[str] | None, typer.Argument(help=(
        "data.* overrides by dotted path: data.image_column=img data.label_column=fine_label "
        "data.synthetic.train_size=1000"))] = None,
) -> None:
    """A pre-resized copy of a dataset (parquet shards + manifest.json) that data.source=OUT reads faster."""
    from vitcli.data.prepare import Options
    from vitcli.stages.prepare import prepare_data as run

    options = Options(max_size=max_size, format=fmt, quality=quality, workers=workers)
    with _tables_off(json_out):
        written = run(source, out, recipe_file=recipe, overrides=list(overrides or []), splits=splits,
                      options=options, overwrite=overwrite, dry_run=dry_run)
    if json_out:
        _emit_json(written)


class ExportFormat(str, enum.Enum):
    """`vit export --format`: the folders it writes (vitcli.stages.export.FORMATS)."""

    hf = "hf"
    onnx = "onnx"
    timm = "timm"


@app.command()
def export(
    ckpt: Annotated[str, typer.Option(help="Weights: workdir, .safetensors, Google .npz or Hub name.")],
    fmt: Annotated[ExportFormat, typer.Option(
        "--format", help="hf: transformers ViTForImageClassification folder; onnx: model.onnx with a dynamic "
                         "batch axis; timm: a folder timm.create_model('local-dir:DIR') loads.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write (created; must be empty).")],
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace a non-empty --out (the old one is kept as <out>.previous-<time>).")
    ] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Check the checkpoint, the format and --out; write nothing.")] = False,
    json_out: JsonOpt = False,
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Recipe overrides by dotted path, e.g. model.num_heads=3 for a "
                                         "foreign file that does not tell")
    ] = None,
) -> None:
    """Export a checkpoint for Hugging Face transformers, ONNX runtimes or timm."""
    from vitcli.stages.export import export as run

    with _tables_off(json_out):
        report = run(ckpt, fmt.value, out, overwrite=overwrite, dry_run=dry_run,
                     overrides=list(overrides or []))
    if json_out:
        _emit_json(report)


def _version(value: bool) -> None:
    """`vit --version`: vitcli's, torch's and timm's versions and the device a run would use; then exit."""
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
    """What run.device=auto picks: the CUDA device's name, else the CPU with its cores and model. Without an
    NVIDIA driver torch cannot see a GPU, so only then is torch imported (seconds) to ask."""
    if Path("/proc/driver/nvidia").exists() or any(Path("/dev").glob("nvidia[0-9]*")):
        import torch

        if torch.cuda.is_available():
            return f"cuda ({torch.cuda.get_device_name(0)})"
    import platform

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux: the marketing name
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"cpu ({os.cpu_count()} cores, {model})"


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="Print vitcli's, torch's and timm's versions and the device a run would use, and exit.")
    ] = False,
) -> None:
    """Vision Transformers from pretraining to few-shot evaluation (Dosovitskiy et al., ICLR 2021)."""


# What a stop outside the training loop leaves (the loop's own stop writes a checkpoint and says so): every
# file is written under a temporary name and renamed when whole, and the temporary ones are removed on the
# way out (runtime.files), so what a command had finished stays and nothing half-written is left
KEPT = "what was finished is kept, nothing half-written is left"


def main() -> None:
    """Entry point: known errors become one red line (rank 0's alone) and exit 2; VITCLI_DEBUG=1
    shows tracebacks."""
    debug = os.environ.get("VITCLI_DEBUG") == "1"
    signal.signal(signal.SIGTERM, _terminate)  # unwind (temporary files removed) rather than die mid-write
    signal.signal(signal.SIGINT, _interrupt)
    try:
        with _process_group():
            if app(standalone_mode=False) == 130:  # Typer turns Ctrl-C into this return value: not success
                raise KeyboardInterrupt
    except VitcliError as e:
        if debug:
            raise
        _fail(str(e), e.exit_code)
    except typer.TyperException as e:  # Typer's own copy of click: a usage error, named in one line
        _usage_error(e)
    except (typer.Abort, KeyboardInterrupt):
        _fail(f"interrupted (Ctrl-C); {KEPT}", 130)
    except Terminated:
        _fail(f"terminated (SIGTERM); {KEPT}", 143)
    except Exception as e:  # a bug: still one line unless debugging
        if _STOPPED:  # what a signal turned into on its way up (an import it cut short): still the stop
            _fail(f"{_STOPPED[0]}; {KEPT}", 130 if _STOPPED[0].startswith("interrupted") else 143)
        if debug:
            raise
        _fail(f"{type(e).__name__}: {e} (set VITCLI_DEBUG=1 for the traceback)", 1)


@contextlib.contextmanager
def _process_group():
    """The command owns the process group a stage joins (runtime.dist.setup): it is left on every
    way out, a return, an error, Ctrl-C or SIGTERM (raised as Terminated). runtime.dist, and torch
    with it, is asked only if a stage imported it, so `vit --help` stays without torch."""
    try:
        yield
    except BaseException as e:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # The outcome is decided: torchrun's SIGTERM to the ranks still running, once one has
            # exited with an error, would only cut short their leaving and their report
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # an agreed stop (Interrupted) finds every rank at the same step: they leave as on a return
        _leave(failed=not isinstance(e, Interrupted))
        raise
    _leave(failed=False)


def _leave(failed: bool) -> None:
    """runtime.dist.leave, if a stage imported runtime.dist (else there is no group to leave)."""
    dist = sys.modules.get("vitcli.runtime.dist")
    if dist is not None:
        dist.leave(failed)


_STOPPED: list[str] = []  # the signal that stopped the command, once one did


def _terminate(signum, frame) -> None:
    _STOPPED.append("terminated (SIGTERM)")
    raise Terminated


def _interrupt(signum, frame) -> None:
    """Ctrl-C, remembered: a KeyboardInterrupt raised inside an import can come out as another error
    (ModuleNotFoundError, seen at 0.3 s into `vit prepare-data`), which must still exit 130."""
    _STOPPED.append("interrupted (Ctrl-C)")
    raise KeyboardInterrupt


def _usage_error(e: Exception) -> None:
    """`No such option: --recipy`, `Invalid value for '--res': ...` as one line with where to look, exit 2."""
    message = e.format_message().strip()
    if not message:  # a bare `vit`: the help was just printed, which is the answer
        sys.exit(2)
    command = next((a for a in sys.argv[1:] if a in COMMANDS), "")
    _fail(f"{message} (see `vit {command}{' ' if command else ''}--help`)", 2)


def _fail(message: str, code: int) -> None:
    """`message` as one red line on stderr, then exit `code`. Under torchrun every rank meets the
    same error (the same recipe and data, the same agreed step), so rank 0 alone prints it; each
    rank also leaves it in torchrun's error file, where torchrun's failure summary shows it (an
    error one rank met alone is named there too)."""
    _tell_torchrun(message)
    if int(os.environ.get("RANK", "0")) == 0:
        from rich.console import Console
        from rich.markup import escape

        # escaped: a message's own brackets (pip install 'vitcli[export]') are text, not rich markup
        line = f"[bold red]error:[/] {escape(message)}"
        Console(stderr=True, highlight=False, soft_wrap=True).print(line)
    sys.exit(code)


def _tell_torchrun(message: str) -> None:
    """`message` in the error file torchrun gives each worker (TORCHELASTIC_ERROR_FILE), which its
    summary of failed workers shows in place of its hint "To enable traceback see: ...". The layout
    is the one torch's own ErrorHandler.record_exception writes, with our one line where it puts the
    Python traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    # a file that cannot be written loses only the summary's line: the exit code tells the failure
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": {"message": message, "extraInfo": info}}, f)


if __name__ == "__main__":
    main()
