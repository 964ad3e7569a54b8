"""The package reads as the pipeline: packages by layer, without cycles, imports at the top, short
functions.

LAYERS below is the architecture, an order of packages from the bottom up: errors < recipe < runtime
< models < data < checkpoints < train < evaluators < objectives < figures < fewshot < run < stages <
cluster < cli. A module may
import only packages below its own and, inside its package, modules listed before it: so no import
runs back up and no cycle can form. A new module has to be given its place here.
"""

import ast
import statistics
from pathlib import Path
from typing import get_args

import pytest

from helpers import REPO
from vitcli.objectives.registry import OBJECTIVES
from vitcli.recipe.choices import Objective

SRC = REPO / "src" / "vitcli"
LAYERS = [  # (package, its modules in order), lowest first: the tree read as the pipeline, bottom up
    # typed errors, imported by every layer
    ("errors", []),
    # the experiment as data: choices and names, schema, checks, resolution (no torch)
    ("recipe", ["choices", "schema", "layers", "names", "data_checks", "holdout_checks",
                "fewshot_checks", "objective_checks", "cluster_checks", "rollback_checks",
                "checks", "resolve", "grid", "space"]),
    # what every stage runs on: the allocator's settings, the launcher's environment, run file names
    # and the run directory's rules, atomic files, precision, peak FLOP/s, peak memory, console and
    # metrics, trackers, processes, output locations
    ("runtime", ["allocator", "faults", "launcher", "run_files", "run_dir", "precision", "peak", "memory",
                 "files", "metrics", "trackers_mlflow", "trackers", "dist", "threads", "workdir",
                 "finished", "environment"]),
    # the networks and their pure maths
    ("models", ["posemb", "mpp", "mae", "layer_decay", "dino_head", "dino_loss", "ibot_masks", "dino", "t2t",
                "zoo", "flops"]),
    # images into batches (data/__init__.py draws the route), in four packages. Decoding first: how
    # an image that does not decode is named and tallied (every reader of images uses it), the
    # crop-only JPEG decode, the decoded-image cache; then the augmentation ops and what draws and
    # applies them; then where rows come from (sources, the folder index, tar shards, prepared
    # copies); then what batches them
    ("data.decoding", ["bad_images", "jpeg_region", "decode", "image_cache"]),
    ("data.augmentation", ["pillow_ops", "randaugment", "three_augment", "erasing", "mixing", "augmentations",
                           "augment", "transforms", "colour", "multicrop"]),
    ("data.rows", ["synthetic", "tasks", "imagenet", "folder_listing", "folder_index", "tar_shards",
                   "holdout", "reader",
                   "reader_synthetic", "reader_hub", "reader_saved", "reader_files", "reader_folder",
                   "reader_prepared", "reader_tars", "reader_factory", "sources", "prepare"]),
    ("data.batching", ["sampler", "batches", "streams"]),
    # weights in and out: our files, training state and its one owner, foreign formats, fitting
    ("checkpoints", ["weights", "state", "sharded", "writer", "remote", "manager", "npz", "pth", "hf_vit",
                     "timm_folder", "read", "describe", "preprocessing", "fit", "complete",
                     "resize", "transfer", "export_timm", "export_hf", "export_onnx", "card"]),
    # the one loop and what it is made of
    ("train", ["schedule", "ema", "parallelize", "optim", "losses", "distill", "interrupt", "throughput",
               "watchdog", "rollback", "loop", "cost"]),
    # what the loop runs when due
    ("evaluators", ["inference", "classify", "robustness", "heldout", "calibration", "tta"]),
    # the objective as a part: what each gives a run (network, loss, evaluator, head, FLOPs), one
    # module each, picked by name in the registry
    ("objectives", ["objective", "supervised", "mpp", "mae", "dino", "registry"]),
    # pictures drawn from numbers: Figure 7, MAE's Figure 2, DINO's Figure 1, training curves, a
    # confusion matrix, a reliability diagram, few-shot accuracy against shots (below fewshot, whose
    # report draws that one)
    ("figures", ["canvas", "figure7", "figure2", "attention", "curves", "confusion", "reliability",
                 "fewshot"]),
    # frozen-feature evaluation in its steps
    ("fewshot", ["solver", "knn", "probe", "features", "protocols", "evaluate", "report"]),
    # the run, built once for every stage that trains: its table, its feed, its network, the
    # micro-batch trials, the builder, and --preflight's measurement and estimate
    ("run", ["report", "feed", "network", "trial", "micro_batch", "build", "measure", "estimate"]),
    # one driver per command
    ("stages", ["run", "preflight", "sweep", "search", "vtab", "finetune", "fewshot", "inspect", "plot",
                "resize", "prepare", "export", "evaluate_extra", "evaluate", "predict", "suite", "env"]),
    # a run taken onto a SLURM cluster: its batch script, its requeues, its submission (torch-free),
    # and the job's torchrun, whose exit code says why ranks failed
    ("cluster", ["requeue", "slurm", "submit", "launch"]),
    # the command line: options declared once, the one dispatcher, the commands, main(); and
    # `python -m vitcli` running it
    ("cli", ["options", "dispatch", "commands", "entry", "__main__"]),
    ("__main__", []),
]
ORDER = [m for package, names in LAYERS for m in ([f"{package}.{n}" for n in names] or [package])]
PACKAGES = tuple(package for package, names in LAYERS if names)
# keeps `vit --help` instant: their vitcli imports (but the options' choices) are inside functions
CLI_LAZY = {m for m in ORDER if m.startswith("cli.")}


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if not name.endswith("__init__"):
            found[name] = path
    return found


