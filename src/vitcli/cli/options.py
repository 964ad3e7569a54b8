"""Every option and argument of `vit`, declared once: a command names the ones it takes
(`opt.Ckpt`, `opt.Json`). Closed choices are types built from vitcli.recipe.choices, so `--help`,
Typer's check and the stage cannot drift apart."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

from vitcli.recipe.choices import EXPORT_FORMATS, IMAGENET_SETS, POSEMB_METHODS, TTA_VIEWS

# Typer labels flags `<bool>` as if they took a value (`--dry-run <bool>`); a flag takes none, so
# show no type. A private method: some Typer releases lack it (0.27.2 raised AttributeError at
# import), and then the label stays as Typer draws it.
_display_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _display_type is not None:
    typer.core.TyperOption.display_type_rich = lambda self, ctx: (
        None if self.is_flag else _display_type(self, ctx)
    )


class Choice(str, enum.Enum):
    """A closed choice as the Enum Typer offers and checks; a member is its string, and says so."""

    def __str__(self) -> str:
        return self.value


def choice(name: str, values: tuple[str, ...]) -> type[Choice]:
    """The Choice of `values`, one member each."""
    return Choice(name, {v: v for v in values})


ExportFormat = choice("ExportFormat", EXPORT_FORMATS)
PosembMethod = choice("PosembMethod", POSEMB_METHODS)
ImagenetSet = choice("ImagenetSet", IMAGENET_SETS)
TtaView = choice("TtaView", TTA_VIEWS)


def flag(name: str, help: str) -> type:
    """An on/off option, off unless given."""
    return Annotated[bool, typer.Option(name, help=help)]


def overrides(examples: str) -> type:
    """KEY=VALUE arguments by dotted path; `examples` are the command's likeliest."""
    return Annotated[list[str] | None,
                     typer.Argument(help=f"Recipe overrides by dotted path: {examples}")]


# ---------------------------------------------------------------- shared by several commands

RecipeFile = Annotated[Path | None, typer.Option(
    "--recipe", "-r", help="YAML recipe; omitted: built-in defaults.")]
Workdir = Annotated[Path | None, typer.Option(
    "--workdir", "-w", help="Run directory; default runs/<stage>-<time>.")]
Ckpt = Annotated[str | None, typer.Option(
    "--ckpt", help="Weights: a vitcli workdir or file, timm .safetensors, Google .npz, a torch .pth "
                   "(MAE's), a transformers ViT folder or Hub name.")]
DryRun = flag("--dry-run", "Print the resolved recipe as YAML and exit.")
Plan = flag("--dry-run", "Check everything and print what would be written; write nothing.")
Json = flag(
    "--json",
    "Print the results as JSON on stdout instead of tables (logs and progress stay on stderr).")
Resume = Annotated[bool | None, typer.Option(
    "--resume/--no-resume", help="Resume from the latest good WORKDIR/state-<step>.pt (default: "
                                 "when there is one).")]
Overwrite = flag(
    "--overwrite",
    "Start over in a workdir that holds a run, finished or not (its files are moved to "
    "previous-<time>/, not deleted).")
Slurm = flag(
    "--slurm",
    "Submit to SLURM instead of running here: the recipe's slurm.* keys (nodes, GPUs, time, "
    "partition, ...) make WORKDIR/slurm/job.sh, one torchrun per node; preempted or out of time, "
    "it checkpoints and requeues itself. With --dry-run: print the script.")
Again = flag(
    "--overwrite",
    "Run again into a workdir that holds this command's finished results (they are moved to "
    "previous-<time>/, not deleted); without it the same request prints them again.")
Replace = flag(
    "--overwrite",
    "Replace a non-empty --out (the old one is kept as <out>.previous-<time>, not deleted).")
ReplaceFile = flag(
    "--overwrite",
    "Replace an existing --out file (the old one is kept beside it as <name>.previous-<time>).")
OutDir = Annotated[Path, typer.Option(
    "--out", "-o", help="Directory to write: new or empty (see --overwrite).")]
DataRoot = Annotated[str | None, typer.Option(
    help="A local root, one directory per task (e.g. DIR/svhn), instead of the Hub.")]
TrainOverrides = overrides("optim.lr=1e-3 data.batch_size=64")
Preflight = flag(
    "--preflight",
    "Time the run before committing to it: a few real steps, each evaluation and a checkpoint in a "
    "throwaway folder beside --workdir (which is left untouched); prints step time, data wait, "
    "peak memory, the whole run's ETA, disk and SLURM requeues.")
PreflightSteps = Annotated[int, typer.Option(
    "--preflight-steps", min=1, help="Steps --preflight times, after a quarter as many of warm-up.")]
# 4 logging windows of 5 steps after one of warm-up: at a second a step, the preflight's steps take
# 25 s
PREFLIGHT_STEPS = 20
NetworkOverrides = overrides("model.num_heads=3 for a foreign file that does not tell")

