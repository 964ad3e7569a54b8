"""A sweep's grid (recipe/grid.py): `--sweep KEY=V1,V2` values coerced as the recipe coerces an
override of the key, the points in product order with the last key fastest, names that are exact,
safe as directories and unique, and every mistake a one-line RecipeError naming the key."""

import itertools

import pytest

from vitcli.errors import RecipeError
from vitcli.recipe.grid import MAX_NAME, axes, check_index, check_swept, expand, point_name, points
from vitcli.recipe.layers import merge, parse_overrides
from vitcli.recipe.schema import Recipe


def test_values_take_the_keys_declared_types():
    swept = dict(axes(["optim.lr=1e-3,3e-3", "model.depth=1,2", "run.compile=true,auto",
                       "fewshot.shots=1,5", "data.val_split=train[98%:],validation"]))
    assert swept["optim.lr"] == [0.001, 0.003] and all(type(v) is float for v in swept["optim.lr"])
    assert swept["model.depth"] == [1, 2] and all(type(v) is int for v in swept["model.depth"])
    assert swept["run.compile"] == [True, "auto"]  # bool | str: as an override of it reads
    assert swept["fewshot.shots"] == [[1], [5]]  # a list key: one single-item list per point
    assert swept["data.val_split"] == ["train[98%:]", "validation"]


def test_a_value_is_what_the_same_override_would_set():
    """The sweep's coercion is the override's: for each value, the recipe that `KEY=VALUE` gives."""
    for spec in ["optim.lr=1e-3", "schedule.steps=1e4", "model.head_zero_init=false", "data.hflip=true"]:
        (key, (value,)), = axes([spec])
        direct = Recipe()
        merge(direct, parse_overrides([spec]))
        section, leaf = key.split(".")
        assert value == getattr(getattr(direct, section), leaf) and type(value) is type(
            getattr(getattr(direct, section), leaf)), spec


def test_points_are_the_product_in_the_order_given_the_last_key_fastest():
    found = points(["optim.lr=0.1,0.01", "run.seed=0,1,2"])
    expected = [{"optim.lr": lr, "run.seed": s} for lr, s in itertools.product([0.1, 0.01], [0, 1, 2])]
    assert [p.overrides for p in found] == expected
    assert [list(p.overrides) for p in found] == [["optim.lr", "run.seed"]] * 6  # keys in the order given
    assert [p.name for p in found][:2] == ["optim.lr=0.1,run.seed=0", "optim.lr=0.1,run.seed=1"]
    assert len({p.name for p in found}) == 6


def test_names_write_values_exactly():
    """Floats a `%g` would round alike get two names; bools as YAML writes them; lists joined by
    +."""
    assert point_name({"optim.lr": 0.1 + 0.2}) == "optim.lr=0.30000000000000004"
    assert point_name({"optim.lr": 1e-4}) == "optim.lr=0.0001"
    a, b = (p.name for p in points(["optim.lr=0.0012345671,0.0012345672"]))
    assert a != b and float(a.partition("=")[2]) == 0.0012345671
    assert point_name({"data.hflip": False, "fewshot.shots": [1, 5]}) == "data.hflip=false,fewshot.shots=1+5"


def test_names_are_safe_directories_and_unique_after_being_made_safe():
    found = points(["data.val_split=train[:10%],train(:10%)"])
    assert all(set(p.name) <= set("abcdefghijklmnopqrstuvwxyz0123456789._,=+-_~") for p in found)
    assert found[0].name != found[1].name  # both `train__10__` once made safe: a hash tells them apart
    assert all(p.name.startswith("data.val_split=train__10__~") for p in found)
    assert [p.overrides["data.val_split"] for p in found] == ["train[:10%]", "train(:10%)"]  # values intact


def test_a_long_name_is_cut_and_told_apart_by_a_hash():
    long = ["init.checkpoint=" + "a" * 200 + "1", "init.checkpoint=" + "a" * 200 + "2"]
    first, second = (points([spec])[0].name for spec in long)
    assert len(first) <= MAX_NAME and len(second) <= MAX_NAME and first != second
    assert first.startswith("init.checkpoint=aaaa")


def test_expand_takes_values_already_typed():
    """What --lr-sweep hands over: the rates it parsed."""
    assert [p.name for p in expand([("optim.lr", [0.003, 0.01])])] == ["optim.lr=0.003", "optim.lr=0.01"]


@pytest.mark.parametrize("specs, says", [
    (["optim.lrr=0.1"], "--sweep optim.lrr: unknown recipe key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["model.depth=1,two"], "--sweep model.depth: expected int, got 'two'"),
    (["optim.lr=0.1,fast"], "--sweep optim.lr: expected float, got 'fast'"),
    (["run.seed=0,1", "run.seed=2"], "--sweep run.seed: given twice"),
    (["optim.lr=0.1,1e-1"], "--sweep optim.lr: the value '1e-1' is given twice"),
    (["run.seed="], "--sweep run.seed: no values"),
    (["run.seed"], "is not KEY=V1,V2,..."),
    (["=1,2"], "is not KEY=V1,V2,..."),
    (["optim=1,2"], "--sweep optim: expected a mapping"),
    (["stage=pretrain,finetune"], "--sweep stage: cannot be swept"),
    (["run.device=cpu,cuda"], "--sweep run.device: cannot be swept"),
])
def test_a_mistake_is_one_line_naming_the_key(specs, says):
    with pytest.raises(RecipeError) as e:
        points(specs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_point_index_is_0_based_like_slurm_array_task_ids():
    check_index(None, 3)
    check_index(0, 3)
    check_index(2, 3)
    for bad in (3, -1):
        with pytest.raises(RecipeError, match=rf"--sweep-point {bad}: the sweep has 3 points, numbered 0 to"):
            check_index(bad, 3)


def resolved_as(point, **sections) -> Recipe:
    """The recipe a point would run: its overrides, then `sections` (what resolution put on top)."""
    recipe = Recipe()
    merge(recipe, parse_overrides([f"{k}={v}" for k, v in point.overrides.items()]))
    merge(recipe, sections)
    return recipe


def test_a_swept_value_the_resolution_replaced_is_refused_naming_the_key_and_what_fixed_it():
    depth = points(["model.depth=1,3"])
    check_swept(depth, [resolved_as(p) for p in depth])  # each runs its own value
    fixed = [resolved_as(p, init={"checkpoint": "runs/pre"}, model={"depth": 1}) for p in depth]
    with pytest.raises(RecipeError) as e:
        check_swept(depth, fixed)
    assert str(e.value) == ("--sweep model.depth: the starting checkpoint runs/pre fixes it (point "
                            "model.depth=3 would run model.depth=1); sweep a key the run may "
                            "change")
    named = [resolved_as(p, model={"name": "ViT-Ti/16", "depth": 12}) for p in depth]
    fixes = r"--sweep model.depth: model.name=ViT-Ti/16 fixes it \(point model.depth=1 would run "
    with pytest.raises(RecipeError, match=fixes + r"model.depth=12\)"):
        check_swept(depth, named)
