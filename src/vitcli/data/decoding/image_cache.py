"""Decoded training images kept once for a training process and all its loader workers, in a bounded
space.

Why a cache: at 32 px a PNG's decode costs as much as all the augmentation after it, and from the
second epoch on the cache takes it away (CIFAR, the VTAB-1k tasks, the built-in data).

Why decided from the bytes on disk: the decision used to read the arrow table's size, which for an
image folder is its paths (290 KB for 4,800 photographs of 273 MB), so every folder, however large,
counted as small and each process kept every image it decoded, whole: 4.7 GB for that folder, and
ImageNet's 1.28M files (~500 GB decoded) would exhaust any machine in its first epoch.
`encoded_bytes` sums what the images take on disk: file sizes for rows that only name a file, the
arrow bytes for rows that hold theirs.

Why shared and bounded: each loader worker kept its own dict, so over the epochs each came to hold
nearly every image (a training worker at 0.85-0.99 GB on 1,600 photographs, against 0.33 GB for
timm's worker on the same job). `SharedImages` is one anonymous shared mapping of `capacity` bytes,
made before the workers fork, so they all fill and read one copy; pages are taken only as images are
written, and once it is full the rows outside it are decoded every time (from their crop alone,
decode.Encoded), never kept elsewhere.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

# Encoded bytes up to which a split is worth caching: CIFAR-10's 50,000 PNGs (~120 MB), a VTAB-1k
# task. A larger split's decoded pixels would not fit a bounded cache anyway (they take 3-10x their
# encoded bytes), and its images are better decoded from their crop alone (decode.Encoded), at
# reduced scale where it allows.
CACHE_ENCODED_BYTES = 192 * 2**20
# rows whose sizes are read at once: an early stop reads a few chunks of a million-row folder
_CHUNK = 4096
_EMPTY, _READY = 0, 1  # a row's state in the table


def encoded_bytes(images: datasets.Dataset, column: str, limit: int) -> int:
    """The bytes the split's images take on disk: the arrow bytes of rows that hold them, the file
    sizes of rows that only name a file (an image folder). Counting stops once past `limit` (a
    result > limit then means "more than limit"): a million-file folder is decided after a few
    thousand stat calls."""
    total = 0
    table = images.select_columns([column]).with_format("arrow")
    for start in range(0, len(images), _CHUNK):
        cells = table[start : start + _CHUNK][column].combine_chunks()  # struct {bytes, path}
        data = cells.field("bytes")
        total += pc.sum(pc.binary_length(data)).as_py() or 0
        paths = pc.filter(cells.field("path"), pc.is_null(data)).to_pylist()
        total += sum(_file_size(p) for p in paths)
        if total > limit:
            return total
    return total


def _file_size(path: str | None) -> int:
    """A file's size; 0 when it is missing (training names it as undecodable when it meets it)."""
    try:
        return os.stat(path).st_size if path else 0
    except OSError:
        return 0


class SharedImages:
    """Row -> decoded uint8 (3, H, W) image, one copy for the process that makes it and every loader
    worker it forks, at most `capacity` bytes of pixels; first come, first kept, never evicted (each
    row is read once an epoch in a random order, so no row is more worth keeping than another).

    The mappings are shared by fork only: a worker started another way (spawn) gets a disabled copy
    and decodes every image, rather than a cache of its own (`__getstate__`)."""

    def __init__(self, rows: int, capacity: int):
        self.capacity = capacity
        # MAP_SHARED | MAP_ANONYMOUS: no page is taken until an image is written into it
        self._pixels: mmap.mmap | None = mmap.mmap(-1, max(1, capacity))
        # per row (offset, height, width, state), then one row of totals (bytes used, images, full)
        self._table: mmap.mmap | None = mmap.mmap(-1, (rows + 1) * 4 * 8)
        self._lock = multiprocessing.get_context("fork").Lock()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pixels": None, "_table": None, "_lock": None}

    @property
    def _rows(self) -> np.ndarray:
        return np.frombuffer(self._table, dtype=np.int64).reshape(-1, 4)  # (rows + 1, 4)

    @property
    def full(self) -> bool:
        """Whether an image has found no room: the rows outside are decoded every time from then
        on."""
        return self._table is None or bool(self._rows[-1, 2])

    def held(self) -> tuple[int, int]:
        """(bytes of pixels held, images held)."""
        if self._table is None:
            return 0, 0
        used, count, _ = self._rows[-1, :3]
        return int(used), int(count)

    def get(self, rows: list[int]) -> dict[int, torch.Tensor]:
        """The cached images among `rows`, as (3, H, W) views of the shared pixels (never
        overwritten)."""
        if self._table is None:
            return {}
        with self._lock:
            entries = {i: self._rows[i].copy() for i in dict.fromkeys(rows)}
        return {i: self._view(*e[:3]) for i, e in entries.items() if e[3] == _READY}

    def put(self, images: dict[int, torch.Tensor]) -> None:
        """Keep each (3, H, W) uint8 image whose row is not yet kept, while there is room."""
        if self._table is None or not images:
            return
        table = self._rows
        with self._lock:
            for i, x in images.items():
                if table[i, 3] != _EMPTY:
                    continue
                height, width, offset = x.shape[1], x.shape[2], int(table[-1, 0])
                size = 3 * height * width
                if offset + size > self.capacity:
                    table[-1, 2] = 1
                    continue
                np.frombuffer(self._pixels, np.uint8, size, offset).reshape(height, width, 3)[...] = (
                    # channels last, as torchvision's decoders lay pixels out
                    x.permute(1, 2, 0).numpy())
                table[i] = (offset, height, width, _READY)
                table[-1, :2] += (size, 1)

    def _view(self, offset: int, height: int, width: int) -> torch.Tensor:
        flat = torch.frombuffer(self._pixels, dtype=torch.uint8, count=3 * height * width, offset=offset)
        return flat.view(height, width, 3).permute(2, 0, 1)


def cache_for(images: datasets.Dataset, column: str, capacity: int) -> tuple[SharedImages | None, int]:
    """(the shared cache for a training split, or None, and the bytes its images take on disk as far
    as they were counted): on when the images take at most CACHE_ENCODED_BYTES on disk, and no more
    than the cache's `capacity` (data.cache_mb, per training process on this host; 0: off) either,
    since an image decoded takes more than its encoded bytes."""
    if capacity <= 0:
        return None, 0
    limit = min(CACHE_ENCODED_BYTES, capacity)
    on_disk = encoded_bytes(images, column, limit)
    if on_disk > limit:
        return None, on_disk
    return SharedImages(len(images), capacity), on_disk
