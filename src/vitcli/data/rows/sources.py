"""Every image source as a Hugging Face `datasets.Dataset` (the batch streams built on them are batches.py).

Sources: `synthetic`, a `save_to_disk` directory, parquet/arrow file(s) or a glob of them, a directory that
`load_dataset` understands (imagefolder class subdirectories, parquet shards; a plain image tree is read from
its cached index, folder_index.py, with the rows HF's imagefolder gives), a `vit prepare-data` copy
(parquet or tar shards named by its manifest.json), WebDataset tar shards (a .tar, a glob or brace pattern
of them, a folder of them), or a Hub id. Every kind
accepts HF split syntax with slicing and `+` (`train[:98%]`, `train[:800]+validation`), resolved by
`datasets.ReadInstruction` so percentages round exactly as HF does; a slice reaching past the end of its
split, or selecting nothing, is an error (HF would clamp it silently: a short local copy of a VTAB task).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from vitcli.data.rows import folder_index, holdout, tar_shards, tasks
from vitcli.data.rows.synthetic import SPLIT_IDS, make_synthetic, split_size
from vitcli.errors import DataError
from vitcli.recipe.data_checks import names_tar_shards, split_names
from vitcli.recipe.schema import DataConfig, SyntheticConfig

_TRUE = ("1", "on", "yes", "true")
PREPARED_MANIFEST, PREPARED_KIND = "manifest.json", "vitcli prepare-data"  # data/rows/prepare.py writes them


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in _TRUE for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _select(splits: dict[str, datasets.Dataset], split: str, source: str) -> datasets.Dataset:
    """Apply an HF split spec (slices, percentages, `+`) to already loaded splits."""
    missing = [name for name in split_names(split) if name not in splits]
    if missing:
        raise DataError(f"{source}: no split '{missing[0]}'; available: {', '.join(splits)}")
    sizes = {k: len(v) for k, v in splits.items()}
    try:
        spans = datasets.ReadInstruction.from_spec(split).to_absolute(sizes)
    except (ValueError, AssertionError) as e:
        hint = "use e.g. train, train[:98%], train[:800]"
        raise DataError(f"{source}: bad split '{split}' ({e}); {hint}") from None
    for part, span in zip(split.split("+"), spans):  # HF gives one span per `+` part, in order
        _check_rows(part.strip(), span, sizes[span.splitname], source)
    parts = [splits[s.splitname].select(range(s.from_, s.to)) for s in spans]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


_BOUNDS = re.compile(r"\[\s*(-?\d+)?\s*(%?)\s*:\s*(-?\d+)?\s*(%?)\s*\]")  # train[a:b], [a%:], [:b]


def _check_rows(part: str, span, rows: int, source: str) -> None:
    """A slice reaching past its split, or selecting nothing, is an error: HF clamps `train[65931:66131]` on
    4,000 rows to an empty selection and `train[3900:4100]` to 100 rows without a word."""
    match = _BOUNDS.search(part)
    if not match:
        return  # a whole split: an empty one is _check's to report
    bounds = [int(v) for v, pct in (match.group(1, 2), match.group(3, 4)) if v and not pct]  # row numbers
    past = any(abs(b) > rows for b in bounds)
    if past:
        raise DataError(f"{source}: split slice '{part}' reaches past the end of split '{span.splitname}' "
                        f"({rows} rows): this copy is shorter than the slice expects; use a complete copy or "
                        "a smaller slice")
    if span.from_ >= span.to:  # in a `+` concatenation nothing else would notice
        raise DataError(f"{source}: split slice '{part}' is empty (split '{span.splitname}' has {rows} "
                        "rows); give a slice that selects rows")


def _looks_like_path(source: str) -> bool:
    """Hub ids are `name` or `owner/name`; anything else (./x, /x, a/b/c, x.parquet) is meant as a path."""
    suffix = Path(source).suffix
    return source.startswith((".", "/", "~")) or source.count("/") > 1 or suffix in (".parquet", ".arrow")


def _files(paths: list[str], source: str) -> dict[str, datasets.Dataset]:
    """Parquet or arrow files as one `train` split (arrow files are memory-mapped, not copied)."""
    kinds = {Path(p).suffix for p in paths}
    if kinds == {".arrow"}:
        return {"train": datasets.concatenate_datasets([datasets.Dataset.from_file(p) for p in paths])}
    if kinds == {".parquet"}:
        return {"train": datasets.load_dataset("parquet", data_files=paths, split="train")}
    tar = " (tar shards: a pattern that ends in .tar, e.g. DIR/*.tar)" if ".tar" in kinds else ""
    raise DataError(f"{source}: expected .parquet or .arrow files, found {', '.join(sorted(kinds))}{tar}")


def source_kind(source: str) -> tuple[str, list[str] | Path | None]:
    """What a data.source names, decided once for loading and streaming: ("synthetic", None), ("hub", None),
    or a local ("files", the files of a file, glob or brace pattern), ("shards", the WebDataset .tar files
    of a file or pattern, or a folder of them), ("saved", a save_to_disk directory), ("prepared", a
    `vit prepare-data` directory, parquet or tar) or ("folder", a directory HF infers the builder of:
    imagefolder, parquet shards, ...). A missing path is an error."""
    if source == "synthetic":
        return "synthetic", None
    path, pattern = Path(source).expanduser(), any(c in source for c in "*?[{")
    if not pattern and not path.exists():
        if _looks_like_path(source):
            raise DataError(f"dataset path not found: {source}")
        return "hub", None
    if pattern or path.is_file():
        files = _pattern_files(source) if pattern else [str(path)]
        return ("shards" if names_tar_shards(source) else "files"), files
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return "saved", path
    if _is_prepared(path / PREPARED_MANIFEST):
        return "prepared", path
    if names_tar_shards(source):
        return "shards", path
    return "folder", path


def _pattern_files(source: str) -> list[str]:
    """The files a glob or brace pattern names, in order: braces expanded first (tar_shards.expand_braces),
    then each part globbed. A part with no glob that names no file is an error, not dropped: a brace pattern
    lists the shards a dataset has, and a lost one would go unnoticed."""
    files = [file for part in tar_shards.expand_braces(source) for file in _part_files(part, source)]
    if not files:
        raise DataError(f"dataset path not found: {source} (the glob matches no file)")
    return files


def _part_files(part: str, source: str) -> list[str]:
    """The files one expanded part of `source` names: a glob's matches, sorted, or the one file it is."""
    path = str(Path(part).expanduser())
    if any(c in part for c in "*?["):
        return sorted(glob.glob(path))
    if not Path(path).is_file():
        raise DataError(f"{source}: {part} is not a file")
    return [path]


