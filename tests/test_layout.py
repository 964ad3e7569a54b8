"""The package reads as the pipeline: layers without cycles, imports at the top, short functions.

The order below is the architecture: cli -> stage drivers -> the trainer -> evaluators, data, models,
checkpoints -> pure maths. A module may import only modules listed before it, so a cycle cannot form; a
new module has to be given its place here.
"""

import ast
import statistics
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vitcli"
ORDER = [
    # pure maths and the recipe schema
    "errors", "recipe.choices", "runtime.run_files", "train.schedule", "models.posemb", "models.mpp", "fewshot.solver", "recipe.schema", "recipe.names", "recipe.data_checks", "recipe.checks", "runtime.precision", "runtime.rngs", "data.synthetic",
    # our files (atomic writes, which metrics.jsonl uses too), processes, console, the resumable state (sharded
    # too); figures
    "runtime.files", "checkpoints.weights", "runtime.metrics", "runtime.trackers", "runtime.dist", "checkpoints.state", "checkpoints.sharded", "train.parallelize", "runtime.workdir", "checkpoints.manager", "figures.figure7",
    "figures.curves",
    # models, data, checks on recipes, checkpoints of every source
    "models.t2t", "models.zoo", "data.transforms", "data.tasks", "data.sources", "data.batches", "data.streams",
    "checkpoints.npz", "checkpoints.read", "checkpoints.describe", "checkpoints.complete", "checkpoints.fit", "checkpoints.resize",
    # from the command line to a recipe
    "recipe.resolve",
    # evaluators, starting weights, the loop
    "train.optim", "train.objectives", "train.interrupt", "checkpoints.transfer", "evaluators.inference", "fewshot.features", "fewshot.evaluate", "fewshot.report", "train.loop", "evaluators.heldout",
    # stage drivers, then the command line
    "stages.run", "stages.sweep", "stages.vtab", "stages.finetune", "stages.fewshot", "stages.inspect", "stages.plot", "stages.resize", "cli",
]
PACKAGES = ("checkpoints", "fewshot", "recipe", "runtime", "models", "data", "train", "evaluators", "figures", "stages")
CLI_LAZY = {"cli"}  # keeps `vit --help` instant: its vitcli imports happen inside the commands


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        if not name.endswith("__init__"):
            found[name] = path
    return found


def vitcli_imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(module imported, node) for every `import vitcli.x` / `from vitcli(.x) import y` in the tree."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vitcli"):
            base = node.module.removeprefix("vitcli").lstrip(".")
            for alias in node.names:  # `from vitcli import data` or `from vitcli.fewshot import solver`
                full = f"{base}.{alias.name}".lstrip(".")
                out.append((full if full in ORDER else base, node))
        elif isinstance(node, ast.Import):
            out += [(a.name.removeprefix("vitcli."), node) for a in node.names if a.name.startswith("vitcli.")]
    return out


def test_every_module_has_a_place_in_the_order():
    assert sorted(modules()) == sorted(ORDER)


@pytest.mark.parametrize("name", ORDER)
def test_a_module_imports_only_modules_below_it(name):
    tree = ast.parse(modules()[name].read_text())
    above = [m for m, _ in vitcli_imports(tree) if m in ORDER and ORDER.index(m) >= ORDER.index(name)]
    assert not above, f"{name} imports {above}, which sit above it (or are itself)"
    unknown = [m for m, _ in vitcli_imports(tree) if m not in ORDER and m not in ("", *PACKAGES)]
    assert not unknown, f"{name} imports {unknown}, which are not modules"


OPTIONAL_EXTRAS = {"torch.utils.tensorboard", "wandb"}  # pip extras: imported only when a recipe asks for them


def imported_module(stmt: ast.Import | ast.ImportFrom) -> str:
    return stmt.module or "" if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name


@pytest.mark.parametrize("name", sorted(set(ORDER) - CLI_LAZY))
def test_no_import_inside_a_function_but_optional_extras(name):
    tree = ast.parse(modules()[name].read_text())
    inner = [f"line {stmt.lineno}" for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for stmt in ast.walk(fn) if isinstance(stmt, ast.Import | ast.ImportFrom)
             if imported_module(stmt) not in OPTIONAL_EXTRAS]
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
    """Parallelism is applied before the loop (train.parallelize.apply) and the stage picks the batches: the
    loop reads no run.strategy, no data.streaming, and never tells a checkpoint file from a directory."""
    tree = ast.parse(modules()["train.loop"].read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"strategy", "streaming", "is_dir", "is_file"}, names & {"strategy", "streaming", "is_dir"}


def test_one_module_owns_resume():
    """checkpoints.manager alone decides, saves and loads training state: nothing else imports the formats it
    writes (checkpoints.state, checkpoints.sharded) or the RNG states it restores (runtime.rngs)."""
    parts = {"checkpoints.state", "checkpoints.sharded", "runtime.rngs"}
    users = {name for name, path in modules().items()
             for m, _ in vitcli_imports(ast.parse(path.read_text())) if m in parts}
    assert users == {"checkpoints.manager"}, users