# ---------------------------------------------------------------- sweeps (pretrain and finetune)

Sweep = Annotated[list[str] | None, typer.Option(
    "--sweep", metavar="KEY=V1,V2",
    help="One run per value of a recipe key, each in WORKDIR/<point>, e.g. --sweep optim.lr=1e-3,3e-3 "
         "--sweep run.seed=0,1 (repeatable: every combination, the last key varying fastest); finished "
         "points are skipped on a rerun; WORKDIR/sweep.csv holds every point's final metrics. See "
         "docs/sweeps.md.")]
SweepPoint = Annotated[int | None, typer.Option(
    "--sweep-point", metavar="I", hidden=True,
    help="Run only point I (0-based) of --sweep, as a SLURM array task; the task that finishes the last "
         "point writes the sweep's table.")]

# ---------------------------------------------------------------- searches (pretrain and finetune)

Search = Annotated[list[str] | None, typer.Option(
    "--search", metavar="KEY=DIST",
    help="Search a recipe key with Optuna (repeatable): DIST is log:LO:HI (log-uniform), LO:HI "
         "(uniform; ints for an int key) or V1,V2,... (one of them), e.g. --search "
         "optim.lr=log:1e-4:3e-3; each trial a run in WORKDIR/trial-<k>, weak ones pruned on "
         "val/top1; the same command resumes it. See docs/search.md.")]
Trials = Annotated[int | None, typer.Option(
    "--trials", metavar="N", min=1, help="How many trials --search runs (pruned and failed ones "
                                         "count).")]
SearchTask = Annotated[int | None, typer.Option(
    "--search-task", metavar="I", hidden=True,
    help="Run only trial slot I (0-based) of --search, as a SLURM array task; the task that finishes "
         "the last trial writes the table.")]

# ---------------------------------------------------------------- finetune

Init = Annotated[str | None, typer.Option(
    help="Starting weights: workdir, .safetensors, Google .npz, a torch .pth (MAE's), a transformers ViT "
         "folder or Hub name.")]
Res = Annotated[int | None, typer.Option(
    help="Fine-tuning resolution (position embedding resized).")]
LrSweep = Annotated[str | None, typer.Option(
    help="Comma-separated learning rates; best on the dev split wins.")]
Task = Annotated[str | None, typer.Option(
    help="VTAB-1k protocol, VTAB names only: vtab (all 19), vtab/natural|specialized|structured or "
         "vtab/<name>, e.g. vtab/cifar100. Other datasets fine-tune with data.source.")]

# ---------------------------------------------------------------- eval-fewshot

Tasks = Annotated[str | None, typer.Option(help="vtab, vtab/natural, vtab/cifar100,vtab/dtd, ...")]
Shots = Annotated[str | None, typer.Option(help="Shot counts, e.g. 1,5,10,25.")]
Seeds = Annotated[int | None, typer.Option(help="Shot-set draws per shot count.")]
L2 = Annotated[str | None, typer.Option(help="Ridge strength, or 'auto' (leave-one-out).")]
Protocols = Annotated[str | None, typer.Option(
    help="What scores the features, comma-separated: fewshot (default), knn, linear, ridge; or all.")]
ListTasks = flag("--list-tasks", "Print the task registry and exit.")
RandomInit = flag(
    "--random-init",
    "Score --ckpt's network with fresh weights (run.seed): the baseline.")
FewshotOverrides = overrides("fewshot.l2_reg=auto data.eval_batch_size=256")

# ---------------------------------------------------------------- evaluate and predict

EvalData = Annotated[str | None, typer.Option(
    "--data", help="Images to evaluate on (any data.source); default: the checkpoint's training "
                   "data.")]
EvalSplit = Annotated[str | None, typer.Option(
    "--split", help="Split to evaluate (HF syntax); default data.test_split, else data.val_split.")]
RealLabels = Annotated[Path | None, typer.Option(
    help="ImageNet ReaL real.json: also report real/top1 on the ImageNet validation split.")]
# a flag of its own, not --real-labels without a value: Typer (0.29) gives an option no optional
# value, and `--real-labels data.x=1` would be ambiguous with the overrides that follow
Real = flag("--real", "--real-labels with timm's copy of ReaL's real.json (timm/data/_info).")
EvalImagenetSet = Annotated[ImagenetSet | None, typer.Option(
    "--imagenet-set", help="The ImageNet set the split is, scored with a 1000-class head (A and R over "
                           "their 200 classes); default: detected from its class folders.")]
Suite = Annotated[Path | None, typer.Option(
    "--suite", help="Evaluate on every ImageNet set under this folder (imagenet, imagenet-v2, imagenet-a, "
                    "imagenet-r, imagenet-sketch, ...: see docs/evaluate.md) and print one table.")]
