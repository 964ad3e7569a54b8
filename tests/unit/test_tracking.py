"""The recipe as MLflow parameters (dotted keys, MLflow's limits) and the tracking keys' checks."""

import dataclasses

import pytest

from vitcli.errors import RecipeError
from vitcli.recipe.checks import check_tracking
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import Recipe, RunConfig
from vitcli.runtime.trackers_mlflow import PARAM_CHARS, chunks, flat_params


def test_the_recipe_becomes_one_dotted_parameter_per_key():
    recipe = Recipe()
    params = flat_params(to_dict(recipe))
    assert params["optim.lr"] == str(recipe.optim.lr)
    assert params["data.synthetic.num_classes"] == str(recipe.data.synthetic.num_classes)
    assert params["run.loggers"] == '["jsonl"]'
    assert not any(isinstance(v, dict) for v in params.values())
    leaves = sum(1 for f in dataclasses.fields(recipe.optim))  # every optim key, none lost
    assert sum(1 for k in params if k.startswith("optim.")) == leaves


def test_a_value_past_mlflows_limit_is_cut_and_says_so():
    params = flat_params({"init": {"grid": "x" * (PARAM_CHARS + 10)}, "empty": {}})
    assert len(params["init.grid"]) == PARAM_CHARS and params["init.grid"].endswith("…")
    assert params["empty"] == "{}"  # an empty section is a value, not lost


def test_batches_hold_at_most_mlflows_count():
    assert [len(c) for c in chunks(list(range(2501)), 1000)] == [1000, 1000, 501]


def test_tracking_keys_are_checked():
    check_tracking(RunConfig(loggers=["jsonl", "mlflow"], mlflow_uri="http://127.0.0.1:5000"))
    check_tracking(RunConfig(loggers=["mlflow"], mlflow_uri="sqlite:///runs/mlflow.db"))
    check_tracking(RunConfig(mlflow_uri="http://127.0.0.1:5000"))  # kept while the trackers are off
    with pytest.raises(RecipeError, match=r"run.mlflow_uri: 'ht tp://x' is not a URI"):
        check_tracking(RunConfig(loggers=["mlflow"], mlflow_uri="ht tp://x"))
    with pytest.raises(RecipeError, match=r"run.experiment: 'a/b' names trackio's project"):
        check_tracking(RunConfig(loggers=["trackio"], experiment="a/b"))


@pytest.mark.parametrize("key,value", [("mlflow_uri", "http://x\ninjected"), ("mlflow_uri", " http://x"),
                                       ("experiment", "runs\r"), ("experiment", "a\tb")])
def test_a_tracking_value_with_a_control_character_is_refused_naming_the_key(key, value):
    """A shared recipe's value handed to MLflow or trackio: a newline or a tab is refused (as in
    run.ckpt_dir)."""
    with pytest.raises(RecipeError, match=rf"run.{key}: .* has a control character or surrounding spaces"):
        check_tracking(RunConfig(loggers=["mlflow"], **{key: value}))
