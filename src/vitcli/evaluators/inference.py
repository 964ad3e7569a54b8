"""One inference pass over a split, shared by every evaluator (held-out metrics, few-shot features).

Rows are sharded over ranks (rank r reads rows r, r + W, ...), the model runs in eval mode under the
run's autocast, and images that do not decode are left out and counted. Combining the ranks' results
is the caller's: sums add up (heldout.py), per-row results are gathered back into row order
(`in_row_order`: the few-shot features, vit evaluate's predictions).

Whether a split where nothing decodes is an error is decided by all ranks together: a rank whose
share is all corrupt returns nothing and goes on into the caller's gather or reduce with the others,
after which every rank calls `raise_if_nothing_decoded` on the same gathered tallies (one rank
raising alone would leave the others waiting in that collective forever; `in_row_order` does so
itself).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from vitcli.data.batching import batches
from vitcli.data.decoding import bad_images
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.dist import Dist, all_gather
from vitcli.runtime.precision import autocast


@torch.inference_mode()
def sharded_pass(
    model: torch.nn.Module, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str, per_batch,
    skipped: bad_images.Skipped, resize: int = 0, resize_method: str = "big_vision",
) -> list:
    """per_batch(model, i, x, y) for each batch i of this rank's rows, x (B, 3, H, W) and y (B,) on
    the device; the model's train/eval mode is restored after. Rows whose image does not decode land
    in `skipped`; `resize` > 0 selects the few-shot preprocessing (batches.eval_batches). A share
    where images failed and none decoded returns nothing: the caller decides with every rank
    (above)."""
    was_training = model.training
    model.eval()
    # the rank, or 0 for a lone process that torchrun did not start
    share = dist.rank % dist.world_size
    stream = batches.eval_batches(ds, cfg, img_size, cfg.eval_batch_size, share, dist.world_size,
                                  resize=resize, skipped=skipped, resize_method=resize_method,
                                  device=dist.device, collective=True)
    out = []
    # x already on the device (augment.finish)
    for i, (x, y) in enumerate(built_on_one_thread(stream)):
        y = y.to(dist.device, non_blocking=True)
        with autocast(dist.device, precision):
            out.append(per_batch(model, i, x, y))
    model.train(was_training)
    return out


def built_on_one_thread(stream: Iterator) -> Iterator:
    """The stream's batches, each built (decoded and resized, where no loader worker does it) and
    finished on one intra-op thread, as a loader worker builds one; the forward in between keeps the
    process's threads. A batch's ops are small (256 x 3 x 37 x 37 at 32 px) and decoding is serial
    anyway: measured on 2 cores shared with other processes, the quickstart's 32 px batches alone
    took 70-80 us an image on one thread against 98 (the quietest moment) to 340 on two; the whole
    extraction was no slower for it with the cores quiet (4251 against 4138 img/s, the fastest of 8
    turns each)."""
    while True:
        with intra_op_threads(1):
            batch = next(stream, None)
        if batch is None:
            return
        yield batch


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside, the process's own restored after (~0.5
    us)."""
    with contextlib.ExitStack() as restore:
        restore.callback(torch.set_num_threads, torch.get_num_threads())
        torch.set_num_threads(n)
        yield


def raise_if_nothing_decoded(decoded: int, tallies: list[bad_images.Tally]) -> None:
    """The none_decode error when images failed and none decoded on any rank. `decoded` (images
    decoded over all ranks) and `tallies` (every rank's Skipped.rows, in rank order) come from the
    caller's gather or reduce, so every rank decides alike and names the same image."""
    failures = [(name, found)
                for rows in tallies for name, bad in rows.items() for found in bad.values()]
    if decoded == 0 and failures:
        name, found = failures[0]
        raise bad_images.none_decode(name, str(len(failures)), found.image, found.reason)


def in_row_order(arrays: tuple[np.ndarray, ...] | None, skipped_rows: bad_images.Tally, n: int,
                 dist: Dist, skipped: bad_images.Skipped | None = None) -> tuple[np.ndarray, ...] | None:
    """Every rank's per-row `arrays` (each (N_r, ...) over the rows r, r + W, ... of an n-row split
    that decoded; None: it had none) from a sharded_pass -> (rows (N',), *arrays) over the whole
    split in row order, on every rank; None when no rank had a row. Each rank's `skipped_rows`
    (split -> {row: Bad}, a quiet tally's: bad_images.Skipped) join `skipped`, which names each
    image once; images that failed with none decoded anywhere raise, on every rank. A collective
    call."""
    return row_order(all_gather((arrays, skipped_rows), dist), n, skipped)


def row_order(parts: list, n: int,
              skipped: bad_images.Skipped | None = None) -> tuple[np.ndarray, ...] | None:
    """`in_row_order` on the gathered (arrays, skipped rows) of each rank, in rank order."""
    rows: list[int] = []
    for rank, (_, bad) in enumerate(parts):
        gone = {row for reasons in bad.values() for row in reasons}
        rows += [i for i in range(rank, n, len(parts)) if i not in gone]
        for name, reasons in bad.items() if skipped is not None else ():
            skipped.add(name, reasons)
    # every rank alike, on the same tallies
    raise_if_nothing_decoded(len(rows), [bad for _, bad in parts])
    held = [a for a, _ in parts if a is not None]
    if not held:  # an empty split
        return None
    # gathered position -> row order
    order = np.argsort(np.asarray(rows, dtype=np.int64), kind="stable")
    columns = [np.concatenate([a[j] for a in held])[order] for j in range(len(held[0]))]
    return (np.asarray(rows, dtype=np.int64)[order], *columns)