def vitcli_imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(module imported, node) for every `import vitcli.x` / `from vitcli(.x) import y` in the
    tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vitcli"):
            base = node.module.removeprefix("vitcli").lstrip(".")
            for alias in node.names:  # `from vitcli import data` or `from vitcli.fewshot import solver`
                full = f"{base}.{alias.name}".lstrip(".")
                out.append((full if full in ORDER else base, node))
        elif isinstance(node, ast.Import):
            out += [(a.name.removeprefix("vitcli."), node) for a in node.names
                    if a.name.startswith("vitcli.")]
    return out


def test_every_module_has_a_place_in_the_order():
    assert sorted(modules()) == sorted(ORDER)


def test_only_the_command_line_and_the_errors_sit_at_the_top_level():
    assert sorted(m for m in modules() if "." not in m) == ["__main__", "errors"]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_says_what_it_holds(package):
    doc = ast.get_docstring(ast.parse(SRC.joinpath(*package.split("."), "__init__.py").read_text()))
    assert doc, f"{package}/__init__.py has no docstring naming its modules"
    missing = [n for n in dict(LAYERS)[package] if f"{n}.py" not in doc]
    assert not missing, f"{package}/__init__.py does not name {missing}"


@pytest.mark.parametrize("name", ORDER)
def test_a_module_imports_only_modules_below_it(name):
    tree = ast.parse(modules()[name].read_text())
    above = [m for m, _ in vitcli_imports(tree) if m in ORDER and ORDER.index(m) >= ORDER.index(name)]
    assert not above, f"{name} imports {above}, which sit above it (or are itself)"
    unknown = [m for m, _ in vitcli_imports(tree) if m not in ORDER and m not in ("", *PACKAGES)]
    assert not unknown, f"{name} imports {unknown}, which are not modules"


# pip extras: imported only when a recipe asks for them
OPTIONAL_EXTRAS = {"torch.utils.tensorboard", "wandb", "mlflow.entities", "mlflow.tracking",
                   "mlflow.exceptions", "trackio", "trackio.sqlite_storage", "optuna", "optuna.storages",
                   "optuna.storages.journal"}
