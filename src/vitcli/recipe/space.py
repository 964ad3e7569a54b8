"""A search's space: `--search KEY=DIST` options -> the distributions each trial draws its values
from. Pure and torch-free, like recipe/grid.py beside it: the CLI checks the space (and resolves
the recipe at its corners) before anything is written; stages/search.py hands each Dist to Optuna.

A DIST is one of
  log:LO:HI   drawn log-uniformly in [LO, HI] (a learning rate: each decade as likely)
  LO:HI       drawn uniformly in [LO, HI]; an int key draws ints, a float key floats
  V1,V2,...   one of the values listed (categorical), each read as `KEY=V` on the command line
and its values are coerced to the key's declared type as an override is (layers.merge), so
`optim.lr=log:1e-4:3e-3` holds floats, not the strings PyYAML makes of `1e-4`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vitcli.errors import RecipeError
from vitcli.recipe.grid import FIXED
from vitcli.recipe.layers import merge, parse_overrides
from vitcli.recipe.schema import Recipe, SearchConfig

# what Optuna stores of a categorical value (optuna.distributions.CategoricalChoiceType)
_CHOICE_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Dist:
    """One searched key: a range [low, high] (log-uniform with `log`; ints for an int key), or
    `choices`, the values listed."""

    key: str
    low: Any = None
    high: Any = None
    log: bool = False
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        """This key's value in an Optuna trial (the one it already holds, for a trial resumed)."""
        if self.choices:
            return trial.suggest_categorical(self.key, list(self.choices))
        if isinstance(self.low, int):
            return trial.suggest_int(self.key, self.low, self.high, log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, log=self.log)

    def corners(self) -> list:
        """The values whose recipes are checked before the first trial: both ends of a range, or
        every value listed."""
        return list(self.choices) if self.choices else [self.low, self.high]

    def text(self) -> str:
        """The DIST as given, normalised (floats exact): what a resumed search must be asked again."""
        if self.choices:
            return ",".join(repr(v) for v in self.choices)
        return f"{'log:' * self.log}{self.low!r}:{self.high!r}"


@dataclass(frozen=True)
class Search:
    """A search resolved by the CLI: its space, how many trials, `resolve` (a trial's values -> its
    checked recipe, as the command with those values as overrides would resolve it), the seed its
    proposals are drawn with (the recipe's run.seed), the recipe's `search` section, and `task`,
    the one trial slot a SLURM array task runs (`--search-task`; None: every trial in turn)."""

    dists: list[Dist]
    trials: int
    resolve: Callable[[dict], Recipe]
    seed: int
    config: SearchConfig
    task: int | None = None

    def texts(self) -> list[str]:
        """The space as KEY=DIST, normalised: a journal's study remembers it."""
        return [f"{d.key}={d.text()}" for d in self.dists]


def slot_name(k: int) -> str:
    """Trial slot k's directory below the search's workdir: `trial-007` (stages/search.py: why slots,
    not values)."""
    return f"trial-{k:03d}"


def space(specs: list[str]) -> list[Dist]:
    """`["optim.lr=log:1e-4:3e-3", "data.mixup_alpha=0,0.2"]` -> their Dists, in order; a spec that
    is not KEY=DIST, an unknown key, a value of the wrong type, a range on a key that is not a
    number, LO >= HI, a log range from 0 or below, a key given twice: a RecipeError naming it."""
    found: dict[str, Dist] = {}
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise RecipeError(f"--search {spec!r} is not KEY=DIST (log:LO:HI, LO:HI or V1,V2,...; "
                              "e.g. optim.lr=log:1e-4:3e-3)")
        if key in found:
            raise RecipeError(f"--search {key}: given twice; give one DIST per key")
        if key in FIXED:
            raise RecipeError(f"--search {key}: cannot be searched ({FIXED[key]})")
        found[key] = dist(key, raw)
    return list(found.values())


def dist(key: str, raw: str) -> Dist:
    """One key's DIST (see the module docstring)."""
    if "," in raw:
        return _choices(key, raw)
    log = raw.startswith("log:")
    bounds = raw.removeprefix("log:").split(":")
    if len(bounds) != 2:
        raise RecipeError(f"--search {key}={raw}: not a DIST; give log:LO:HI, LO:HI or V1,V2,... "
                          f"(one value alone is an override: {key}={raw})")
    low, high = (coerce(key, b.strip()) for b in bounds)
    if isinstance(low, bool) or not isinstance(low, int | float):
        raise RecipeError(f"--search {key}={raw}: a range needs a number key ({key} holds "
                          f"{type(low).__name__}); list its values instead: {key}=V1,V2")
    if not low < high:
        raise RecipeError(f"--search {key}={raw}: LO must be below HI")
    if log and low <= 0:
        raise RecipeError(f"--search {key}={raw}: a log range must start above 0")
    return Dist(key, low, high, log)


def _choices(key: str, raw: str) -> Dist:
    values = []
    for item in (v.strip() for v in raw.split(",")):
        value = coerce(key, item)
        if not isinstance(value, _CHOICE_TYPES):
            raise RecipeError(f"--search {key}: a {type(value).__name__} key cannot be searched (its "
                              "values are not one number or string each); sweep it with --sweep")
        if value in values:
            raise RecipeError(f"--search {key}: the value {item!r} is given twice")
        values.append(value)
    return Dist(key, choices=tuple(values))


def coerce(key: str, text: str) -> Any:
    """`text` as the recipe reads `KEY=text`: the key's declared type; a RecipeError naming the key
    otherwise."""
    if not text:
        raise RecipeError(f"--search {key}: an empty value")
    probe = Recipe()
    try:
        merge(probe, parse_overrides([f"{key}={text}"]))
    except RecipeError as e:  # named by the key already, or by its wrong part (a section, a typo)
        raise RecipeError(f"--search {e}" if str(e).startswith(key) else f"--search {key}: {e}") from None
    node: Any = probe
    for part in key.split("."):
        node = getattr(node, part)
    return node


def corner_points(dists: list[Dist]) -> list[dict[str, Any]]:
    """The settings checked before any trial: each Dist at each of its corners, the others at their
    first; every value a trial may hold is then one its key's checks accepted at an end."""
    first = {d.key: d.corners()[0] for d in dists}
    return [{**first, d.key: v} for d in dists for v in d.corners()]
