"""Every image source as a Hugging Face `datasets.Dataset` or a stream (the batch streams built on
them are batches.py): the functions the rest of vitcli calls (load_split, load_stream,
available_splits, num_classes, class_names, file_names, origin, task_data), over one reader per kind
of source (reader_factory.py: the built-in data, a Hub id, a `save_to_disk` directory, parquet/arrow
files, an image folder, WebDataset tar shards, a `vit prepare-data` copy), and the checks every
split passes: its image and label columns, labels that are class ids, not empty. Every kind accepts
HF split syntax with slicing and `+` (reader.select).
"""

from __future__ import annotations

import contextlib
import dataclasses

import datasets
import pyarrow as pa

from vitcli.data.rows import holdout, reader_folder, tar_shards, tasks
from vitcli.data.rows.reader import STREAM_SHARDS
from vitcli.data.rows.reader_factory import create_reader, source_kind
from vitcli.data.rows.reader_prepared import prepared_files
from vitcli.errors import DataError, first_line
from vitcli.recipe.data_checks import PREPARED_KIND, PREPARED_MANIFEST
from vitcli.recipe.schema import DataConfig, SyntheticConfig

# named here too, for the modules that read sources (prepare.py writes the manifest; tests count
# shards)
__all__ = ["PREPARED_KIND", "PREPARED_MANIFEST", "STREAM_SHARDS", "prepared_files", "source_kind"]


def available_splits(source: str, synthetic: SyntheticConfig) -> list[str]:
    """The names of every split a source has (the built-in data's: those with images)."""
    reader = create_reader(source, synthetic)
    with _readable(source) if reader.local else contextlib.nullcontext():
        return reader.splits()


@contextlib.contextmanager
def _readable(source: str):
    """A local source that HF cannot read (an empty directory, unreadable or foreign files) as one
    line; a folder without a single image says so (reader_folder.no_images), not what HF made of its
    other files."""
    try:
        yield
    except (OSError, ValueError) as e:
        empty = _no_images(source)
        raise DataError(empty or f"{source}: cannot read it as a dataset: {first_line(e)}") from None


def _no_images(source: str) -> str | None:
    """reader_folder.no_images for a source that is a folder HF infers the layout of, else None."""
    kind, where = source_kind(source)
    return reader_folder.no_images(where) if kind == "folder" else None


def _check_columns(features: datasets.Features, source: str, image_column: str, label_column: str) -> None:
    """The image and label columns exist and labels are integer class ids."""
    columns = ", ".join(features)
    if image_column not in features and not any(isinstance(f, datasets.Image) for f in features.values()):
        empty = _no_images(source)  # HF read the folder's other files (a CSV's columns)
        if empty:
            raise DataError(empty)
    for role, col in (("image", image_column), ("label", label_column)):
        if col and col not in features:
            raise DataError(f"{source}: no {role} column '{col}' (data.{role}_column); columns: {columns}")
    label = features.get(label_column)
    integer = isinstance(label, datasets.Value) and label.dtype.startswith(("int", "uint"))
    if label_column and not (isinstance(label, datasets.ClassLabel) or integer):
        raise DataError(f"{source}: label column '{label_column}' holds {label}, not integer class ids")


def _check(ds: datasets.Dataset, source: str, split: str, image_column: str, label_column: str):
    """Columns exist, labels are integer class ids, the split is not empty; images decode to PIL."""
    _check_columns(ds.features, source, image_column, label_column)
    if len(ds) == 0:
        raise DataError(f"{source}: split '{split}' is empty")
    if not isinstance(ds.features[image_column], datasets.Image):
        # e.g. a {bytes, path} struct from plain parquet
        ds = ds.cast_column(image_column, datasets.Image())
    return ds


def load_source(
    source: str,
    split: str,
    *,
    image_column: str = "image",
    label_column: str = "label",
    synthetic: SyntheticConfig | None = None,
) -> datasets.Dataset:
    """One split (HF syntax, slicing allowed) of any supported source, checked for its image/label
    columns.

    All columns are kept; `label_column=""` skips the label checks for callers that derive labels
    themselves.
    """
    ds = _open(source, split, synthetic or SyntheticConfig())
    ds = tar_shards.named_columns(ds, image_column, label_column)
    ds = _check(ds, source, split, image_column, label_column)
    # HF copies `info` through select, map, casts and into worker processes, so a row that fails to
    # decode deep in a batch stream can still be named with its split (see `origin`)
    ds.info.description = f"{source} split '{split}'"
    return ds


def _open(source: str, split: str, synthetic: SyntheticConfig, streaming: bool = False):
    """One split of any source, through its reader: a Dataset (HF split syntax), or with `streaming`
    an IterableDataset of one whole split."""
    reader = create_reader(source, synthetic)
    with _readable(source) if reader.local else contextlib.nullcontext():
        return reader.stream(split) if streaming else reader.load(split)