# imported only where they are used, for a run's start-up time (seconds each, measured under load),
# which tests/integration/test_import_time.py bounds: a sharded checkpoint's DCP, and matplotlib
# when drawing; and for a micro-batch trial's memory, which importing its objective and the loop
# would swell by datasets and pandas (~100 MiB), the held-out evaluators, the data sources and DINO's
# multi-crop (its decoders); and fsspec in the recipe's torch-free checks, which run for every
# command, while only run.ckpt_dir needs it (its s3fs or gcsfs only when a URI names them)
ON_DEMAND = ("torch.distributed.checkpoint", "matplotlib", "vitcli.evaluators.heldout",
             "vitcli.data.rows.sources", "vitcli.data.augmentation.multicrop", "fsspec")


def imported_module(stmt: ast.Import | ast.ImportFrom) -> str:
    return stmt.module or "" if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name


@pytest.mark.parametrize("name", sorted(set(ORDER) - CLI_LAZY))
def test_no_import_inside_a_function_but_optional_extras(name):
    tree = ast.parse(modules()[name].read_text())
    inner = [f"line {stmt.lineno}" for fn in ast.walk(tree)
             if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for stmt in ast.walk(fn) if isinstance(stmt, ast.Import | ast.ImportFrom)
             if imported_module(stmt) not in OPTIONAL_EXTRAS
             and not imported_module(stmt).startswith(ON_DEMAND)]
    assert not inner, f"{name} imports inside a function at {inner}"


def function_lengths() -> dict[str, int]:
    lengths = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lengths[f"{name}.{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return lengths


def test_functions_are_short():
    lengths = function_lengths()
    assert statistics.median(lengths.values()) <= 12, statistics.median(lengths.values())
    long = {k: n for k, n in lengths.items() if n > 60}
    assert not long, long


def test_the_loop_never_asks_which_strategy_or_data_kind_it_runs_under():
    """Parallelism is applied before the loop (train.parallelize.apply) and the stage picks the
    batches: the loop reads no run.strategy, no data.streaming, and never tells a checkpoint file
    from a directory."""
    tree = ast.parse(modules()["train.loop"].read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"strategy", "streaming", "is_dir", "is_file"}, (
        names & {"strategy", "streaming", "is_dir"})


def test_one_module_owns_resume():
    """checkpoints.manager alone decides, saves and loads training state: nothing else imports the
    formats it writes (checkpoints.state, checkpoints.sharded)."""
    parts = {"checkpoints.state", "checkpoints.sharded"}
    users = {name for name, path in modules().items()
             for m, _ in vitcli_imports(ast.parse(path.read_text())) if m in parts}
    assert users == {"checkpoints.manager"}, users


def test_the_objective_is_chosen_in_one_place():
    """`objective ==` / `!=` only in the recipe's checks: everywhere else the registry
    (objectives.registry) picked the objective once, by name, and what it gives the run is asked of
    it."""
    compared = set()
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            ops = node.ops if isinstance(node, ast.Compare) else []
            if any(isinstance(op, ast.Eq | ast.NotEq) for op in ops):
                sides = [node.left, *node.comparators]
                if any(isinstance(n, ast.Attribute) and n.attr == "objective" or
                       isinstance(n, ast.Name) and n.id == "objective" for n in sides):
                    compared.add(name)
    assert compared == {"recipe.objective_checks", "recipe.checks"}, compared  # (mixup needs labels)


def test_the_registry_names_exactly_the_objectives_a_recipe_may_name():
    """recipe.choices.Objective (what the torch-free checks accept) and objectives.registry (what a
    run builds) list the same names: a new objective is its own module, a line in the registry and
    its name in the Literal, and this holds the last two together."""
    assert set(get_args(Objective)) == set(OBJECTIVES)


def test_only_the_command_line_imports_the_pretrain_stage():
    """stages.run is `vit pretrain`, no library: what stages share lives below them (the run
    package)."""
    users = {name for name, path in modules().items()
             for m, _ in vitcli_imports(ast.parse(path.read_text())) if m == "stages.run"}
    assert users <= {m for m in ORDER if m.startswith("cli.")}, users
