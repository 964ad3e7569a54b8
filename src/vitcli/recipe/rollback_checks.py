"""The keys of a rollback past a loss spike (train/rollback.py), checked at resolve time: the spike
rule's run.spike_factor and run.spike_window, run.max_rollbacks, and data.skip_steps, the skips a
run is given up front, read here into windows of steps."""

from __future__ import annotations

import itertools
import math
import re

from vitcli.errors import RecipeError
from vitcli.recipe.schema import Recipe

SKIP_KEY = "data.skip_steps"
_WINDOW = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")

# (first, last) steps, inclusive, as metrics.jsonl numbers steps (the first is 1)
Window = tuple[int, int]


def skip_windows(texts: list, key: str = SKIP_KEY) -> tuple[Window, ...]:
    """"A-B" or "A" entries -> their windows, sorted; a malformed, empty or reversed entry, or two
    that share a step, is a RecipeError naming `key`."""
    windows = []
    for text in texts:
        found = _WINDOW.fullmatch(str(text))
        first, last = (int(found[1]), int(found[2] or found[1])) if found else (0, 0)
        if not found or not 1 <= first <= last:
            raise RecipeError(f"{key}: cannot read {text!r}; give windows of steps as \"A-B\" "
                              "(steps A to B, 1 <= A <= B) or \"A\" (one step)")
        windows.append((first, last))
    windows.sort()
    for (a, b), (c, d) in itertools.pairwise(windows):
        if c <= b:
            raise RecipeError(f"{key}: the windows {a}-{b} and {c}-{d} overlap; give each step "
                              "once (merge them into one window)")
    return tuple(windows)


def check_rollback(recipe: Recipe) -> None:
    """The rollback keys' values, each refused in one line naming it."""
    run = recipe.run
    skip_windows(recipe.data.skip_steps)
    factor = run.spike_factor
    if not math.isfinite(factor) or not (factor == 0 or factor > 1):
        raise RecipeError(f"run.spike_factor: {factor} is neither 0 (only a non-finite loss is a "
                          "spike) nor above 1 (a loss above that many times the recent median is "
                          "one); try 3")
    if run.spike_window < 1:
        raise RecipeError(f"run.spike_window: {run.spike_window} must be positive (the losses "
                          "whose median a spike is measured against)")
    if run.max_rollbacks < 0:
        raise RecipeError(f"run.max_rollbacks: {run.max_rollbacks} must be >= 0 (0: stop at the "
                          "first spike)")