def _is_prepared(manifest: Path) -> bool:
    """A manifest.json that `vit prepare-data` wrote (another tool's file of that name is not one)."""
    try:
        return json.loads(manifest.read_text()).get("kind") == PREPARED_KIND
    except (OSError, ValueError, AttributeError):
        return False


def prepared_files(path: Path, source: str) -> dict[str, list[str]]:
    """A prepared directory's shard files per split, each split checked to hold the rows its manifest counts
    (from the parquet footers, or a tar's size: cheap), so a shard lost or cut short is named before anything
    trains."""
    splits = json.loads((path / PREPARED_MANIFEST).read_text())["splits"]
    files = {}
    for split, entry in splits.items():
        files[split] = [str(path / shard["file"]) for shard in entry["shards"]]
        missing = [f for f in files[split] if not Path(f).is_file()]
        if missing:
            raise DataError(f"{source}: shard {missing[0]} listed in {PREPARED_MANIFEST} is missing")
        rows = sum(_shard_rows(path / shard["file"], shard, source) for shard in entry["shards"])
        if rows != entry["rows"]:
            raise DataError(f"{source}: split '{split}' has {rows} rows in its shards but {entry['rows']} in "
                            f"{PREPARED_MANIFEST}; prepare the copy again (vit prepare-data --overwrite)")
    return files


def _shard_rows(file: Path, shard: dict, source: str) -> int:
    """A prepared shard's rows: a parquet footer's count; a tar's as its manifest entry says, once the tar
    has the size recorded with it. Counting a tar's members would read a header per member, ~2.6 million
    for ImageNet at every start; a tar lost, cut short or grown has another size."""
    if file.suffix != tar_shards.TAR:
        return pq.read_metadata(file).num_rows
    size = file.stat().st_size
    if size != shard["bytes"]:
        raise DataError(f"{source}: shard {file} is {size} bytes but {shard['bytes']} in "
                        f"{PREPARED_MANIFEST}; prepare the copy again (vit prepare-data --overwrite)")
    return shard["rows"]


def _saved_splits(path: Path) -> dict[str, datasets.Dataset]:
    """The splits of a save_to_disk directory; a lone saved Dataset is the split `train`."""
    saved = datasets.load_from_disk(str(path))
    return dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}


