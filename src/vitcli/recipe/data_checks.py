"""Checks of the data keys that need no data: the source named, the built-in data's sizes and
splits, what a stream can read, a RandAugment spec, a batch larger than a split whose size the
recipe already gives.

What only the data can say (a missing file, a column, the labels) is checked when the split is
loaded, which the run does before it writes anything into its workdir.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from vitcli.errors import DataError, RecipeError
from vitcli.recipe.choices import HOLDOUT, LABEL_RULES, SYNTHETIC_MAX_CLASSES, TRAINS
from vitcli.recipe.schema import DataConfig, Recipe

# timm's RandAugment config sections (timm.data.auto_augment.rand_augment_transform): a key, then a
# number. timm refuses an unknown key (`rand-mag9`) only when it builds the transform, in the run,
# and skips a section without a number (`rand-m`) silently; we refuse both at resolve time.
# tests/unit/test_recipe.py holds this grammar against timm's own parser.
IMAGENET_MEAN, IMAGENET_STD = "0.485,0.456,0.406", "0.229,0.224,0.225"  # as the messages spell them
RANDAUGMENT_SECTION = re.compile(r"(mstd|mmax|inc|m|n|p)\d[\d.]*")
# data/rows/prepare.py writes them
PREPARED_MANIFEST, PREPARED_KIND = "manifest.json", "vitcli prepare-data"
# HF's split directory names (datasets.data_files.SPLIT_KEYWORDS) and the characters its patterns
# allow around one (NON_WORDS_CHARS), kept here so that the split keys are checked without importing
# datasets; tests/unit/test_split_check.py holds them against the installed release
SPLIT_DIRS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
              "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"
_KEYWORDS = "|".join(sorted((w for ws in SPLIT_DIRS.values() for w in ws), key=len, reverse=True))
# HF's **/val[-._ 0-9]*/** and kin
NAMES_A_SPLIT = re.compile(rf"(?:^|{_SEP})(?:{_KEYWORDS})(?:{_SEP}|$)")
# files at a folder's root that make HF read it otherwise: a dataset card (its configs may name
# splits)
_ROOT_CARDS = ("README.md", ".huggingface.yaml", "dataset_infos.json")


def check_randaugment(spec: str, name: str = "data.randaugment") -> None:
    """A DataError naming `name` unless `spec` is `rand` followed by sections timm understands."""
    head, *sections = spec.split("-")
    bad = [s for s in sections if not RANDAUGMENT_SECTION.fullmatch(s)]
    if head != "rand" or bad:
        culprit = f"section '{bad[0]}'" if head == "rand" else f"'{head}' (must start with rand)"
        raise DataError(f"{name}: cannot parse '{spec}': {culprit}; use a timm spec like rand-m9-mstd0.5 "
                        "(sections m, n, mstd, mmax, inc, p, each with a number)")


def check_data(recipe: Recipe) -> None:
    """The source, the built-in data's splits and sizes, and what streaming can read."""
    d = recipe.data
    check_normalisation(d.mean, d.std)
    if not d.source.strip():
        raise RecipeError("data.source is empty: name a dataset (a Hub id, a save_to_disk directory, parquet "
                          "or arrow files, an image folder), or 'synthetic' for the built-in data")
    if d.label_rule and d.label_rule not in LABEL_RULES:
        raise DataError(f"data.label_rule '{d.label_rule}' is not one of {', '.join(LABEL_RULES)}")
    if d.source == "synthetic":
        _synthetic(d)
    if recipe.stage in TRAINS and not d.streaming and names_tar_shards(d.source):
        # the resolve step streams a tar source (recipe.resolve); this is a user's explicit false
        raise DataError(f"data.streaming=false: {d.source} is WebDataset tar shards, which train as a stream "
                        "(loaded whole, HF would first copy every image into its cache); drop "
                        "data.streaming=false, or train map-style from a parquet copy (vit prepare-data)")
    if d.streaming:
        check_stream(d)


def check_normalisation(mean: list[float], std: list[float]) -> None:
    """data.mean and data.std: one value per RGB channel, a mean in [0, 1] (of x / 255) and a
    positive std."""
    for key, values, imagenet in (("data.mean", mean, IMAGENET_MEAN), ("data.std", std, IMAGENET_STD)):
        if len(values) != 3:
            raise RecipeError(f"{key}: {len(values)} values {values}; give one per RGB channel, as "
                              f"{key}={imagenet}")
    if not all(0 <= m <= 1 for m in mean):
        raise RecipeError(f"data.mean: {mean} is not in [0, 1]; it is the mean of x / 255 (ImageNet's "
                          f"{IMAGENET_MEAN}; 0.5,0.5,0.5 with std 0.5,0.5,0.5: the ViT paper's [-1, 1])")
    if not all(s > 0 for s in std):
        raise RecipeError(f"data.std: {std} must be positive (ImageNet's {IMAGENET_STD})")


