"""From parsed flags to a stage's result on stdout: the recipe resolved under the command's own
stage, and the one dispatcher every command hands its stage to. vitcli is imported inside the
functions, so `vit --help` imports none of it; torch comes with the stage, or with a recipe that
needs it to be complete."""

from __future__ import annotations

import contextlib
import csv
import functools
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer

from vitcli.runtime.launcher import LaunchEnv

if TYPE_CHECKING:
    from vitcli.recipe.grid import Grid
    from vitcli.recipe.schema import Recipe
    from vitcli.recipe.space import Search

Output = Literal["table", "json", "csv"]
Stage = Callable[..., Any]  # a stage function (vitcli.stages): what it returns is the result
# the stages that run in a workdir (recipe.yaml and results there), and the name that starts their
# default one: runs/<name>-<time>
WORKDIR_NAMES = {"pretrain": "pretrain", "finetune": "finetune", "eval-fewshot": "fewshot",
                 "evaluate": "evaluate"}


def resolve_recipe(stage: str, recipe_file: Path | None, overrides: list[str] | None,
                   flags: dict | None = None, *, vtab: bool = False, own_data: bool = False) -> Recipe:
    """The checked recipe of `vit STAGE`; torch is imported only if the recipe needs it (after every
    torch-free check). What the starting checkpoint says of itself lies below the recipe file: the
    pixels its weights expect, and for evaluate and predict its resolution (and for ours, with
    `own_data`, its data)."""
    from vitcli.recipe.resolve import resolve

    world_size = LaunchEnv.read().world_size  # torchrun's; the batch must split over it
    base = None if stage in ("pretrain", "prepare-data") else (lambda first: _trained_with(first, own_data))
    return resolve(stage, recipe_file, list(overrides or []), flags, vtab=vtab,
                   world_size=world_size, complete=_complete, base=base)


def resolve_grid(stage: str, recipe_file: Path | None, overrides: list[str] | None, specs: list[str] | None,
                 only: int | None, flags: dict | None = None) -> Grid | None:
    """The sweep the `--sweep KEY=V1,V2,...` options ask for, every point's recipe resolved (and so
    checked) as the command with that point's values would resolve it, above its overrides and
    flags, before any point trains; None without --sweep. `only` is --sweep-point's index."""
    from vitcli.errors import RecipeError, VitcliError
    from vitcli.recipe.grid import Grid, check_index, check_swept, points

    if not specs:
        if only is not None:
            raise RecipeError("--sweep-point runs one point of a sweep: give it with --sweep KEY=V1,V2")
        return None
    found = points(specs)
    flags = flags or {}
    given = {k for k, v in flags.items() if v is not None}
    clash = [k for k in found[0].overrides if k in given]
    if clash:
        raise RecipeError(f"--sweep {clash[0]}: an option of this command sets it too; drop one of them")
    check_index(only, len(found))
    recipes = []
    for point in found:
        try:
            recipes.append(resolve_recipe(stage, recipe_file, overrides, {**flags, **point.overrides}))
        except VitcliError as e:  # the key's own message, and which point gave the value
            raise type(e)(f"sweep point {point.name}: {e}") from None
    check_swept(found, recipes)
    return Grid(found, recipes, only)