def _local(kind: str, where, source: str) -> dict[str, datasets.Dataset]:
    """All splits of a local source; a lone saved Dataset, a file or a glob is the split `train`."""
    if kind == "files":
        return _files(where, source)
    if kind == "saved":
        return _saved_splits(where)
    if kind == "prepared":
        return dict(datasets.load_dataset("parquet", data_files=prepared_files(where, source)))
    return _folder(where)


def _folder(path: Path) -> dict[str, datasets.Dataset]:
    """A directory HF infers the builder of: a plain image tree from its index (folder_index: seconds, where
    HF's builder takes minutes at ImageNet's size), anything else (parquet shards, metadata files) by HF."""
    indexed = folder_index.splits(path)
    return indexed if indexed is not None else dict(datasets.load_dataset(str(path)))


def available_splits(source: str, synthetic: SyntheticConfig) -> list[str]:
    """The names of every split a source has (the built-in data's: those with images)."""
    kind, where = source_kind(source)
    if kind == "synthetic":
        return [name for name in SPLIT_IDS if split_size(synthetic, name)]
    if kind == "prepared":
        return list(json.loads((where / PREPARED_MANIFEST).read_text())["splits"])
    if kind == "shards":
        return list(_tar_splits(where, source))
    if kind != "hub":
        with _readable(source):
            return list(_local(kind, where, source))
    _check_online(source)
    try:
        return list(datasets.get_dataset_split_names(source))
    except Exception as e:  # noqa: BLE001 - network, auth, no such dataset: the library's words, one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot list the splits of '{source}' on the Hub: {reason}") from None


def _check_online(source: str) -> None:
    if _offline():
        raise DataError(
            f"dataset '{source}' is not a local path and the Hub is offline (HF_DATASETS_OFFLINE or "
            "HF_HUB_OFFLINE is set); give a local directory or file, or unset them"
        )


