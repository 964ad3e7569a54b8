"""Whether a run is input-bound: the time the loop waits for its next batch, and what to do when it
is high.

The wait is timed around `next(stream)` on the host alone, with no device sync (the loop avoids
them). On CUDA the host runs ahead of the GPU, so a wait measured this way is time in which the GPU
still had queued work only while that queue lasts: a wait long enough to matter drains it, and then
it is the GPU's idle time too. A high fraction is therefore an honest "the data did not keep up", a
low one may hide a little idling.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from vitcli.recipe.schema import Recipe

INPUT_BOUND = 0.10  # past this fraction of a logging window spent waiting, the run says so (once)


class Waited:
    """An iterator over `stream` that adds the seconds each next() took to `seconds`."""

    def __init__(self, stream: Iterator):
        self.stream, self.seconds = stream, 0.0

    def __iter__(self) -> Waited:
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.stream)
        finally:
            self.seconds += time.perf_counter() - t0

    def take(self) -> float:
        """The seconds waited since the last take()."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class Feeding:
    """What the advice of `input_bound` depends on besides the rates: the loader workers and the
    data (`prepared`: `vit prepare-data`'s copy already; `builtin`: the synthetic data, drawn as
    PNGs)."""

    num_workers: int
    prepared: bool = False
    builtin: bool = False


def feeding(r: Recipe) -> Feeding:
    """The recipe's Feeding."""
    # here, not at the top: data.rows imports datasets, which the loop's importers (a micro-batch
    # trial) need not
    from vitcli.data.rows.sources import source_kind

    kind, _ = source_kind(r.data.source)
    return Feeding(r.data.num_workers, prepared=kind == "prepared", builtin=kind == "synthetic")


# a loader below this multiple of the model's rate is not called faster ("1.0x faster")
FASTER = 1.1


def input_bound(wait_s: float, total_s: float, images: int, feeding: Feeding) -> str | None:
    """The warning for logging windows of `total_s` seconds that waited `wait_s` of them for
    `images` images, or None while the wait is at most INPUT_BOUND of the windows.

    The model's rate is what the loop did with the time it did not wait (images / the non-wait
    seconds). The loader's: with num_workers=0 it decodes inside next(), so images / the wait; with
    workers it decodes all the time in the background and the loop took every batch it made, so
    images / the whole window (the time spent waiting alone would flatter it), below the model's.
    Without workers the loader may well be the faster one and still cost the run its wait: decoding
    then never overlaps the model. Only knobs that apply are offered: no `vit prepare-data` for data
    that is prepared or built in."""
    if total_s <= 0 or wait_s / total_s <= INPUT_BOUND:
        return None
    f = feeding
    loader = images / max(wait_s if f.num_workers == 0 else total_s, 1e-9)
    model = images / max(total_s - wait_s, 1e-9)
    # without workers a loader faster than the model still costs its whole time: it runs between the
    # steps (the quickstart on 2 cores: 4x faster, 8% of the run); a worker overlaps it only where a
    # core is idle
    knobs = [f"data.num_workers=1 or more (now 0: the loader, {loader / model:.1f}x faster than the model, "
             "runs between its steps; a worker runs beside them where a core is free)"
             if f.num_workers == 0 and loader >= FASTER * model else
             f"more data.num_workers (now {f.num_workers})"]
    if not (f.prepared or f.builtin):
        knobs.append("`vit prepare-data` (a copy of the data resized once, so each image decodes smaller)")
    return (f"input-bound: {wait_s / total_s:.0%} of the time went waiting for data; the loader delivered "
            f"{loader:.0f} img/s while the model could take {model:.0f} img/s. Try "
            + ", ".join(knobs))
