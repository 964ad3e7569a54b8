"""Training micro-batches streamed from a `datasets.IterableDataset` (data.streaming=true), the
streaming twin of `batches.train_batches`.

Design: one reader, many decoders. The main process reads the raw examples (images still encoded, as
data.load_stream leaves them), groups B of them into a micro-batch key that carries their bytes, and
the DataLoader deals the keys round-robin to `data.num_workers` workers, which only decode and
augment. So the ORDER of examples is HF's alone, a function of (seed, rank, world_size, epoch),
whatever num_workers is; the alternative, HF's own per-worker shard split, would change the order
(and each worker's share) with num_workers and the shard count. "Split by worker" therefore means:
micro-batch k is decoded by worker k % num_workers, each example by exactly one worker. The price:
the reading (arrow, network for a Hub id, the shuffle buffer) happens in the main process, while the
model computes; it is cheap next to decoding.

The order: `IterableDataset.shuffle(seed, shuffle_buffer)` (shards in a new order every epoch,
examples mixed through the buffer), `split_dataset_by_node` (whole shards per rank when their count
is a multiple of world_size, else every world_size-th example), `set_epoch(e)` per pass. The stream
is the concatenation of epochs 0, 1, 2, ... and micro-batch k holds its examples k*B .. k*B+B-1 (a
micro-batch may span two epochs: nothing is dropped, and no epoch length needs to be known in
advance).

Resuming: the position of micro-batch k is (epoch, examples read in that epoch), in the stream's
`state_dict()`, which a checkpoint keeps for every rank. A stream given it back (`load_state_dict`;
or, without it, placed at k by re-reading k*B examples from the start: `seek`) reads the epoch from
its beginning and drops the examples before it: HF cannot restore a shuffle buffer, but it refills
it identically. Skipped examples are never decoded. Augmentation is seeded per micro-batch as for
map-style batches (sampler.micro_seed of the optimizer step and global micro-batch,
sampler.micro_batch), so a resumed stream gives exactly the batches the uninterrupted one gives from
k on.

An image that does not decode is replaced as map-style batches replace it (bad_images.stand_in), by
the next one that does, cyclically, among the examples the stream can reach: its micro-batch (a
stream has no random access to the rest). It is counted in the stream's `skipped` under its name
(bad_images.image_name: its path, or a digest of its bytes), so it counts once however many epochs
meet it.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader

from vitcli.data.augmentation.augment import Normalise
from vitcli.data.augmentation.augmentations import Augmentation
from vitcli.data.augmentation.multicrop import MultiCrop
from vitcli.data.batching.batches import (
    BatchStream,
    KeyedBatches,
    Placed,
    checked_state,
    keyed_loader,
    placeable,
    train_aug,
    train_transform,
)
from vitcli.data.batching.sampler import batch_step, first_sample, micro_batch, micro_seed
from vitcli.data.decoding.bad_images import image_name, none_decode, one_line, stand_in, until_decoded
from vitcli.data.decoding.decode import Encoded, read
from vitcli.data.rows.sources import origin
from vitcli.errors import DataError, VitcliError
from vitcli.recipe.schema import DataConfig

Example = tuple[dict, int]  # (encoded image {bytes, path}, label)


def _read(ids: datasets.IterableDataset, epoch: int, name: str) -> Iterator[dict]:
    """The raw examples of one epoch; a reading error (a damaged shard, the network) as one line."""
    ids.set_epoch(epoch)
    try:
        yield from ids
    except Exception as e:  # arrow, fsspec and HTTP errors: name the stream and the epoch
        if isinstance(e, VitcliError):
            raise
        raise DataError(f"{name}: cannot read epoch {epoch}: {one_line(e)}") from None


def _epochs(ids: datasets.IterableDataset, epoch: int, skip: int, name: str) -> Iterator[tuple[dict, tuple]]:
    """Endless raw examples from `skip` examples into `epoch`, each with the position just after it.

    One example of look-ahead, so the position after an epoch's last example is (epoch + 1, 0): a
    resume from there starts the next epoch instead of re-reading this one to its end.
    """
    while True:
        examples = islice(_read(ids, epoch, name), skip, None)
        current, read = next(examples, None), skip
        if current is None and skip == 0:
            raise DataError(f"{name}: an epoch of this process holds no example (fewer shards or examples "
                            "than processes?); use more data or fewer processes")
        for upcoming in examples:
            read += 1
            yield current, (epoch, read)
            current = upcoming
        epoch, skip = epoch + 1, 0
        if current is not None:
            yield current, (epoch, 0)


def _position(micro_batch: int, at: tuple[int, int]) -> dict:
    return {"micro_batches": micro_batch, "epoch": at[0], "examples": at[1]}


def _keys(examples: Iterator, cfg: DataConfig, batch: int, seed: int, at: tuple[int, int, int],
          positions: deque, by_sample: int = 0, skips: tuple = ()) -> Iterator[tuple]:
    """Endless micro-batch keys (k, augmentation seed, [(encoded image, label)] * B) from this
    rank's micro-batch k, `at` = (k, accum, rank); the position after each key goes to `positions`,
    for the stream to report once the key's batch is out. `by_sample` > 0, the global batch: the
    seed's place holds the run-wide index of the micro-batch's first image (sampler.first_sample),
    for a transform that draws per image (multicrop.py). `skips` (sampler.batch_step): before a
    step's first micro-batch, the examples of the batches skipped since the last step's are read and
    dropped, so the step takes the micro-batches a run without skips takes at its batch step."""
    k, accum, rank = at
    while True:
        step, j = micro_batch(k, accum, rank)
        if k % accum == 0:
            dropped = (batch_step(step, skips) - _after(step, skips)) * accum * batch
            for _ in islice(examples, dropped):
                pass
        step = batch_step(step, skips)
        chunk = list(islice(examples, batch))
        label = cfg.label_column
        rows = [(ex[cfg.image_column], int(ex[label]) if label else 0) for ex, _ in chunk]
        positions.append(_position(k + 1, chunk[-1][1]))
        draws = first_sample(step, j, batch, by_sample) if by_sample else micro_seed(seed, step, j)
        yield k, draws, rows
        k += 1


class _Decode(KeyedBatches):
    """Map-style dataset whose keys are whole micro-batches of encoded images -> (uint8 Pixels, y,
    bad); an image's id in `bad` is its name (bad_images.image_name)."""

    def __init__(self, name: str, transform, binary: bool):
        self.name, self.transform, self.binary = name, transform, binary

    def _open(self, raw: dict) -> Encoded | Exception:
        """The image, still encoded (0/1 images to be stretched), or the exception that stopped
        reading it."""
        try:
            return Encoded(read(raw), self.binary)
        except Exception as e:  # noqa: BLE001 - PIL's errors for corrupt files span OSError, SyntaxError...
            return e

    def _batch(self, step: int, seed: int, rows: list[Example]):
        images = [self._open(raw) for raw, _ in rows]  # an image, or why it did not open

        def failed() -> dict[str, str]:
            return {image_name(rows[i][0], self.name): one_line(e)
                    for i, e in enumerate(images) if isinstance(e, Exception)}

        def pick() -> tuple[list[int], list]:
            good = [i for i, img in enumerate(images) if not isinstance(img, Exception)]
            if not good:
                ident, reason = next(iter(failed().items()))
                raise none_decode(f"micro-batch {step} of {self.name}", str(len(rows)), ident, reason)
            use = [i if i in good else stand_in(i, len(rows), good.__contains__) for i in range(len(rows))]
            return use, [images[i] for i in use]

        def mark_bad(i: int, error: Exception) -> None:  # bad from now on in this micro-batch
            images[i] = error

        # uint8 Pixels
        use, x = until_decoded(pick, lambda chosen: self.transform(chosen, seed), mark_bad)
        return x, torch.tensor([rows[i][1] for i in use], dtype=torch.int64), failed()  # (B,)


