"""A recipe as text: YAML files read strictly (a key given twice is refused), `a.b=c` overrides,
each layer merged onto the dataclasses of schema.py with its values coerced to their declared types,
and the resolved recipe written back as YAML. A plain scalar is read as the text typed and its key's
declared type reads it (TextLoader): no YAML 1.1 base-60 (`1:00:00`), hex or octal, no `yes`/`on`
booleans. An unknown key names its dotted path and the closest valid one; a key vitcli removed says
why it went (REMOVED_KEYS)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from vitcli.errors import RecipeError
from vitcli.recipe.schema import Recipe

# ---------------------------------------------------------------- coercion

# YAML 1.1's other booleans: refused for a bool key (one meaning in every YAML reader), text for a
# str key
YAML11_BOOLS = ("yes", "no", "on", "off")
LINE_BREAKS = ("\n", "\r", "\x85", "\u2028", "\u2029")  # YAML 1.1's
YAML_FLOATS = {".inf": float("inf"), "+.inf": float("inf"), "-.inf": float("-inf"), ".nan": float("nan")}


def _coerce(value: Any, typ: Any, path: str) -> Any:
    """`value` as `typ`, or a RecipeError naming the dotted path, the type and the value."""
    origin = typing.get_origin(typ)
    if origin is types.UnionType:
        return _union(value, typing.get_args(typ), path)
    if origin is typing.Literal:  # a closed set (recipe.choices): the text, if it is one of them
        text, choices = _coerce(value, str, path), typing.get_args(typ)
        if text not in choices:
            raise RecipeError(f"{path}: {text!r} is not one of {', '.join(choices)}")
        return text
    if origin is list:
        return _list(value, typing.get_args(typ)[0], path)
    found = _SCALARS[typ](value, path) if typ in _SCALARS else _NOT
    if found is _NOT:
        hint = _sweep_hint(value, typ, path)
        raise RecipeError(f"{path}: expected {typ.__name__}, got {value!r}{hint}")
    return found


def _sweep_hint(value: Any, typ: Any, path: str) -> str:
    """For `optim.lr=1e-3,3e-3`, a number key given a list of them: what a sweep is written as."""
    listed = isinstance(value, str) and "," in value and typ in (int, float)
    return f" (several values are a sweep: --sweep {path}={value})" if listed else ""


_NOT = object()  # what a scalar reader returns for a value its type does not take


def _union(value: Any, options: tuple, path: str) -> Any:
    """`bool | str`: the first type that takes the value (true -> True, auto)."""
    if bool in options and str(value).lower() in YAML11_BOOLS:
        # `on` is no more the text `on` than a boolean: say why
        return _coerce(value, bool, path)
    for option in options:
        with contextlib.suppress(RecipeError):
            return _coerce(value, option, path)
    names = " or ".join(option.__name__ for option in options)
    raise RecipeError(f"{path}: expected {names}, got {value!r}")


def _list(value: Any, item_type: type, path: str) -> list:
    if isinstance(value, str):  # `shots=1,5,10` on the command line
        value = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):  # `--shots 5`
        value = [value]
    if not isinstance(value, list):
        raise RecipeError(f"{path}: expected a list of {item_type.__name__}, got {value!r}")
    return [_coerce(v, item_type, f"{path}[{i}]") for i, v in enumerate(value)]


def _bool(value: Any, path: str) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, str) and value.lower() in YAML11_BOOLS:
        raise RecipeError(f"{path}: write true or false, not {value!r} (YAML 1.1 reads it as a "
                          "boolean, YAML 1.2 as text; a recipe says true or false)")
    return _NOT


def _int(value: Any, path: str) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value, 10)  # decimal only, exact however many digits
    try:
        as_float = float(value)
        if as_float.is_integer() and not isinstance(value, bool):  # 1e4 -> 10000
            return int(as_float)
    except (TypeError, ValueError):
        pass
    return _NOT


def _float(value: Any, path: str) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value.lower() in YAML_FLOATS:  # what yaml.safe_dump writes
        return YAML_FLOATS[value.lower()]
    try:
        return float(value)
    except (TypeError, ValueError):
        return _NOT


def _str(value: Any, path: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `l2_reg: 1024` or a numeric split name
    return _NOT


_SCALARS = {bool: _bool, int: _int, float: _float, str: _str}


# keys vitcli once took, by dotted path -> the one line a recipe or override still giving one gets
# (exit 2): why the key went and what to do instead, rather than a "did you mean" guess at a
# neighbouring key
REMOVED_KEYS = {
    "data.decode_device": (
        "data.decode_device was removed: decoding JPEGs on the model's device (nvJPEG) trained a third "
        "slower than the loader workers on an H100 (2026-11-25); delete the key (the loader workers decode, "
        "resize and augment)"),
}


def merge(obj: Any, updates: dict, prefix: str = "") -> None:
    """Apply a nested dict of updates onto dataclass `obj` in place, coercing and rejecting unknown
    keys."""
    if not isinstance(updates, dict):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {updates!r}")
    hints = typing.get_type_hints(type(obj))
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in hints and path in REMOVED_KEYS:
            raise RecipeError(REMOVED_KEYS[path])
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(hints)}"
            raise RecipeError(f"unknown recipe key '{path}'{hint}")
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            merge(getattr(obj, key), value if value is not None else {}, f"{path}.")
        else:
            setattr(obj, key, _coerce(value, typ, path))


def literal_keys(cls: type, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """Every key of dataclass `cls` annotated with a Literal, by dotted path -> its choices in
    order."""
    found = {}
    for key, typ in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(typ):
            found.update(literal_keys(typ, f"{prefix}{key}."))
        elif typing.get_origin(typ) is typing.Literal:
            found[f"{prefix}{key}"] = typing.get_args(typ)
    return found


def nest(dotted: dict[str, Any]) -> dict:
    """`{"optim.lr": 1e-3, "data.batch_size": 64}` ->
    `{"optim": {"lr": 1e-3}, "data": {"batch_size": 64}}`."""
    nested: dict = {}
    for key, value in dotted.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"'{key}' conflicts with an earlier value of '{part}'")
        node[leaf] = value
    return nested


def flatten(nested: dict, prefix: str = "") -> dict:
    """The inverse of `nest`: `{"optim": {"lr": 1e-3}}` -> `{"optim.lr": 1e-3}`."""
    out = {}
    for key, value in nested.items():
        dotted = f"{prefix}{key}"
        out.update(flatten(value, f"{dotted}.") if isinstance(value, dict) else {dotted: value})
    return out


def parse_overrides(pairs: list[str]) -> dict:
    """Turn `["optim.lr=1e-3", "data.batch_size=64"]` into a nested dict; values read as a recipe
    file's are (load_text: `[1, 5]` a list, every scalar its text), their key's type coerces
    them."""
    dotted: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise RecipeError(f"override '{pair}' is not KEY=VALUE (for example optim.lr=1e-3)")
        # YAML would fold it into a blank: keep what was typed
        if any(brk in raw for brk in LINE_BREAKS):
            dotted[key] = raw
            continue
        try:
            dotted[key] = load_text(raw) if raw else ""
        except yaml.YAMLError:  # a control character among them: the value as typed, for the checks
            dotted[key] = raw
    return nest(dotted)


# Why a schema-directed reading and not a YAML 1.2 reader: YAML 1.1 (PyYAML) reads `slurm.time:
# 1:00:00` as the base-60 integer 3600 (sbatch then reads minutes: 60 hours), `init.grid: 0x4` as 4
# and `010` as 8; YAML 1.2's core schema drops base 60 but still reads `0x4` and `0o10` as integers,
# and would be a new dependency (ruamel.yaml). The key's declared type already says what a value is,
# so the loader resolves nothing but null from a plain scalar: every other scalar stays the text
# typed (quoted or not), and _coerce reads it as its key's type: decimal numbers (`1e-3` a float,
# `1e4` an int), `true`/`false` for a bool (yes, no, on and off are refused: YAML 1.1 and 1.2
# disagree on them), the text itself for a str. It is still SafeLoader, so safe_load's safety holds:
# explicit tags construct only what safe_load constructs. `~`/`null`/empty: a section left empty
_KEEP = ("tag:yaml.org,2002:null", "tag:yaml.org,2002:merge")


class _DuplicateKey(yaml.MarkedYAMLError):
    """A mapping that gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: PyYAML would keep the last
    silently."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """The mapping of `node`, once each explicit key in it is new (`<<` merges may repeat
        one)."""
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if key in first:
                raise _DuplicateKey(problem=f"'{key}' is given twice (first at line {first[key] + 1})",
                                    problem_mark=key_node.start_mark)
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class TextLoader(_StrictLoader):
    """_StrictLoader whose plain scalars are text (null aside): the recipe's types read them
    (_coerce)."""

    yaml_implicit_resolvers: typing.ClassVar[dict] = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag in _KEEP]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }


def load_text(text: str):
    """yaml.safe_load's result, with a key given twice refused and plain scalars left as text
    (TextLoader), run as safe_load runs its loader (safe_load takes no Loader, and a load with a
    Loader passed in is the call a safety review must read twice)."""
    loader = TextLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict:
    """Read a recipe file as safe_load does, its scalars as text (load_text); malformed YAML or a
    key given twice is a one-line error with the line number."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not a text file (not UTF-8), so not a YAML recipe") from None
    try:
        data = load_text(text)
    except _DuplicateKey as e:
        line = e.problem_mark.line + 1
        raise RecipeError(f"{path}: line {line}: {e.problem}; a recipe says each key once") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise RecipeError(f"{path}: malformed YAML at {where}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: malformed YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    return data


def to_dict(recipe: Recipe) -> dict:
    """Plain nested dict of the recipe, in declaration order."""
    return dataclasses.asdict(recipe)


def to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, the way `--dry-run` prints it and recipe.yaml stores it."""
    return yaml.safe_dump(to_dict(recipe), sort_keys=False, default_flow_style=False)