Tta = Annotated[list[TtaView] | None, typer.Option(
    "--tta", help="Test-time views: flip (x and its mirror), multicrop (five crops); both (--tta flip "
                  "--tta multicrop): ten crops. Reports tta/top1 beside the plain top1.")]
CalibrateOn = Annotated[str | None, typer.Option(
    "--calibrate-on", help="Held-out split (HF syntax) to fit a softmax temperature on; reports ts/ece, "
                           "ts/nll beside the raw ece, nll.")]
EvalOverrides = overrides("data.eval_crop_pct=0.875 run.precision=fp32")
Images = Annotated[list[Path], typer.Argument(
    help="Image files, and folders searched recursively.")]
TopK = Annotated[int, typer.Option(min=1, help="Classes shown per image.")]
BatchSize = Annotated[int | None, typer.Option(
    help="Images per forward pass (data.eval_batch_size).")]
Csv = flag(
    "--csv",
    "Print CSV rows path,rank,class_index,class_name,probability instead of a table.")
Set = Annotated[list[str] | None, typer.Option(
    "--set", help="Recipe override by dotted path, e.g. --set run.device=cpu (repeatable).")]

# ---------------------------------------------------------------- resize-posemb

ResizeOut = Annotated[Path | None, typer.Option(
    "--out", help="Output .safetensors; default: beside the source as <name>_<H>x<W>.safetensors "
                  "(a Hub model: in the current directory).")]
NewRes = Annotated[int | None, typer.Option("--res", help="New resolution (grid = res / patch).")]
Grid = Annotated[str | None, typer.Option(help="New grid as HxW, e.g. 24x24.")]
OldGrid = Annotated[str | None, typer.Option(help="The grid the table spans as HxW, if the checkpoint does "
                                              "not say (a non-square table without metadata).")]
Patch = Annotated[int | None, typer.Option(help="Patch size, if the checkpoint does not say.")]
Method = Annotated[PosembMethod, typer.Option(help="bilinear (big_vision) or bicubic (timm).")]

# ---------------------------------------------------------------- inspect and plot

Figures = Annotated[Path, typer.Option(
    "--out", "-o", help="Directory for the figures (created if needed).")]
InspectData = Annotated[str | None, typer.Option(
    "--data", help="Images for the attention distances: any data.source (dataset dir, parquet "
                   "files, Hub id); default: the built-in synthetic data.")]
InspectSplit = Annotated[str, typer.Option("--split", help="Split of the --data source to read.")]
InspectImages = Annotated[int, typer.Option(
    "--images", min=1, help="Images averaged over for the attention distances.")]
InspectOverrides = overrides("model.num_heads=3 for a foreign file that does not tell, "
                             "data.image_column=img")
Workdirs = Annotated[list[Path], typer.Argument(help="Training workdirs holding metrics.jsonl.")]
CurvesOut = Annotated[Path | None, typer.Option(
    "--out", "-o", help="PNG to write; default WORKDIR/curves.png for one workdir, ./curves.png "
                        "for several.")]

# ---------------------------------------------------------------- prepare-data and export

Source = Annotated[str, typer.Argument(
    help="Any data.source: synthetic, an image folder, a save_to_disk directory, parquet files or "
         "a glob, WebDataset .tar shards, a Hub id.")]
MaxSize = Annotated[int, typer.Option(
    help="Shorter side at most this many pixels; smaller images are copied unchanged.")]
Splits = Annotated[str | None, typer.Option(
    help="Comma-separated splits to copy, e.g. train,validation; default: every split.")]
ImageFormat = Annotated[str, typer.Option(
    "--format", help="jpeg (re-encoded at --quality) or png (lossless, larger: the exact-pixels "
                     "option, since an image column holds encoded images, not raw arrays).")]
Quality = Annotated[int, typer.Option(help="JPEG quality, 1-100.")]
Shards = Annotated[str, typer.Option(
    help="parquet (read map-style or streamed) or tar (WebDataset shards, KEY.jpg + KEY.cls, that "
         "training streams).")]
Workers = Annotated[int, typer.Option(help="Processes that resize (0: this one).")]
ShuffleSeed = Annotated[int, typer.Option(
    "--seed", help="Seed of the order --shards tar writes the rows in (recorded in manifest.json).")]
DataOverrides = Annotated[list[str] | None, typer.Argument(
    help="data.* overrides by dotted path: data.image_column=img data.label_column=fine_label "
         "data.synthetic.train_size=1000")]
Format = Annotated[ExportFormat, typer.Option(
    "--format", help="hf: transformers ViTForImageClassification folder; onnx: model.onnx with a "
                     "dynamic batch axis; timm: a folder timm.create_model('local-dir:DIR') "
                     "loads.")]
ResultsDirs = Annotated[list[Path] | None, typer.Option(
    "--results", help="A folder of vit evaluate, vit eval-fewshot or a VTAB run of this checkpoint, "
                      "whose results the model card carries (model-index); repeatable.")]