def names_tar_shards(source: str) -> bool:
    """Whether data.source names WebDataset tar shards: a .tar file, or a glob or brace pattern of
    them (`/d/train-{000000..000146}.tar`), or a folder with .tar files in it (a `vit prepare-data
    --shards tar` copy among them). Decided from the name and at most one directory listing, no file
    read, so the recipe can say before the run that such a source streams."""
    if source.endswith(".tar"):
        return True
    path = Path(source).expanduser()
    try:
        with os.scandir(path) as entries:
            return any(e.name.endswith(".tar") and e.is_file() for e in entries)
    except OSError:  # not a folder, or not one we may list: whatever it is, loading it will say
        return False


def check_train_batch(recipe: Recipe) -> None:
    """A training step needs a whole batch: known now for a plain split of the built-in data; any
    other split is counted when loaded (vitcli.run.build.build_job), still before the run writes a
    file."""
    d, sizes = recipe.data, _synthetic_sizes(recipe.data)
    if recipe.stage in TRAINS and d.source == "synthetic" and d.train_split in sizes:
        key, size = sizes[d.train_split]
        check_batch_fits(size, d.batch_size, f"data.synthetic.{key}")


def split_names(split: str) -> list[str]:
    """Base split names in an HF split spec: `train[:98%]+test` -> [train, test]."""
    return [part.split("[")[0].strip() for part in split.split("+")]


def _synthetic_sizes(d: DataConfig) -> dict[str, tuple[str, int]]:
    """Split of the built-in data -> (its data.synthetic size key, its size)."""
    s = d.synthetic
    return {"train": ("train_size", s.train_size), "validation": ("val_size", s.val_size),
            "test": ("test_size", s.test_size)}


def _synthetic(d: DataConfig) -> None:
    """The built-in data: what it can draw, and splits the recipe reads that exist and hold
    images."""
    s = d.synthetic
    if not 2 <= s.num_classes <= SYNTHETIC_MAX_CLASSES:
        raise DataError(f"data.synthetic.num_classes={s.num_classes} must be between 2 and "
                        f"{SYNTHETIC_MAX_CLASSES}")
    if s.img_size < 8:
        raise DataError(f"data.synthetic.img_size={s.img_size} is too small to draw shapes; use >= 8")
    sizes = _synthetic_sizes(d)
    for role in ("train_split", "val_split", "test_split"):
        for name in split_names(getattr(d, role)) if getattr(d, role) else []:
            if name == HOLDOUT:  # data.holdout's rows (holdout_checks), or missing when read
                continue
            if name not in sizes:
                raise DataError(f"data.{role}='{getattr(d, role)}': synthetic: no split '{name}'; "
                                f"available: {', '.join(sizes)}; name one of those{_way_out(role)}")
            if not sizes[name][1]:
                key = f"data.synthetic.{sizes[name][0]}"
                raise RecipeError(f"{key}=0 leaves split '{name}' (data.{role}) empty; give it images")


def check_batch_fits(rows: int, batch_size: int, where: str) -> None:
    """One optimizer step must find a whole batch in the train split."""
    if rows < batch_size:
        raise RecipeError(f"data.batch_size={batch_size} is larger than the train split ({rows} images, "
                          f"{where}); lower data.batch_size")


def check_stream(d: DataConfig) -> None:
    """A stream reads a whole split once, in order of its shards: no slices, nothing that needs the
    split."""
    split = d.train_split
    # a tar source cannot be read map-style: its way out is a parquet copy
    instead = ("train from a parquet copy (vit prepare-data)" if names_tar_shards(d.source)
               else "set data.streaming=false")
    if "[" in split or "+" in split:
        raise DataError(f"data.train_split='{split}': slices and '+' need random access, which "
                        f"data.streaming=true has not; give a whole split such as 'train', or {instead}")
    if d.label_rule:
        raise DataError(f"data.label_rule '{d.label_rule}' needs the whole split; {instead}")
    # its copies of a row go to other micro-batches, other processes: random access
    if d.repeated_aug > 1:
        raise DataError(f"data.repeated_aug={d.repeated_aug} deals each image's copies across the global "
                        "batch, which a stream each process reads on its own cannot; set data.repeated_aug=1 "
                        f"or {instead}")