def resolve_search(base: Recipe, recipe_file: Path | None, overrides: list[str] | None,
                   specs: list[str] | None, trials: int | None, slot: int | None, flags: dict | None = None,
                   *, sweep: bool = False, overwrite: bool = False, lr_sweep: bool = False,
                   task: bool = False) -> Search | None:
    """The search `--search KEY=DIST ... --trials N` asks for, checked before anything is written:
    the space parsed, the recipe resolved at each of its corners (recipe.space.corner_points) as
    the command with those values would resolve it; a trial's recipe is resolved the same way when
    it draws its values. None without --search. `slot` is --search-task's; `sweep`, `overwrite`,
    `lr_sweep` and `task`: whether those flags were given (each refused with --search)."""
    from vitcli.errors import RecipeError
    from vitcli.recipe.space import Search, space

    if not specs:
        extra = "--trials" if trials is not None else "--search-task" if slot is not None else None
        if extra:
            raise RecipeError(f"{extra} belongs to a search: give it with --search KEY=DIST")
        return None
    refusals = {"--sweep": (sweep, "pass one (a grid of values, or a search over ranges)"),
                "--lr-sweep": (lr_sweep, "pass one (--search optim.lr=log:LO:HI searches the rate)"),
                "--task": (task, "the VTAB protocol runs its own recipe per task"),
                "--overwrite": (overwrite, "a search resumes its study; pass a new --workdir to start over")}
    for flag, (given, why) in refusals.items():
        if given:
            raise RecipeError(f"--search with {flag}: {why}")
    if trials is None:
        raise RecipeError("--search needs --trials N, how many trials to run")
    if LaunchEnv.read().world_size > 1:
        raise RecipeError("--search trains each trial in one process: run it without torchrun (with "
                          "--slurm each array task runs one trial)")
    dists = space(specs)
    flags = flags or {}
    clash = [d.key for d in dists if flags.get(d.key) is not None]
    if clash:
        raise RecipeError(f"--search {clash[0]}: an option of this command sets it too; drop one of them")
    if slot is not None and not 0 <= slot < trials:
        raise RecipeError(f"--search-task {slot}: the search has {trials} trial slots, numbered 0 to "
                          f"{trials - 1}")
    resolve = functools.partial(_trial_recipe, base.stage, recipe_file, overrides, flags)
    _check_corners(base, dists, resolve)
    return Search(dists, trials, resolve, base.run.seed, base.search, slot)


def _trial_recipe(stage: str, recipe_file: Path | None, overrides: list[str] | None, flags: dict,
                  values: dict) -> Recipe:
    """A trial's recipe: the command's, its values above its overrides and flags."""
    return resolve_recipe(stage, recipe_file, overrides, {**flags, **values})


def _check_corners(base: Recipe, dists: list, resolve: Callable[[dict], Recipe]) -> None:
    """The recipe resolved at each corner of the space, each value the one its trial would train
    with (recipe.grid.check_swept); a dev split to choose on, and the supervised objective's
    val/top1."""
    from vitcli.errors import VitcliError
    from vitcli.recipe.grid import Point, check_swept, point_name
    from vitcli.recipe.objective_checks import check_searchable
    from vitcli.recipe.space import corner_points

    check_searchable(base)
    for values in corner_points(dists):
        try:
            check_swept([Point(point_name(values), values)], [resolve(values)])
        except VitcliError as e:  # the key's own message, and at which corner
            text = str(e).replace("--sweep ", "", 1)
            raise type(e)(f"--search at {point_name(values)}: {text}") from None


def searched(specs: list[str] | None, trials: int | None, search: Search | None) -> tuple | None:
    """What `--slurm` passes on of a search: its options, and its slot count (one array task each)."""
    if search is None:
        return None
    return ([a for spec in specs or [] for a in ("--search", spec)] + ["--trials", str(trials)], trials)


def _trained_with(first: Recipe, own_data: bool) -> dict:
    if not first.init.checkpoint or first.init.random:  # nothing to read: torch stays unimported
        return {}
    from vitcli.checkpoints.complete import trained_with

    return trained_with(first, own_data)


def _complete(recipe: Recipe, user_heads: bool) -> Recipe:
    from vitcli.checkpoints.complete import complete

    return complete(recipe, user_heads)


def check_resume_flags(resume: bool | None, overwrite: bool) -> None:
    """--resume with --overwrite is refused before the dry run, which would accept the pair."""
    from vitcli.runtime.workdir import check_resume_flags

    check_resume_flags(resume, overwrite)