class TrainStream(BatchStream):
    """The streamed train stream as a checkpointed part (torchtitan's stateful dataloader). Its
    state is where this rank's next micro-batch starts, {kind: streamed, world_size, micro_batches,
    epoch, examples} (examples read into the epoch): given back, the stream goes on from there
    without reading its share again.

    `start_at(micro_batch, at)` gives the raw examples from a micro-batch on, and where it starts
    (_start)."""

    def __init__(self, loader: DataLoader, keys: Placed, start_at: Callable, positions: deque,
                 world_size: int, device: torch.device | None = None, aug: Augmentation | None = None,
                 normalise: Normalise | None = None):
        super().__init__(loader, device=device, aug=aug, normalise=normalise)
        self.keys, self.start_at, self.positions, self.world_size = keys, start_at, positions, world_size
        self.at = _position(0, (0, 0))
        self.accum = 1  # micro-batches a step: stream_train_batches sets it

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__next__()
        # keys are dealt and their batches return in the same order
        self.at = self.positions.popleft()
        return x, y

    def _place(self, micro_batch: int, at: tuple[int, int] | None) -> None:
        placeable(self)
        # without a saved position: the micro-batches of the batches before (the skipped ones
        # after them are dropped by _keys)
        step, i = divmod(micro_batch, self.accum)
        examples, at = self.start_at(_after(step, self.keys.skips) * self.accum + i, at)
        self.keys.start, self.at = (micro_batch, examples), _position(micro_batch, at)

    def seek(self, micro_batch: int) -> None:
        """Start at this rank's micro-batch `micro_batch` of the run (step x accum) with no saved
        state: the examples before it are read again (not decoded) from the first epoch on."""
        self._place(micro_batch, None)

    def skip(self, skips: tuple) -> None:
        """Skip the batches of these windows of steps from now on (sampler.batch_step); placed
        after."""
        placeable(self)
        self.keys.skips = tuple(skips)

    def rewind(self) -> None:
        super().rewind()
        self.positions.clear()  # of keys drawn ahead for batches never taken

    def state_dict(self) -> dict:
        """Where this rank's next micro-batch starts, json-able."""
        return {"kind": "streamed", "world_size": self.world_size, **self.at}

    def load_state_dict(self, state: dict) -> None:
        """Start where `state_dict` was taken (before the first batch), reading nothing before it.
        An older checkpoint's {step, epoch, examples} (step: micro-batches) is taken as well."""
        if isinstance(state, dict) and sorted(state) == ["epoch", "examples", "step"]:
            at = (state["epoch"], state["examples"])
            state = {"kind": "streamed", "world_size": self.world_size, **_position(state["step"], at)}
        state = checked_state(state, "streamed", self.world_size, ("micro_batches", "epoch", "examples"))
        self._place(state["micro_batches"], (state["epoch"], state["examples"]))


