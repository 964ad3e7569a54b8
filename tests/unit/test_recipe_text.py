"""Recipe values are read as typed: a scalar is the text written, and its key's declared type reads
it, in a recipe file and in a KEY=VALUE override alike (no YAML 1.1 base 60, hex, octal or yes/on
booleans)."""

import re

import pytest

from vitcli.errors import RecipeError
from vitcli.recipe.checks import CHOICES
from vitcli.recipe.choices import POOLS, PRECISIONS, VIT_POS_EMBEDS
from vitcli.recipe.layers import literal_keys, merge, parse_overrides, read_yaml
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import Recipe

SHORT = ["schedule.steps=10", "schedule.warmup_steps=1"]


def from_file(tmp_path, dotted: str, text: str) -> Recipe:
    """A recipe holding `dotted: text` read from a file, as a plain YAML scalar."""
    section, key = dotted.rsplit(".", 1)
    lines, indent = [], ""
    for part in section.split("."):
        lines.append(f"{indent}{part}:")
        indent += "  "
    path = tmp_path / "r.yaml"
    path.write_text("\n".join([*lines, f"{indent}{key}: {text}", ""]))
    recipe = Recipe()
    merge(recipe, read_yaml(path))
    return recipe


def from_override(dotted: str, text: str) -> Recipe:
    recipe = Recipe()
    merge(recipe, parse_overrides([f"{dotted}={text}"]))
    return recipe


def value(recipe: Recipe, dotted: str):
    node = recipe
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


READ = [  # (key, as typed, the value its type gives); YAML 1.1 would read the second column otherwise
    ("slurm.time", "1:00:00", "1:00:00"),  # YAML 1.1: the base-60 integer 3600
    ("slurm.time", "1:00", "1:00"),  # 60
    ("init.grid", "0x4", "0x4"),  # 4
    ("data.train_split", "010", "010"),  # 8
    ("data.train_split", "0o10", "0o10"),  # YAML 1.2: 8
    ("data.val_split", "yes", "yes"),  # True, so "True"
    ("data.test_split", "off", "off"),  # False
    ("data.source", "2026-01-02", "2026-01-02"),  # a date, refused for a str key
    ("data.source", "1e3", "1e3"),  # 1000.0 in YAML 1.2
    ("model.depth", "010", 10),  # 8
    ("schedule.steps", "1e4", 10_000),
    ("optim.lr", "1e-3", 1e-3),  # a string in YAML 1.1: the float its key wants
    ("optim.lr", "3.0e-4", 3e-4),
    ("data.hflip", "false", False),
    ("data.hflip", "True", True),
    ("run.compile", "true", True),
    ("run.compile", "auto", "auto"),
    ("data.micro_batch_size", "64", 64),
    ("data.micro_batch_size", "auto", "auto"),
    ("fewshot.shots", "[1, 5]", [1, 5]),
    ("data.mean", "[0.5, 0.25, 1e-1]", [0.5, 0.25, 0.1]),
    ("model.dropout", ".inf", float("inf")),  # what yaml.safe_dump writes: a saved recipe reads back
]


@pytest.mark.parametrize("key, typed, expected", READ)
def test_a_value_is_its_keys_type_reading_of_the_text_typed_in_a_file_and_an_override(tmp_path, key,
                                                                                      typed, expected):
    for recipe in (from_file(tmp_path, key, typed), from_override(key, typed)):
        got = value(recipe, key)
        assert got == expected and type(got) is type(expected), (key, typed, got)


@pytest.mark.parametrize("typed", ["yes", "no", "on", "OFF"])
@pytest.mark.parametrize("key", ["data.hflip", "run.compile"])  # a bool, and a bool | str
def test_yaml_11_booleans_for_a_bool_key_are_refused_naming_the_key(tmp_path, key, typed):
    for read in (lambda: from_file(tmp_path, key, typed), lambda: from_override(key, typed)):
        with pytest.raises(RecipeError, match=re.escape(f"{key}: write true or false, not '{typed}'")):
            read()


@pytest.mark.parametrize("key, typed", [("model.depth", "0x10"), ("schedule.steps", "1:00"),
                                        ("optim.lr", "0x1p-3")])
def test_hex_and_base_60_numbers_are_not_numbers(tmp_path, key, typed):
    for read in (lambda: from_file(tmp_path, key, typed), lambda: from_override(key, typed)):
        with pytest.raises(RecipeError, match=re.escape(f"{key}: expected")):
            read()


def test_quoted_and_plain_text_read_alike_and_null_still_empties_a_section(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("slurm:\n  time: '1:00:00'\n  partition: 0x4\nmodel:\n")
    assert read_yaml(path) == {"slurm": {"time": "1:00:00", "partition": "0x4"}, "model": None}


def test_a_one_hour_time_limit_is_one_hour_and_a_one_minute_one_is_shorter_than_the_warning():
    assert resolve("pretrain", None, [*SHORT, "slurm.time=1:00:00"]).slurm.time == "1:00:00"
    inside = r"slurm\.signal_seconds=90 is not inside slurm\.time=1:00 \(60 s\)"
    with pytest.raises(RecipeError, match=inside):
        resolve("pretrain", None, [*SHORT, "slurm.time=1:00"])


def test_a_hex_grid_is_refused_as_typed():
    with pytest.raises(RecipeError, match=re.escape("init.grid='0x4': expected HxW")):
        resolve("pretrain", None, [*SHORT, "init.grid=0x4"])


def test_a_closed_set_key_is_refused_while_reading_with_its_choices_from_its_annotation(tmp_path):
    refused = re.escape("model.pool: 'avg' is not one of token, gap, gap_fc_norm")
    for read in (lambda: from_file(tmp_path, "model.pool", "avg"),
                 lambda: from_override("model.pool", "avg")):
        with pytest.raises(RecipeError, match=refused):
            read()
    assert from_override("run.strategy", "fsdp").run.strategy == "fsdp"


def test_every_closed_set_is_one_literal_its_default_among_its_choices():
    choices = literal_keys(Recipe)
    assert choices["model.pool"] == POOLS and choices["run.precision"] == PRECISIONS
    assert choices["model.pos_embed"] == (*VIT_POS_EMBEDS, "sincos_1d")
    assert CHOICES == choices
    for key, allowed in choices.items():
        assert value(Recipe(), key) in allowed, key