def output_format(json_out: bool, csv_out: bool = False) -> Output:
    """The one format --json and --csv name; both at once is a usage error."""
    if json_out and csv_out:
        raise typer.BadParameter("--json and --csv both ask for the output format: pass one")
    return "json" if json_out else "csv" if csv_out else "table"


def dispatch(load: Callable[[], Stage], recipe: Recipe | None, *args: Any,
             workdir: Path | None = None, dry_run: bool | None = None, output: Output = "table",
             sweep: Grid | None = None, **kwargs: Any) -> None:
    """How every command runs its stage, and the one place that prints what the stage returns.

    `load()` imports and returns the stage function, only now: `--help`, a refused recipe and a dry
    run import no torch. A stage that runs in a workdir (WORKDIR_NAMES) is called as
    stage(recipe, workdir, *args, **kwargs), the workdir runs/<name>-<time> unless given; with
    `dry_run` the resolved recipe is printed instead and the stage is not even imported. Any other
    stage is called as stage([recipe,] *args, **kwargs) and plans its own dry run: it is handed
    `dry_run` where the command has the option, and says what it would write. A `sweep` (its Grid)
    is handed to the stage as `sweep=`; a dry run lists its points on stderr below the recipe.

    With output json or csv the stage's tables go nowhere and what it returned is printed on stdout
    by rank 0 alone (every rank returns it). Errors go up to main(), which makes each one line and
    an exit code; a return is exit 0.
    """
    in_workdir = recipe is not None and recipe.stage in WORKDIR_NAMES
    if in_workdir and dry_run:
        # a sweep's (--sweep, --lr-sweep) workdir refused as the sweep would refuse it
        if (sweep is not None or kwargs.get("lrs") or kwargs.get("search")) and workdir is not None:
            from vitcli.runtime.workdir import refuse_single_run

            refuse_single_run(workdir)
        _print_recipe(recipe)
        if kwargs.get("search"):
            return _print_space(kwargs["search"], workdir, recipe.stage)
        return _print_points(sweep, workdir) if sweep else None
    if sweep is not None:
        kwargs["sweep"] = sweep
    if in_workdir:
        args = (workdir or _new_workdir(WORKDIR_NAMES[recipe.stage]), *args)
    elif dry_run is not None:
        kwargs["dry_run"] = dry_run
    if recipe is not None:
        args = (recipe, *args)
    with _tables_off(output != "table"):
        result = load()(*args, **kwargs)
    if output != "table" and LaunchEnv.read().is_main:
        text = json.dumps(result, indent=2) + "\n" if output == "json" else as_csv(result)
        sys.stdout.write(text)


def dispatch_slurm(recipe: Recipe, workdir: Path | None, args: list[str], *, dry_run: bool, output: Output,
                   resume: bool | None = None, overwrite: bool = False, sweep: list[str] | None = None,
                   grid: Grid | None = None, search: tuple | None = None) -> None:
    """`--slurm`: the recipe (every point's, for a sweep) checked for the job's processes
    (slurm.nodes x processes per node), then the batch script printed (dry run) or written and
    submitted (vitcli.cluster.submit): one job, or a job array of one task per sweep point.
    Torch-free."""
    from vitcli.cluster.submit import submit
    from vitcli.recipe.checks import check
    from vitcli.recipe.cluster_checks import procs_per_node
    from vitcli.recipe.space import slot_name

    if resume is not None or overwrite:
        flag = "--overwrite" if overwrite else "--resume" if resume else "--no-resume"
        raise typer.BadParameter(f"--slurm with {flag}: the job resumes from the workdir's last checkpoint "
                                 "itself, at every requeue; use a new --workdir to start over")
    if grid is not None and grid.only is not None:
        raise typer.BadParameter("--slurm with --sweep-point: the job array runs every point, one per task")
    world = recipe.slurm.nodes * procs_per_node(recipe.slurm)
    if search is not None and world > 1:
        raise typer.BadParameter(f"--search with --slurm trains each trial in one process: slurm.nodes=1 "
                                 f"and one process per task (this recipe's job has {world})")
    for each in grid.recipes if grid else [recipe]:
        check(each, world)  # the batch splits over the job's ranks
    passed = [*args, *(a for spec in sweep or [] for a in ("--sweep", spec)), *(search[0] if search else [])]
    points = ([p.name for p in grid.points] if grid else
              [slot_name(k) for k in range(search[1])] if search else None)
    with _tables_off(output != "table"):
        result = submit(recipe, workdir or _new_workdir(WORKDIR_NAMES[recipe.stage]), tuple(passed),
                        points, dry_run=dry_run, index_flag="--search-task" if search else "--sweep-point")
    if result is not None and output == "json":
        sys.stdout.write(json.dumps(result, indent=2) + "\n")