@contextlib.contextmanager
def _readable(source: str):
    """A local source that HF cannot read (an empty directory, unreadable or foreign files) as one line."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise DataError(f"{source}: cannot read it as a dataset: {str(e).splitlines()[0]}") from None


def _hub(source: str, split: str, streaming: bool = False):
    """One split from the Hub: a Dataset, or with `streaming` an IterableDataset."""
    _check_online(source)
    try:
        return datasets.load_dataset(source, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001 - network, auth, unknown split: the library's words, one line
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        verb = "stream" if streaming else "load"
        raise DataError(f"cannot {verb} '{source}' split '{split}' from the Hub: {reason}") from None


def _check_columns(features: datasets.Features, source: str, image_column: str, label_column: str) -> None:
    """The image and label columns exist and labels are integer class ids."""
    columns = ", ".join(features)
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
        ds = ds.cast_column(image_column, datasets.Image())  # e.g. a {bytes, path} struct from plain parquet
    return ds


def load_source(
    source: str,
    split: str,
    *,
    image_column: str = "image",
    label_column: str = "label",
    synthetic: SyntheticConfig | None = None,
) -> datasets.Dataset:
    """One split (HF syntax, slicing allowed) of any supported source, checked for its image/label columns.

    All columns are kept; `label_column=""` skips the label checks for callers that derive labels themselves.
    """
    ds = _open(source, split, synthetic or SyntheticConfig())
    ds = tar_shards.named_columns(ds, image_column, label_column)
    ds = _check(ds, source, split, image_column, label_column)
    # HF copies `info` through select, map, casts and into worker processes, so a row that fails to decode
    # deep in a batch stream can still be named with its split (see `origin`)
    ds.info.description = f"{source} split '{split}'"
    return ds


def _open(source: str, split: str, synthetic: SyntheticConfig, streaming: bool = False):
    """One split of any source as source_kind names it: a Dataset, or with `streaming` an IterableDataset."""
    kind, where = source_kind(source)
    if kind == "hub":
        return _hub(source, split, streaming)
    if kind == "synthetic":
        return _synthetic_stream(synthetic, split) if streaming else _synthetic(synthetic, split)
    with _readable(source):
        if kind == "shards" or (kind == "prepared" and _prepared_tars(where)):
            return _tars(where, source, split, streaming)
        found = _local_stream(kind, where, source, split) if streaming else _local(kind, where, source)
    return found if streaming else _select(found, split, source)


# --- WebDataset tar shards (tar_shards.py), read by HF's `webdataset` builder -------------------------------


def _prepared_tars(path: Path) -> bool:
    """Whether a `vit prepare-data` copy holds tar shards (`--shards tar`), not parquet."""
    return json.loads((path / PREPARED_MANIFEST).read_text()).get("shards") == "tar"


def _tar_splits(where: list[str] | Path, source: str) -> dict[str, list[str]]:
    """The tar shards of each split of a "shards" source: a file or pattern is the split `train`; a folder's
    split by their names (tar_shards.folder_splits)."""
    return {"train": where} if isinstance(where, list) else tar_shards.folder_splits(where, source)


def _tars(where: list[str] | Path, source: str, split: str, streaming: bool):
    """Tar shards (a "shards" source, or a prepared copy's) through HF's webdataset builder, one shard per
    tar: with `streaming` the stream of a whole split; else the splits `split` names (HF syntax), loaded
    whole, which HF does by copying their images into its cache: fine for evaluation splits, which is what
    reads a tar source map-style (a training split streams: recipe.resolve)."""
    prepared = isinstance(where, Path) and _is_prepared(where / PREPARED_MANIFEST)
    splits = prepared_files(where, source) if prepared else _tar_splits(where, source)
    features = tar_shards.features(json.loads((where / PREPARED_MANIFEST).read_text())) if prepared else None
    wanted = [split] if streaming else list(dict.fromkeys(split_names(split)))
    missing = [name for name in wanted if name not in splits]
    if missing:
        raise DataError(f"{source}: no split '{missing[0]}'; available: {', '.join(splits)}")
    loaded = datasets.load_dataset("webdataset", data_files={name: splits[name] for name in wanted},
                                   features=features, streaming=streaming)
    return loaded[split] if streaming else _select(dict(loaded), split, source)


def _synthetic(synthetic: SyntheticConfig, split: str) -> datasets.Dataset:
    """The built-in data's splits that `split` names (slices and `+` allowed)."""
    names = list(dict.fromkeys(split_names(split)))
    unknown = [n for n in names if n not in SPLIT_IDS]
    if unknown:
        raise DataError(f"synthetic: no split '{unknown[0]}'; available: {', '.join(SPLIT_IDS)}")
    return _select({n: make_synthetic(synthetic, n) for n in names}, split, "synthetic")


def origin(ds: datasets.Dataset) -> str:
    """Where a split's rows come from, "SOURCE split 'SPLIT'" as `load_source` recorded it, for messages."""
    return ds.info.description or "the dataset"


def load_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """`load_source` with the recipe's source, columns and synthetic sizes (and label rule, for
    VTAB); under data.holdout the train split's kept rows, or for the split `holdout` its held-out
    ones."""
    if which := holdout.part(cfg, split):
        whole = load_split(dataclasses.replace(cfg, holdout=0.0), cfg.train_split)
        return holdout.take(whole, cfg, which)
    if cfg.label_rule:  # one of tasks.LABEL_RULES: vitcli.recipe.data_checks says so at resolve time
        ds = load_source(cfg.source, split, image_column=cfg.image_column, label_column="",
                         synthetic=cfg.synthetic)
        task = tasks.Task(cfg.source, "custom", cfg.num_classes, cfg.source, label_rule=cfg.label_rule)
        return tasks.apply_label_rule(task, ds)  # writes the derived labels to a `label` column
    columns = {"image_column": cfg.image_column, "label_column": cfg.label_column}
    return load_source(cfg.source, split, **columns, synthetic=cfg.synthetic)


def task_data(task: tasks.Task, data_root: str = "") -> dict:
    """The data.* settings that read `task`'s labelled images (VTAB fine-tuning and few-shot alike): its
    source (the local copy under `data_root`, else its Hub id), columns, label rule (it writes `label`),
    classes and pixel scale. Splits are the caller's."""
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
    """The names of a head's `num_classes` classes: the label column's ClassLabel names (the built-in data's
    `shape_texture`, an imagefolder's directories, a Hub set's), for a Dataset or a stream alike; None where
    the split has none or they do not match the head's width (a label rule, a data.num_classes of its own)."""
    feature = (ds.features or {}).get(cfg.label_column) if cfg.label_column else None
    if isinstance(feature, datasets.ClassLabel) and feature.num_classes == num_classes:
        return [str(name) for name in feature.names]
    return None


FILE_NAME_COLUMNS = ("file_name", "filename", "image_name", "path")  # string columns that name a row's file


def file_names(cfg: DataConfig, ds: datasets.Dataset) -> list[str | None] | None:
    """The file each row's image came from: a file-name column (FILE_NAME_COLUMNS), else the image column's
    stored `path` (an imagefolder's files, a parquet export that kept them); None when the split has none."""
    for column in FILE_NAME_COLUMNS:
        feature = ds.features.get(column)
        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
            return list(ds[column])
    image = ds.select_columns([cfg.image_column]).with_format("arrow")[:][cfg.image_column]  # no decoding
    if not pa.types.is_struct(image.type) or image.type.get_field_index("path") < 0:
        return None
    paths = image.combine_chunks().field("path").to_pylist()  # (N,) str or None
    return paths if any(paths) else None


# --- data.streaming: the train split as a `datasets.IterableDataset` (batched by streams.py) ---------------

STREAM_SHARDS = 64  # shards a saved or synthetic split is cut into: a multiple of the usual world sizes
_STREAM_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json"}


def _file_stream(paths: list[str], source: str, split: str) -> datasets.IterableDataset:
    """parquet/arrow/json file(s) as the split `train`, one shard per file."""
    kinds = {Path(p).suffix for p in paths}
    builders = {_STREAM_BUILDERS.get(k) for k in kinds}
    if len(builders) != 1 or None in builders:
        raise DataError(f"{source}: expected .parquet, .arrow or .json(l) files of one kind, found "
                        f"{', '.join(sorted(kinds))}")
    if split != "train":
        raise DataError(f"{source}: files make one split, 'train'; data.train_split='{split}' names another")
    return datasets.load_dataset(builders.pop(), data_files=paths, split="train", streaming=True)


def _split_stream(splits: dict[str, datasets.Dataset], source: str, split: str) -> datasets.IterableDataset:
    """A split of a save_to_disk directory or a folder's index, streamed from its memory-mapped arrow."""
    if split not in splits:
        raise DataError(f"{source}: no split '{split}'; available: {', '.join(splits)}")
    return _sharded(splits[split])


def _sharded(ds: datasets.Dataset) -> datasets.IterableDataset:
    """A loaded split streamed from its memory-mapped arrow, cut into STREAM_SHARDS shards."""
    return ds.to_iterable_dataset(num_shards=max(1, min(STREAM_SHARDS, len(ds))))


def _synthetic_stream(synthetic: SyntheticConfig, split: str) -> datasets.IterableDataset:
    return _sharded(make_synthetic(synthetic, split))


def _local_stream(kind: str, where, source: str, split: str) -> datasets.IterableDataset:
    """One split of a local source, streamed: a shard per file, a saved directory's or a plain folder's
    index's arrow, any other folder by HF."""
    if kind == "files":
        return _file_stream(where, source, split)
    if kind == "saved":
        return _split_stream(_saved_splits(where), source, split)
    if kind == "prepared":
        files = prepared_files(where, source)
        if split not in files:
            raise DataError(f"{source}: no split '{split}'; available: {', '.join(files)}")
        return datasets.load_dataset("parquet", data_files={split: files[split]}, split=split, streaming=True)
    indexed = folder_index.splits(where)
    if indexed is not None:
        return _split_stream(indexed, source, split)
    return datasets.load_dataset(str(where), split=split, streaming=True)


def load_stream(cfg: DataConfig) -> datasets.IterableDataset:
    """The train split (data.train_split, a whole split) as an IterableDataset whose images stay encoded
    ({bytes, path}: streams.py decodes them in its workers), its image and label columns checked.

    Only the train split streams: evaluation wants complete, exactly counted passes over small splits, which
    `load_split` gives (it ignores data.streaming).
    """
    split = cfg.train_split  # a whole split, no label rule: vitcli.recipe.data_checks says so at resolve time
    ids = _open(cfg.source, split, cfg.synthetic, streaming=True)
    if ids.features is None:  # json without a schema: read the first rows for the column types
        ids = ids._resolve_features()
    # encoded before any step: one that maps (named_columns' rename) would decode every image in this process,
    # and the cast below encode it again
    ids = tar_shards.named_columns(ids.decode(False), cfg.image_column, cfg.label_column)
    _check_columns(ids.features, cfg.source, cfg.image_column, cfg.label_column)
    ids = ids.cast_column(cfg.image_column, datasets.Image(decode=False))
    ids.info.description = f"{cfg.source} split '{split}'"  # for messages, as `origin` reads it
    return ids
