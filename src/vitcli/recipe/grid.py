"""A sweep's grid: `--sweep KEY=V1,V2,...` options -> the points, each a name usable as a directory
and the overrides it adds to the command's recipe. Pure and torch-free: the CLI resolves every
point's recipe from them before the first one trains, and a SLURM job array asks how many there are
and runs one per task.

Values are read as overrides are (`optim.lr=1e-3`: a YAML scalar) and coerced to the key's declared
type by layers.merge, so a point holds what its recipe will: `optim.lr=1e-3` a float,
`model.depth=1,2` ints, a list key (`fewshot.shots=1,5`) one single-item list per point. Points are
the Cartesian product in the order the options were given, the last key varying fastest
(itertools.product), like nested loops written out.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from vitcli.errors import RecipeError
from vitcli.recipe.layers import merge, parse_overrides
from vitcli.recipe.schema import Recipe

# keys one command's points cannot differ in: the command decides the stage, and one process group
# (made once, on one device, runtime.dist.setup) runs every point
FIXED = {"stage": "the command decides the stage",
         "run.device": "one process group runs every point, on one device"}
# a directory name's characters on every filesystem a cluster mounts; anything else becomes `_`
_UNSAFE = re.compile(r"[^A-Za-z0-9._,=+-]")
MAX_NAME = 120  # bytes: a file system allows 255 per path component; the rest goes to a hash


@dataclass(frozen=True)
class Point:
    """One setting of the swept keys: `name` is its directory below the sweep's workdir, `overrides`
    maps each dotted key to its coerced value, in the order the keys were given."""

    name: str
    overrides: dict[str, Any] = field(hash=False)


@dataclass(frozen=True)
class Grid:
    """A sweep resolved by the CLI: its points, each one's complete recipe (checked before any point
    trains), and `only`, the one point a SLURM array task runs (`--sweep-point`; None: every point
    in turn)."""

    points: list[Point]
    recipes: list[Recipe]
    only: int | None = None


def axes(specs: list[str]) -> list[tuple[str, list]]:
    """`["optim.lr=1e-3,3e-3", "run.seed=0,1"]` -> `[("optim.lr", [0.001, 0.003]), ("run.seed", [0,
    1])]`; an unknown key, a value of the wrong type, a key or value given twice, or no values is a
    RecipeError naming the key."""
    found: dict[str, list] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(f"--sweep {spec!r} is not KEY=V1,V2,... (for example optim.lr=1e-3,3e-3)")
        if key in found:
            raise RecipeError(f"--sweep {key}: given twice; list all its values in one --sweep {key}=...")
        if key in FIXED:
            raise RecipeError(f"--sweep {key}: cannot be swept ({FIXED[key]})")
        found[key] = _values(key, raw)
    return list(found.items())


def _values(key: str, raw: str) -> list:
    """Each comma-separated value of one key, coerced as the recipe coerces an override of it."""
    items = [item.strip() for item in raw.split(",")]
    if not raw.strip():
        raise RecipeError(f"--sweep {key}: no values; give them comma-separated, e.g. {key}=V1,V2")
    values = []
    for item in items:
        probe = Recipe()
        try:
            merge(probe, parse_overrides([f"{key}={item}"]))
        # named by the key already, or by the key's wrong part (a section, a typo)
        except RecipeError as e:
            raise RecipeError(f"--sweep {e}" if str(e).startswith(key) else f"--sweep {key}: {e}") from None
        value = _get(probe, key)
        if value in values:
            raise RecipeError(f"--sweep {key}: the value {item!r} is given twice")
        values.append(value)
    return values


def _get(recipe: Recipe, dotted: str) -> Any:
    node: Any = recipe
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def expand(swept: list[tuple[str, list]]) -> list[Point]:
    """The Cartesian product of `swept` (key, values) in order, the last key varying fastest, each a
    named Point; names differ whenever values do (a clash after making them safe is told apart by a
    hash)."""
    keys = [key for key, _ in swept]
    points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in swept))]
    names = [point_name(p) for p in points]
    clashed = {n for n in names if names.count(n) > 1}
    return [Point(_hashed(name, p) if name in clashed else name, p) for name, p in zip(names, points,
                                                                                       strict=True)]


def points(specs: list[str]) -> list[Point]:
    """The points of `--sweep` options (see axes and expand): what a SLURM job array counts and
    indexes."""
    return expand(axes(specs))


def point_name(overrides: dict[str, Any]) -> str:
    """`{"optim.lr": 0.001, "run.seed": 1}` -> `optim.lr=0.001,run.seed=1`: every value written back
    exactly (a float as its shortest round-trip repr), what no filesystem takes replaced by `_`, and
    one too long for a directory cut and told apart by a hash."""
    # ASCII from here
    name = _UNSAFE.sub("_", ",".join(f"{k}={value_text(v)}" for k, v in overrides.items()))
    return _hashed(name[:MAX_NAME - 9], overrides) if len(name) > MAX_NAME else name


def value_text(value: Any) -> str:
    """A swept value as its point name and table write it: exactly (a float as its shortest
    round-trip repr), a bool as YAML writes it, a list as its items joined by `+`."""
    if isinstance(value, bool):
        return str(value).lower()  # as YAML writes it and an override takes it
    if isinstance(value, list):
        return "+".join(value_text(v) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def _hashed(name: str, overrides: dict[str, Any]) -> str:
    """`name` with 8 hex digits of the exact values: two points whose safe names are equal differ
    here."""
    digest = hashlib.sha256(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
    return f"{name}~{digest}"


def check_swept(points: list[Point], recipes: list[Recipe]) -> None:
    """Every point's resolved recipe runs the values the point is named by. A swept value that
    resolving replaced would train one network under several names, tabulated as if they differed: a
    key the starting checkpoint fixes (its architecture: checkpoints.complete fills the model in
    from it), or a size a named model.name fixes, is a RecipeError naming the key and what fixes
    it."""
    for point, recipe in zip(points, recipes, strict=True):
        for key, value in point.overrides.items():
            runs = _get(recipe, key)
            if runs == value:
                continue
            if recipe.init.checkpoint and not recipe.init.random and key.startswith("model."):
                by = f"the starting checkpoint {recipe.init.checkpoint} fixes it"
            elif key.startswith("model.") and recipe.model.name != "custom":
                by = f"model.name={recipe.model.name} fixes it"
            else:
                by = "resolving the recipe replaces it"
            raise RecipeError(f"--sweep {key}: {by} (point {point.name} would run {key}="
                              f"{value_text(runs)}); sweep a key the run may change")


def check_index(index: int | None, count: int) -> None:
    """`--sweep-point I` must name one of the `count` points (0-based, as SLURM_ARRAY_TASK_ID
    counts)."""
    if index is not None and not 0 <= index < count:
        raise RecipeError(f"--sweep-point {index}: the sweep has {count} point{'s' * (count != 1)}, "
                          f"numbered 0 to {count - 1}")