def origin(ds: datasets.Dataset) -> str:
    """Where a split's rows come from, "SOURCE split 'SPLIT'" as `load_source` recorded it, for
    messages."""
    return ds.info.description or "the dataset"


def load_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """`load_source` with the recipe's source, columns and synthetic sizes (and label rule, for
    VTAB); under data.holdout the train split's kept rows, or for the split `holdout` its held-out
    ones."""
    if which := holdout.part(cfg, split):
        whole = load_split(dataclasses.replace(cfg, holdout=0.0), cfg.train_split)
        return holdout.take(whole, cfg, which)
    # one of tasks.LABEL_RULES: vitcli.recipe.data_checks says so at resolve time
    if cfg.label_rule:
        ds = load_source(cfg.source, split, image_column=cfg.image_column, label_column="",
                         synthetic=cfg.synthetic)
        task = tasks.Task(cfg.source, "custom", cfg.num_classes, cfg.source, label_rule=cfg.label_rule)
        return tasks.apply_label_rule(task, ds)  # writes the derived labels to a `label` column
    columns = {"image_column": cfg.image_column, "label_column": cfg.label_column}
    return load_source(cfg.source, split, **columns, synthetic=cfg.synthetic)


def task_data(task: tasks.Task, data_root: str = "") -> dict:
    """The data.* settings that read `task`'s labelled images (VTAB fine-tuning and few-shot alike):
    its source (the local copy under `data_root`, else its Hub id), columns, label rule (it writes
    `label`), classes and pixel scale. Splits are the caller's."""
    return {
        "source": tasks.task_source(task, data_root),
        "image_column": task.image_column, "label_rule": task.label_rule, "binary_pixels": task.binary_pixels,
        "label_column": "label" if task.label_rule else task.label_column,  # a rule writes `label`
        "num_classes": task.num_classes,
        "holdout": 0.0,  # another dataset: the recipe's own held-out share is not the task's
    }


def num_classes(cfg: DataConfig, ds: datasets.Dataset) -> int:
    """data.num_classes if set, else the number of names in the label column's ClassLabel."""
    if cfg.num_classes > 0:
        return cfg.num_classes
    feature = ds.features.get(cfg.label_column)
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes
    raise DataError(f"label column '{cfg.label_column}' is not a ClassLabel; set data.num_classes")


def class_names(cfg: DataConfig, ds, num_classes: int) -> list[str] | None:
    """The names of a head's `num_classes` classes: the label column's ClassLabel names (the
    built-in data's `shape_texture`, an imagefolder's directories, a Hub set's), for a Dataset or a
    stream alike; None where the split has none or they do not match the head's width (a label rule,
    a data.num_classes of its own)."""
    feature = (ds.features or {}).get(cfg.label_column) if cfg.label_column else None
    if isinstance(feature, datasets.ClassLabel) and feature.num_classes == num_classes:
        return [str(name) for name in feature.names]
    return None


# string columns that name a row's file
FILE_NAME_COLUMNS = ("file_name", "filename", "image_name", "path")


def file_names(cfg: DataConfig, ds: datasets.Dataset) -> list[str | None] | None:
    """The file each row's image came from: a file-name column (FILE_NAME_COLUMNS), else the image
    column's stored `path` (an imagefolder's files, a parquet export that kept them); None when the
    split has none."""
    for column in FILE_NAME_COLUMNS:
        feature = ds.features.get(column)
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            return list(ds[column])
    # no decoding
    image = ds.select_columns([cfg.image_column]).with_format("arrow")[:][cfg.image_column]
    if not pa.types.is_struct(image.type) or image.type.get_field_index("path") < 0:
        return None
    paths = image.combine_chunks().field("path").to_pylist()  # (N,) str or None
    return paths if any(paths) else None


# --- data.streaming: the train split as a `datasets.IterableDataset` (batched by streams.py)
# ---------------


def load_stream(cfg: DataConfig) -> datasets.IterableDataset:
    """The train split (data.train_split, a whole split) as an IterableDataset whose images stay
    encoded ({bytes, path}: streams.py decodes them in its workers), its image and label columns
    checked.

    Only the train split streams: evaluation wants complete, exactly counted passes over small
    splits, which `load_split` gives (it ignores data.streaming).
    """
    # a whole split, no label rule: vitcli.recipe.data_checks says so at resolve time
    split = cfg.train_split
    ids = _open(cfg.source, split, cfg.synthetic, streaming=True)
    if ids.features is None:  # json without a schema: read the first rows for the column types
        ids = ids._resolve_features()
    # encoded before any step: one that maps (named_columns' rename) would decode every image in
    # this process, and the cast below encode it again
    ids = tar_shards.named_columns(ids.decode(False), cfg.image_column, cfg.label_column)
    _check_columns(ids.features, cfg.source, cfg.image_column, cfg.label_column)
    ids = ids.cast_column(cfg.image_column, datasets.Image(decode=False))
    ids.info.description = f"{cfg.source} split '{split}'"  # for messages, as `origin` reads it
    return ids
