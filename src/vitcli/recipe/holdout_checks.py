"""data.holdout at resolve time: what a recipe that holds rows out must say (a split that reads
them, choices.HOLDOUT, used whole; labels to balance them by; random access to draw them).

vitcli.data.rows.holdout draws the rows when the train split is loaded."""

from __future__ import annotations

from vitcli.errors import RecipeError
from vitcli.recipe.choices import HOLDOUT
from vitcli.recipe.data_checks import split_names
from vitcli.recipe.schema import DataConfig


def check_holdout(d: DataConfig, training: bool = True) -> None:
    """A RecipeError naming the key unless data.holdout and the split `holdout` go together. Not
    `training` (evaluate, predict): a run's recipe gives them data.val_split but not data.holdout,
    so without it `holdout` is read from the source like any split name (and is missing there)."""
    if not 0 <= d.holdout < 1:
        raise RecipeError(f"data.holdout must be in [0, 1), a fraction of data.train_split; got "
                          f"{d.holdout}")
    readers = [f"data.{role}" for role in ("val_split", "test_split")
               if getattr(d, role) == HOLDOUT]
    for role in ("train_split", "val_split", "test_split"):
        spec = getattr(d, role)
        if spec and HOLDOUT in split_names(spec) and (spec != HOLDOUT or role == "train_split"):
            raise RecipeError(f"data.{role}='{spec}': '{HOLDOUT}' names the rows data.holdout "
                              "keeps out of training, whole: set data.val_split=holdout (or "
                              "data.test_split)")
    if not d.holdout:
        if readers and training:
            raise RecipeError(f"{readers[0]}=holdout reads the rows data.holdout holds out of "
                              "data.train_split, but data.holdout is 0; set it, e.g. "
                              "data.holdout=0.01")
        return
    if not readers:
        raise RecipeError(f"data.holdout={d.holdout} keeps rows out of training that nothing "
                          "reads; set data.val_split=holdout (or data.test_split), or "
                          "data.holdout=0")
    if not d.label_column:
        raise RecipeError(f"data.holdout={d.holdout} holds out the same share of each class, which "
                          "needs labels: set data.label_column, or data.holdout=0")
    if d.streaming:
        raise RecipeError(f"data.holdout={d.holdout} draws rows from the whole train split, which "
                          "data.streaming reads once in order; set data.streaming=false (a tar "
                          "source: train from a parquet copy, vit prepare-data), or data.holdout=0")
