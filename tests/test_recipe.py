"""Recipes: precedence, coercion, strictness, cross-field checks, and every shipped recipe resolving."""

from pathlib import Path

import pytest

from vitcli.errors import RecipeError
from vitcli.recipe import (
    accumulation_steps,
    load_recipe,
    parse_overrides,
    recipe_from_dict,
    to_dict,
    to_yaml,
)

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_defaults_then_file_then_overrides(tmp_path):
    p = write(tmp_path, "optim:\n  lr: 3.0e-3\n  weight_decay: 0.3\nschedule:\n  steps: 100\n  warmup_steps: 5\n")
    r = load_recipe(p, ["optim.lr=1e-4"])
    assert r.optim.lr == pytest.approx(1e-4)  # override beats file
    assert r.optim.weight_decay == pytest.approx(0.3)  # file beats default
    assert r.optim.beta2 == pytest.approx(0.999)  # default survives


def test_yaml_string_floats_are_coerced(tmp_path):
    # PyYAML reads 1e-3 (no dot) as the string "1e-3".
    p = write(tmp_path, "optim:\n  lr: 1e-3\nschedule:\n  steps: 1e4\n  warmup_steps: 10\n")
    r = load_recipe(p)
    assert isinstance(r.optim.lr, float) and r.optim.lr == pytest.approx(1e-3)
    assert r.schedule.steps == 10000 and isinstance(r.schedule.steps, int)


def test_list_override_from_comma_string():
    r = load_recipe(None, ["fewshot.shots=1,5,10", "schedule.steps=10", "schedule.warmup_steps=1"])
    assert r.fewshot.shots == [1, 5, 10]


def test_finetune_stage_defaults_are_the_paper_protocol():
    r = load_recipe(None, ["schedule.steps=1000"], stage="finetune")
    assert (r.optim.name, r.optim.momentum, r.optim.weight_decay, r.optim.clip_grad_norm) == ("sgd", 0.9, 0.0, 1.0)
    assert (r.data.batch_size, r.model.img_size, r.schedule.decay) == (512, 384, "cosine")


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("optim:\n  lrr: 0.1\n", "unknown recipe key 'optim.lrr'; did you mean 'optim.lr'?"),
        ("modle:\n  depth: 2\n", "unknown recipe key 'modle'; did you mean 'model'?"),
        ("data:\n  synthetic:\n    num_clases: 3\n", "'data.synthetic.num_clases'; did you mean 'data.synthetic.num_classes'"),
        ("data:\n  batch_size: lots\n", "data.batch_size: expected int, got 'lots'"),
        ("data:\n  hflip: maybe\n", "data.hflip: expected bool, got 'maybe'"),
        ("model:\n  pool: max\n", "model.pool: 'max' is not one of token, gap"),
        ("schedule:\n  steps: 10\n  warmup_steps: 10\n", "schedule.warmup_steps=10 must be smaller than schedule.steps=10"),
        ("model:\n  img_size: 30\n  patch_size: 4\n", "model.img_size=30 is not divisible by model.patch_size=4"),
        ("data:\n  batch_size: 100\n  micro_batch_size: 32\n", "data.batch_size=100 is not divisible"),
    ],
)
def test_bad_recipes_name_the_key(tmp_path, text, fragment):
    p = write(tmp_path, text + ("schedule:\n  steps: 100\n  warmup_steps: 1\n" if "schedule" not in text else ""))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_malformed_yaml_reports_line(tmp_path):
    p = write(tmp_path, "model:\n  depth: 2\n  heads: [1, 2\n")
    with pytest.raises(RecipeError, match=r"malformed YAML at line \d+"):
        load_recipe(p)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_bad_override_syntax():
    with pytest.raises(RecipeError, match="not KEY=VALUE"):
        parse_overrides(["optim.lr"])


def test_accumulation_steps():
    r = load_recipe(None, ["data.batch_size=4096", "data.micro_batch_size=64", "schedule.steps=10",
                           "schedule.warmup_steps=1"])
    assert accumulation_steps(r) == 64
    assert accumulation_steps(r, world_size=4) == 16


def test_round_trip_through_dict_and_yaml():
    import yaml

    r = load_recipe(None, ["optim.lr=0.02", "fewshot.tasks=a,b", "schedule.steps=10", "schedule.warmup_steps=1"])
    assert recipe_from_dict(to_dict(r)) == r
    assert recipe_from_dict(yaml.safe_load(to_yaml(r))) == r


@pytest.mark.parametrize("path", sorted(p.relative_to(REPO) for p in (REPO / "recipes").rglob("*.yaml")),
                         ids=str)
def test_every_shipped_recipe_resolves(path):
    """Each shipped recipe loads, passes the checks, and names a model the zoo knows (nothing is built)."""
    from vitcli.models import resolve_model

    text = (REPO / path).read_text()
    stage = "finetune" if "stage: finetune" in text else "pretrain"
    r = load_recipe(REPO / path, stage=stage)
    resolve_model(r.model)
    assert text.lstrip().startswith("#"), "a shipped recipe starts with a header: what, command, expected result"