def _new_workdir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def as_csv(records: list[dict]) -> str:
    """Records as CSV: a record's list of records (predict's `top`, one per rank) is spread over one
    row each, the record's other fields in front; floats to 6 significant digits."""
    rows = []
    for record in records:
        flat = {k: v for k, v in record.items() if not isinstance(v, list)}
        nested = next((v for v in record.values() if isinstance(v, list)), [{}])
        rows += [{**flat, **inner} for inner in nested]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(rows[0] if rows else [])
    writer.writerows([f"{v:.6g}" if isinstance(v, float) else v for v in row.values()]
                     for row in rows)
    return out.getvalue()


def _print_recipe(r: Recipe) -> None:
    """The recipe as YAML on stdout (what recipe.yaml will hold, `auto`s aside); on stderr, that
    data.micro_batch_size's auto is tried when the run starts, and what each `auto` of run.precision
    and run.compile becomes on this machine. Deciding that needs torch
    (is there a GPU, does this CPU run bf16): it is imported only now, every check passed, and only
    when a recipe says `auto`."""
    from vitcli.recipe.layers import to_yaml

    sys.stdout.write(to_yaml(r))
    # tried on the device, in child processes (run/micro_batch)
    if r.data.micro_batch_size == "auto":
        sys.stderr.write("# data.micro_batch_size: auto -> the largest that fits run.memory_budget_mb, found "
                         "by trial steps at the start of the run\n")
    if "auto" in (r.run.precision, r.run.compile):
        from vitcli.runtime.dist import pick_device
        from vitcli.runtime.precision import auto_choices

        for line in auto_choices(r, pick_device(r.run.device)):
            sys.stderr.write(f"# {line}\n")


def _print_points(grid: Grid, workdir: Path | None) -> None:
    """A dry run's list of a sweep's points on stderr, below the recipe (whose values they replace),
    and the directory each would train in."""
    where = workdir or f"runs/{WORKDIR_NAMES[grid.recipes[0].stage]}-<time>"
    sys.stderr.write(f"# sweep: {len(grid.points)} points, each its own run in {where}/<point>\n")
    for i, point in enumerate(grid.points):
        mark = "  <- --sweep-point" if i == grid.only else ""
        sys.stderr.write(f"#   {i}: {point.name}{mark}\n")


def _print_space(search: Search, workdir: Path | None, stage: str) -> None:
    """A dry run's search on stderr, below the recipe: its space, its trials and where they run."""
    where = workdir or f"runs/{WORKDIR_NAMES[stage]}-<time>"
    sys.stderr.write(f"# search: {search.trials} trials, each its own run in {where}/trial-<k>, the study "
                     f"in {where}/search.journal (seed {search.seed})\n")
    for text in search.texts():
        sys.stderr.write(f"#   {text}\n")


@contextlib.contextmanager
def _tables_off(off: bool) -> Iterator[None]:
    """With --json or --csv, stdout carries the results alone: the tables are printed nowhere."""
    if not off:
        yield
        return
    from vitcli.runtime.metrics import stdout

    with open(os.devnull, "w") as sink:
        stdout.file = sink  # a file, not `quiet`: dist.setup sets quiet per rank
        try:
            yield
        finally:
            stdout.file = None  # back to whatever sys.stdout is