# --- the splits the recipe names, against those the data has, where a look costs next to nothing
# ---------

# what a split key's value "" does, for the messages (train_split has no such way out)
SKIPS = {"val_split": "skips the evaluations while training", "test_split": "skips the final evaluation"}


def check_splits(recipe: Recipe) -> None:
    """A training stage's data.train_split, val_split and test_split name splits its source has,
    where that is known cheaply (source_splits): refused at resolve time, in --dry-run, rather than
    once the run has started and loads them. The built-in data's are _synthetic's; a Hub id's and
    any folder HF infers are left to the load."""
    d = recipe.data
    if recipe.stage not in TRAINS or d.source == "synthetic":
        return
    splits = source_splits(d.source)
    if splits is None:
        return
    for role in ("train_split", "val_split", "test_split"):
        value = getattr(d, role)
        # holdout_checks
        names = [name for name in split_names(value) if name != HOLDOUT] if value else []
        missing = [name for name in names if name not in splits]
        if missing:
            raise DataError(f"data.{role}='{value}': {d.source} has no split '{missing[0]}' (it has "
                            f"{', '.join(splits)}); name one of those{_way_out(role)}")


def _way_out(role: str) -> str:
    return f", or data.{role}=\"\" {SKIPS[role]}" if role in SKIPS else ""


def source_splits(source: str) -> list[str] | None:
    """The splits of a local source, from at most a small JSON file or a few directory listings: a
    `vit prepare-data` copy's (its manifest), a save_to_disk directory's, a file or pattern's
    (`train`), a folder of split directories' (split_dirs); None where that would take more (a Hub
    id, a folder of tar shards or one HF infers the layout of, a path that is not there: loading it
    says)."""
    path = Path(source).expanduser()
    if any(c in source for c in "*?[{") or path.is_file():
        return ["train"]  # files and patterns are one split (vitcli.data.rows.sources)
    if not path.is_dir():
        return None
    for name, key in ((PREPARED_MANIFEST, "splits"), ("dataset_dict.json", "splits")):
        listed = json_object(path / name)
        if name == PREPARED_MANIFEST and listed.get("kind") != PREPARED_KIND:
            continue
        if isinstance(listed.get(key), (dict, list)):
            return [str(split) for split in listed[key]]
    if (path / "state.json").is_file():
        return ["train"]  # a lone saved Dataset
    return None if names_tar_shards(source) else split_dirs(path)


def json_object(path: Path) -> dict:
    """The JSON object in `path`; {} when it is not there, not JSON or not an object."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def split_dirs(root: Path) -> list[str] | None:
    """A folder laid out as split directories (ImageNet's train/ and val/): every visible directory
    at its root one HF reads as a split (SPLIT_DIRS; val/ is `validation`), one per split, no
    directory in them and no file at the root that HF would read as another split or layout (its
    split patterns are directories': `**/val[-._ 0-9]*/**`). Their splits in HF's order;
    None for any other folder (a class folder's one split `train` is the folder index's to say: a
    file named like a split anywhere in it makes HF read another)."""
    entries = _visible(root)
    dirs = {name for name, is_dir in entries if is_dir}
    files = [name for name, is_dir in entries if not is_dir]
    of = {word: split for split, words in SPLIT_DIRS.items() for word in words}
    splits = {of.get(name) for name in dirs}
    if not dirs or None in splits or len(splits) < len(dirs) or _other_layout(files):
        return None
    for name in dirs:
        if any(NAMES_A_SPLIT.search(inner) for inner, is_dir in _visible(root / name) if is_dir):
            return None  # HF's **/val[-._ 0-9]*/** would make a split of that too
    return [split for split in SPLIT_DIRS if split in splits]


def _visible(folder: Path) -> list[tuple[str, bool]]:
    """(name, is a directory) of the entries HF's glob sees: not hidden, not __special__."""
    try:
        with os.scandir(folder) as it:
            return [(e.name, e.is_dir()) for e in it if not e.name.startswith((".", "__"))]
    except OSError:
        return []


def _other_layout(files: list[str]) -> bool:
    """Root files that make HF read a folder as something else than its split directories: a card, a
    split named by a file, HF's logs and harbor layouts (`*.eval`, task.toml, instruction.md)."""
    other = (*_ROOT_CARDS, "task.toml", "instruction.md")
    return any(n in other or n.endswith(".eval") or NAMES_A_SPLIT.search(n) for n in files)
