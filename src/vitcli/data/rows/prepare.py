"""`vit prepare-data`: a pre-resized copy of an image source, as parquet or WebDataset tar shards
and a manifest.json, that any data.source then reads (parquet map-style or streamed, tar streamed;
sources.py recognises the directory by its manifest).

Why: decoding dominates the input pipeline, and its cost grows with the pixels stored, not the
pixels trained on. An ImageNet JPEG of 500x375 decodes in ~550 us; at 256 px on the shorter side it
holds a third of the pixels. FFCV's gain comes largely from this one step, done once, offline.

What is written, per split: `DIR/<split>-00000-of-000NN.parquet` in source order, every column kept
as it was except the image, re-encoded with its shorter side at most `max_size` (never upscaled: a
smaller image is copied byte for byte), and an integer label column cast to a `ClassLabel` with
names. With `--shards tar`, `DIR/<split>-00000-of-000NN.tar` instead, WebDataset's layout
(tar_shards.py): per row `KEY.jpg` (or `.png`, as --format says, whatever the bytes of an image
copied unchanged are) and `KEY.cls`, KEY its row in the split, the rows in a seeded shuffled order
(shard_order; the manifest's `shuffle_seed`); the other columns are not kept, and the class names
are the manifest's. An image that does not decode keeps its original bytes, so training's
skip-and-count rule still meets it and counts it; the manifest counts it too (`undecodable`) and
names it (`undecodable_images`: its file's path, else its row and split, as bad_images.image_name
names an image everywhere). The directory is filled under a temporary name beside DIR and renamed
into place only when complete (runtime.workdir.published_dir), so an interrupted run leaves no half
DIR.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import io
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources, tar_shards
from vitcli.errors import DataError
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.files import sha256_of
from vitcli.runtime.workdir import check_out_dir, published_dir

FORMAT_VERSION = 1
# png: lossless. Raw uint8 arrays would need their own decoder in batches.py
FORMATS = ("jpeg", "png")
MIN_SIZE = 16  # below this a ViT patch (16 px) would not fit the shorter side
# 95: re-encoding adds a second JPEG loss to the source's own. Measured on 50 photographs at 256 px
# (bench/ prepare_data.py), RMS error against the exact resize / bytes per image: quality 90: 3.1
# grey levels / 22 kB, 95: 2.4 / 31 kB, 100: 1.6 / 61 kB. 95 is the knee: 100 doubles the bytes (and
# the reading) for 0.8 levels, all far below what colour noise, crops and RandAugment change in
# training.
QUALITY = 95
# JPEG's 4:2:0 chroma subsampling stores colour at half resolution: at 256 px that is detail
# ImageNet's own 4:2:0 JPEGs never had, and full chroma (4:4:4) would decode 22% slower (PIL,
# measured). At CIFAR-like sizes it smears every colour edge (24 px synthetic images: mean error 7.8
# grey levels vs 3.0 in 4:4:4), so images whose shorter side is below this keep full chroma; they
# decode in microseconds either way.
FULL_CHROMA_BELOW = 128
SHARD_MB = 256  # shard size: large enough to read fast, several per split so streams split by rank
SHARDS = ("parquet", "tar")  # tar: WebDataset shards, streamed when training (recipe.resolve)
# per-row tallies, dropped before writing: an undecodable image's name (None: it decodes), bytes
_UNDECODABLE, _BYTES = "__undecodable", "__bytes"


@dataclass(frozen=True)
class Options:
    """How images are rewritten and how many processes rewrite them."""

    max_size: int = 256  # shorter side at most this, in pixels
    format: str = "jpeg"  # jpeg | png
    quality: int = QUALITY  # jpeg only
    workers: int = 0  # processes for the resize (datasets map num_proc); 0 or 1: this one
    shard_mb: float = SHARD_MB  # MiB per shard: a split is cut into ceil(its bytes / this) shards
    shards: str = "parquet"  # parquet | tar
    # of the order tar shards hold the rows in (shard_order); manifest.json records it
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_size < MIN_SIZE:
            raise DataError(f"--max-size {self.max_size}: must be at least {MIN_SIZE}")
        if self.format in ("wds", "webdataset", *SHARDS):
            # --format names how each image is encoded; the container is --shards
            raise DataError(f"--format {self.format}: --format is the image encoding "
                            f"({', '.join(FORMATS)}); for WebDataset tar shards give --shards tar")
        if self.format not in FORMATS:
            raise DataError(f"--format {self.format}: must be one of {', '.join(FORMATS)}")
        if not 1 <= self.quality <= 100:
            raise DataError(f"--quality {self.quality}: must be between 1 and 100")
        if self.workers < 0:
            raise DataError(f"--workers {self.workers}: must be 0 or more")
        if self.shards not in SHARDS:
            raise DataError(f"--shards {self.shards}: must be one of {', '.join(SHARDS)}")


def target_size(width: int, height: int, max_size: int) -> tuple[int, int]:
    """(width, height) with the shorter side `max_size` and the aspect kept to the nearest pixel;
    unchanged when the shorter side is already at most `max_size`."""
    short = min(width, height)
    if short <= max_size:
        return width, height
    scale = max_size / short
    if width <= height:
        return max_size, max(max_size, round(height * scale))
    return max(max_size, round(width * scale)), max_size


def resize_image(data: bytes, opts: Options) -> bytes | None:
    """The image re-encoded with its shorter side at most opts.max_size; `data` itself when it is
    small enough already; None when it does not decode."""
    try:
        img = Image.open(io.BytesIO(data))
        size = target_size(*img.size, opts.max_size)
        if size == img.size:
            img.load()  # a header alone can be fine over a broken body: the copy must still decode
            return data
        # a JPEG decodes at 1/2, 1/4 or 1/8 scale in the DCT for a fraction of the time; at twice
        # the target the antialiased resize below still sees every detail it keeps (PIL's own
        # thumbnail does this)
        img.draft(None, (2 * size[0], 2 * size[1]))
        img = img.convert(_mode(img.mode, opts.format)).resize(size, Image.Resampling.BICUBIC,
                                                               reducing_gap=3.0)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    out = io.BytesIO()
    # no EXIF is copied: the pixels are stored as decoded, which is how training decodes them too
    # (it applies no EXIF rotation), so a rotated photograph is trained on as before
    if opts.format == "jpeg":
        img.save(out, "JPEG", quality=opts.quality, subsampling=0 if min(size) < FULL_CHROMA_BELOW else 2)
    else:
        # PIL's default level 6: it writes 3x slower than level 1 but decodes 2x faster (256 px
        # photographs), and a copy is written once and read every epoch
        img.save(out, "PNG")
    return out.getvalue()


def _mode(mode: str, fmt: str) -> str:
    """The mode an image is resized and stored in: grey stays grey, alpha stays only in PNG, the
    rest RGB (a palette or 1-bit image cannot be resized with antialiasing)."""
    if mode == "L" or (fmt == "png" and mode in ("RGB", "RGBA", "LA")):
        return mode
    return "RGB"


def _encoded(item: dict) -> bytes | None:
    """An Image cell's bytes, read from its path when the source only refers to a file
    (imagefolder)."""
    if item.get("bytes") is not None:
        return item["bytes"]
    try:
        return Path(item["path"]).read_bytes()
    except (OSError, TypeError):
        return None


def _resize_rows(batch: dict, rows: list[int], column: str, opts: Options, where: str) -> dict:
    """datasets.map body over `rows` of split `where`: each image resized, or kept as it came (and
    named) when it does not decode."""
    images, bad, sizes = [], [], []
    for item, row in zip(batch[column], rows):
        data = _encoded(item)
        new = resize_image(data, opts) if data is not None else None
        name = Path(item["path"]).name if item.get("path") else None
        # no bytes at all (a path to a missing file): stored empty, which training counts as
        # undecodable too
        images.append({"bytes": new if new is not None else (data or b""), "path": name})
        bad.append(bad_images.image_name(item, where, row) if new is None else None)
        sizes.append(len(images[-1]["bytes"] or b""))
    return {column: images, _UNDECODABLE: bad, _BYTES: sizes}


# --- the source: its splits and label names
# ---------------------------------------------------------------


def load_splits(cfg: DataConfig, splits: list[str] | None) -> dict[str, datasets.Dataset]:
    """The named whole splits of cfg.source (default: every split it has), columns checked, images
    encoded."""
    available = sources.available_splits(cfg.source, cfg.synthetic)
    for name in splits or []:
        if name not in available:
            raise DataError(f"{cfg.source}: no split '{name}' (--splits); available: {', '.join(available)}")
    loaded = {}
    for name in splits or available:
        ds = sources.load_source(cfg.source, name, image_column=cfg.image_column,
                                 label_column=cfg.label_column, synthetic=cfg.synthetic)
        loaded[name] = ds.cast_column(cfg.image_column, datasets.Image(decode=False))
    return loaded


def label_names(splits: dict[str, datasets.Dataset], cfg: DataConfig) -> list[str]:
    """The label column's class names: its ClassLabel's, else the indices 0..C-1 as text, C being
    data.num_classes or one more than the largest label of any split; [] without a label column."""
    if not cfg.label_column:
        return []
    features = [ds.features[cfg.label_column] for ds in splits.values()]
    named = next((f.names for f in features if isinstance(f, datasets.ClassLabel)), None)
    if named is not None:
        return list(named)
    largest = max(max(ds[cfg.label_column], default=-1) for ds in splits.values())
    count = cfg.num_classes or largest + 1
    if largest >= count:
        raise DataError(f"{cfg.source}: label {largest} in column '{cfg.label_column}' is not below "
                        f"data.num_classes={count}")
    return [str(k) for k in range(count)]


# --- the copy
# -----------------------------------------------------------------------------------------------


def _resized(ds: datasets.Dataset, cfg: DataConfig, opts: Options, work: Path, split: str):
    """The split with its images resized (and the per-row tallies), cached under `work`, not HF's
    cache."""
    features = ds.features.copy()
    features[_UNDECODABLE], features[_BYTES] = datasets.Value("string"), datasets.Value("int64")
    kwargs = {"column": cfg.image_column, "opts": opts, "where": sources.origin(ds)}
    return ds.map(_resize_rows, batched=True, with_indices=True, batch_size=64, features=features,
                  fn_kwargs=kwargs, num_proc=opts.workers or None,
                  cache_file_name=str(work / f"{split}.arrow"), desc=f"resizing {split}")


def _write_split(ds: datasets.Dataset, split: str, cfg: DataConfig, names: list[str], opts: Options,
                 into: Path) -> dict:
    """One resized split as contiguous shards (opts.shards) of about opts.shard_mb in `into`; its
    manifest entry."""
    undecodable, total = [name for name in ds[_UNDECODABLE] if name is not None], sum(ds[_BYTES])
    ds = ds.remove_columns([_UNDECODABLE, _BYTES]).cast_column(cfg.image_column, datasets.Image())
    if cfg.label_column:
        ds = ds.cast_column(cfg.label_column, datasets.ClassLabel(names=names))
    count = min(len(ds), max(1, math.ceil(total / (opts.shard_mb * 2**20))))
    shards = []
    for k, rows in enumerate(np.array_split(shard_order(len(ds), opts), count)):
        file = into / f"{split}-{k:05d}-of-{count:05d}.{opts.shards}"
        shard = ds.select(rows)
        if opts.shards == "tar":
            _write_tar(shard, rows, file, cfg, opts)
        else:
            shard.to_parquet(str(file))
        # bytes: how a tar shard's rows are vouched for when read (sources.prepared_files)
        shards.append({"file": file.name, "rows": len(shard), "bytes": file.stat().st_size,
                       "sha256": sha256_of(file)})
    return {"rows": len(ds), "undecodable": len(undecodable), "undecodable_images": undecodable,
            "shards": shards}


def shard_order(rows: int, opts: Options) -> np.ndarray:
    """The split's rows in the order the shards hold them, (rows,) int64: parquet in source order
    (it is read map-style, shuffled by index); tar in a permutation seeded by opts.seed, as
    WebDataset's writers are fed. A stream shuffles only within a buffer of a shard or two, so
    class-sorted tars (an image folder's order) would train on a few classes at a time: ImageNet at
    256 MB a shard is 6-8 classes."""
    if opts.shards != "tar":
        return np.arange(rows)
    return np.random.default_rng(opts.seed).permutation(rows)


def _write_tar(shard: datasets.Dataset, rows: np.ndarray, file: Path, cfg: DataConfig,
               opts: Options) -> None:
    """A shard's rows as one WebDataset tar (tar_shards.write_shard), `rows` their rows in the
    split: the encoded image as it is, keyed by its row in the split, and its label id."""
    image, label = cfg.image_column, cfg.label_column
    cells = shard.select_columns([image, *([label] if label else [])])
    cells = cells.cast_column(image, datasets.Image(decode=False))  # the bytes, not decoded
    examples = ((tar_shards.example_key(int(row)), cell[image]["bytes"], cell[label] if label else None)
                for row, cell in zip(rows, cells))
    tar_shards.write_shard(file, examples, tar_shards.IMAGE_MEMBER[opts.format])


def manifest(cfg: DataConfig, opts: Options, names: list[str], splits: dict) -> dict:
    """manifest.json's content; `splits` maps each split to its entry (rows, undecodable: their
    count, undecodable_images: their names, shards)."""
    return {
        "kind": sources.PREPARED_KIND, "format_version": FORMAT_VERSION,
        "tool": f"vitcli {importlib.metadata.version('vitcli')}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": cfg.source,
        "synthetic": dataclasses.asdict(cfg.synthetic) if cfg.source == "synthetic" else None,
        "image_column": cfg.image_column, "label_column": cfg.label_column,
        "max_size": opts.max_size, "format": opts.format, "shards": opts.shards,
        # None: source order (shard_order)
        "shuffle_seed": opts.seed if opts.shards == "tar" else None,
        "quality": opts.quality if opts.format == "jpeg" else None,
        "label_names": names, "splits": splits,
    }


def prepare(cfg: DataConfig, out: Path, splits: list[str] | None, opts: Options, *, overwrite: bool = False,
            dry_run: bool = False) -> dict:
    """Write the pre-resized copy of cfg.source into `out` (or with `dry_run` only check and plan
    it); returns the manifest (planned: rows per split, no shards)."""
    # `--out .` has no name to put a temporary or a set-aside copy beside
    out = Path(out).absolute()
    check_out_dir(out, overwrite)
    loaded = load_splits(cfg, splits)
    names = label_names(loaded, cfg)
    if dry_run:
        return manifest(cfg, opts, names, {s: {"rows": len(ds)} for s, ds in loaded.items()})
    entries = {}
    # the arrow files of the resize go to a work directory beside `out`, not HF's cache: removed
    # when done
    with (published_dir(out) as into,
          tempfile.TemporaryDirectory(prefix=f".{out.name}.work.", dir=out.parent) as work):
        for split, ds in loaded.items():
            resized = _resized(ds, cfg, opts, Path(work), split)
            entries[split] = _write_split(resized, split, cfg, names, opts, into.tmp)
        written = manifest(cfg, opts, names, entries)
        (into.tmp / sources.PREPARED_MANIFEST).write_text(json.dumps(written, indent=2) + "\n")
    return written