def _after(step: int, skips: tuple) -> int:
    """The batch step after the one step - 1 took (0 for the first step): where the stream stands
    when `step` begins."""
    return batch_step(step - 1, skips) + 1 if step else 0


def _start(ids, batch: int, micro_batch: int, at: tuple[int, int] | None,
           name: str) -> tuple[Iterator, tuple[int, int]]:
    """The raw examples from this rank's micro-batch `micro_batch` on, and where it starts (epoch,
    examples read into it): `at` when known, else found by reading the examples before it again
    (decoding none)."""
    if at is not None:
        return _epochs(ids, at[0], at[1], name), at
    examples, at = _epochs(ids, 0, 0, name), (0, 0)
    for _, at in islice(examples, micro_batch * batch):
        pass
    return examples, at


def stream_train_batches(
    ids: datasets.IterableDataset, cfg: DataConfig, img_size: int, micro_batch_size: int, seed: int,
    start_step: int = 0, rank: int = 0, world_size: int = 1, accum: int = 1,
    device: torch.device | None = None, views: MultiCrop | None = None,
) -> TrainStream:
    """Endless augmented micro-batches (x (B, 3, H, W) normalised on `device`, y (B,) int64) of this
    rank's share of a
    streamed train split (data.load_stream), from micro-batch `start_step` of the uninterrupted
    stream (the examples before are read, not decoded, again from the first epoch on; a checkpoint's
    `load_state_dict` places it without reading them). `accum` micro-batches make an optimizer step
    (they seed the augmentation as map-style batches do). `skipped` counts the images that did not
    decode. `views`: DINO's multi-crop, as batches.train_batches takes it (each image's draws keyed
    by its position in the run's global batches; a stream's images at a position depend on the
    rank split, data.load_stream's)."""
    name = origin(ids)
    # one input shard at a time: HF's interleaving reads shards in threads and sleeps 5 s whenever a
    # pass over parquet ends (apache/arrow#45214), at every epoch and every resume
    shuffled = ids.shuffle(seed=seed, buffer_size=cfg.shuffle_buffer, max_buffer_input_shards=1)
    mine = split_dataset_by_node(shuffled, rank, world_size)
    positions: deque = deque()
    # start: (micro-batch, its raw examples on), as TrainStream places it
    by_sample = micro_batch_size * accum * world_size if views is not None else 0
    keys = Placed(lambda start, skips: _keys(start[1], cfg, micro_batch_size, seed,
                                             (start[0], accum, rank), positions, by_sample, skips),
                  None)
    transform = train_transform(cfg, img_size, seed, device, views)
    decode = _Decode(name, transform, cfg.binary_pixels)
    start_at = functools.partial(_start, mine, micro_batch_size, name=name)
    stream = TrainStream(keyed_loader(decode, keys, cfg.num_workers), keys, start_at, positions, world_size,
                         device, train_aug(cfg, img_size, views), Normalise(cfg.mean, cfg.std))
    stream.accum = accum
    stream.seek(start_step)
    return stream


def throughput(stream: Iterator, n_batches: int) -> float:
    """Images/s a batch stream delivers on its own (reading, decoding, augmentation; no model),
    timed over `n_batches` after one warm-up batch (worker start-up, the first shuffle buffer
    fill)."""
    next(stream)
    t0, images = time.perf_counter(), 0
    for _ in range(n_batches):
        images += len(next(stream)[1])
    return images / (time.perf_counter() - t0)
