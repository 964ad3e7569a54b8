"""Images that do not decode: how every message names one (`image_name`), the one rule for what
stands in for it in a training batch (`stand_in`), the one retry loop when a file's pixels fail
after its header parsed (`Undecodable`, `until_decoded`), the tally that names each once
(`Skipped`), and the errors when none decodes or a loader worker fails (`none_decode`,
`worker_error`).

Training never ends on a bad image, evaluation leaves it out; either way the user learns which file
and why, in one line, however many processes and workers decoded it. Kept apart from the streams
(batches.py, streams.py) and the sources that name images (sources.py), which all use it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch
from rich.markup import escape

from vitcli.errors import DataError, VitcliError, first_line
from vitcli.runtime.metrics import console

T = TypeVar("T")


def image_name(raw: dict, where: str, row: int | None = None) -> str:
    """How every message and tally names one image, `raw` its encoded cell ({"bytes", "path"}) of
    split `where` (sources.origin): by the path of its file where the cell keeps one, else by its
    `row` and split. An image folder's cells hold the path alone; a parquet or Hub cell may keep its
    original file's name beside the bytes, often without its folders, so its row and split follow
    it. A streamed cell has no row number (the shuffle hides it): the split, or a digest of its
    bytes, the same every epoch."""
    path, data = raw.get("path"), raw.get("bytes")
    if path and data is None:
        return path
    at = f"row {row} of {where}" if row is not None else f"in {where}"
    if path:
        return f"{path} ({at})"
    if row is not None:
        return at
    return f"an image {at} (sha1 {hashlib.sha1(data or b'').hexdigest()[:12]})"


class Bad(NamedTuple):
    """An image that did not decode: its name (image_name) and why, in one line."""

    image: str
    reason: str


Tally = dict[str, dict[int | str, Bad]]  # split -> {id: Bad}, as Skipped.rows holds them


class Skipped:
    """Images that did not decode, per split (name -> {id: Bad}; the id is the row, or a stream's
    image name), warned about as their count grows.

    The images come back with their batch from whichever process decoded it, so the tally lives with
    the reader of the stream; an image met again (the next epoch, the next evaluation) counts once.
    `warn=False`: a rank's share of a pass, which inference.in_row_order gathers into a tally that
    warns, so that each image is named once.
    """

    def __init__(self, warn: bool = True) -> None:
        self.rows: Tally = {}
        self.warn = warn

    @property
    def total(self) -> int:
        """Distinct images skipped, over every split."""
        return sum(len(rows) for rows in self.rows.values())

    def add(self, name: str, bad: dict[int | str, Bad]) -> None:
        """Record images of split `name`; warn at the 1st, 2nd, 4th, 8th... so a bad shard cannot
        flood logs."""
        seen = self.rows.setdefault(name, {})
        for key, found in bad.items():
            if key in seen:
                continue
            seen[key] = found
            n = self.total
            if self.warn and n & (n - 1) == 0:
                console.log(f"[yellow]warning: {n} undecodable image{'s' * (n > 1)} skipped so far; "
                            f"{escape(found.image)}: {escape(found.reason)}")

    def as_dict(self) -> dict[str, list[int]]:
        """name -> sorted rows, for json."""
        return {name: sorted(rows) for name, rows in self.rows.items() if rows}


def one_line(e: Exception) -> str:
    """An exception as one line: its type and the first line of its message, less object
    addresses."""
    # PIL names its BytesIO
    return re.sub(r" ?<[^<>]* at 0x[0-9a-f]+>", "", first_line(e, named=True))


class Undecodable(Exception):
    """The image at `position` of a batch opened but its pixels did not decode (a truncated
    file)."""

    def __init__(self, position: int, error: Exception):
        super().__init__(str(error))
        self.position, self.error = position, error


def until_decoded(pick: Callable[[], tuple[list, list]], build: Callable[[list], T],
                  mark_bad: Callable[[object, Exception], None]) -> tuple[list, T]:
    """The one retry loop of every batch: `pick()` gives the ids to use (stand-ins in place of the
    images known bad) and their images, `build(images)` makes the batch; when it raises Undecodable
    (a file whose header parsed but whose pixels did not decode), that image is marked bad
    (`mark_bad(id, error)`) and the batch is picked and built again. Returns (the ids used, the
    batch)."""
    while True:
        ids, images = pick()
        try:
            return ids, build(images)
        except Undecodable as e:
            mark_bad(ids[e.position], e.error)


def stand_in(i: int, n: int, decodes) -> int | None:
    """The one rule for a training image that does not decode: the first position after `i`,
    cyclically among the `n` the stream can reach (map-style: the split's rows; streamed: the
    micro-batch's examples), whose image decodes (`decodes(j)`); None when none does. A function of
    the data alone, so a batch stays a pure function of its key whichever process builds it."""
    return next((j for j in (k % n for k in range(i + 1, i + n)) if decodes(j)), None)


def none_decode(what: str, tried: str, culprit: str, reason: str) -> DataError:
    """The error for images none of which decodes (there is no stand-in), naming one of them and
    why."""
    return DataError(f"no image of {what} decodes ({tried} tried; {culprit}: {reason}); "
                     "repair the image files or use another copy of the data")


def worker_error(e: Exception, name: str) -> Exception:
    """What a keyed dataset's __getitem__ does with an error building a batch of split `name`: in
    this process, re-raise it (the traceback stays intact); in a loader worker, return it as one
    line.

    Returned, not raised: the loader would re-raise it with the worker's traceback in its message.
    BatchStream raises it in the reading process, as the one line the CLI shows."""
    if torch.utils.data.get_worker_info() is None:
        raise e
    return e if isinstance(e, VitcliError) else DataError(
        f"{name}: {one_line(e)} in a data loader worker; data.num_workers=0 shows where")
