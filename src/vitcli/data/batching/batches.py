"""The batch streams the trainer and evaluators read, built on the datasets of data.py.

Training batches are a pure function of (seed, optimizer step, global micro-batch): the epoch order
comes from (seed, epoch) and each micro-batch seeds its own augmentation generator, so a resumed run
that skips `start_step` batches by index arithmetic sees exactly what the uninterrupted run would
have, whatever `num_workers` is, and one process sees what several see between them.

Batches leave the loader workers as uint8 (augment.Pixels: a quarter of float's bytes); the stream
finishes them (augment.finish: resize where still needed, flip, normalise) on its `device`, the
model's.

An image that does not decode never ends a run: training puts the next one that decodes in its place
(`stand_in`: the next row of the split here, the next example of the micro-batch in streams.py), so
batches keep their size and stay that pure function; evaluation leaves it out. Each stream tallies
such images (`Skipped`), coming back with their batch from whichever worker process decoded it, and
names each once as bad_images.image_name names an image everywhere: by its file's path, else its row
and split. Every random draw of a micro-batch, augmentation here and in streams.py, mixup, dropout
and masking in the trainer, is seeded by `micro_seed` from (run seed, optimizer step, global
micro-batch) and its purpose.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator

import datasets
import torch
from torch.utils.data import DataLoader

from vitcli.data.augmentation import augmentations, multicrop
from vitcli.data.augmentation.augment import Normalise, Pixels, finish
from vitcli.data.augmentation.augmentations import Augmentation
from vitcli.data.augmentation.multicrop import MultiCrop, Views
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.batching.sampler import train_keys
from vitcli.data.decoding.bad_images import (
    Bad,
    Skipped,
    image_name,
    none_decode,
    one_line,
    stand_in,
    until_decoded,
    worker_error,
)
from vitcli.data.decoding.decode import Decoded, Encoded, encoded, read
from vitcli.data.decoding.image_cache import CACHE_ENCODED_BYTES, SharedImages, cache_for
from vitcli.data.rows.sources import origin
from vitcli.errors import CheckpointError, DataError
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.launcher import LaunchEnv
from vitcli.runtime.metrics import console


class KeyedBatches(torch.utils.data.Dataset):
    """A map-style dataset whose keys name whole batches (keyed_loader): `_batch(*key)` -> (x, y,
    bad), where an error building a batch in a loader worker comes back as one line
    (worker_error)."""

    name = "the dataset"

    def __getitem__(self, key: tuple):
        try:
            return self._batch(*key)
        except Exception as e:  # noqa: BLE001 - re-raised here, one line from a worker
            return worker_error(e, self.name)

    def image(self, ident) -> str:
        """The name (bad_images.image_name) of the image whose id in a batch's `bad` is `ident`:
        here the id itself."""
        return str(ident)


class _Batches(KeyedBatches):
    """Map-style dataset whose keys are whole batches: (augmentation seed or None, rows) -> (uint8
    Pixels, y, bad).

    `bad` maps each row of the key whose image does not decode to the reason; with `replace`
    (training) the next row that decodes stands in for it, otherwise (evaluation) it is left out.
    With `cache` (image_cache.SharedImages), an image is kept decoded (uint8, whole) after its first
    use, one copy for this process and its workers, while the cache has room. Without it, or for a
    row that found no room, an image is read as bytes and its header, and only its crop is decoded
    (decode.Encoded).
    """

    def __init__(self, ds: datasets.Dataset, cfg: DataConfig, transform, cache: SharedImages | None,
                 replace: bool):
        missing = [c for c in (cfg.image_column, cfg.label_column) if c and c not in ds.column_names]
        if missing:
            raise DataError(f"no column '{missing[0]}' to batch; columns: {', '.join(ds.column_names)}")
        self.column, self.transform, self.replace = cfg.image_column, transform, replace
        self.binary = cfg.binary_pixels  # 0/1 images: stretched to 0/255 as decoded (and so cached)
        self.name = origin(ds)
        self.images = encoded(ds.select_columns([cfg.image_column]), cfg.image_column)
        self.labels = labels(ds, cfg.label_column)  # (N,)
        self.cache = cache
        self.bad: dict[int, str] = {}  # rows found undecodable in this process: never tried twice

    def _open(self, row: int, raw: dict) -> Encoded | Decoded | None:
        """The row's image (encoded; decoded whole when cached), or None with the reason in
        self.bad: a file that fails later, in the transform, is recorded there (Undecodable)."""
        try:
            img = Encoded(read(raw), self.binary)
            return img if self.cache is None or self.cache.full else Decoded(img.full())
        except Exception as e:  # noqa: BLE001 - PIL's errors for corrupt files span OSError, SyntaxError...
            self.bad[row] = one_line(e)
            return None

    def image(self, row: int) -> str:
        """The row's image as messages name it (bad_images.image_name): its file's path, else its
        row and split. Read again when asked, for the few that fail, rather than kept for every
        row."""
        return image_name(self.images[row][self.column], self.name, row)

    def _load(self, rows: list[int]) -> dict[int, Encoded | Decoded]:
        """row -> image for the rows that open; the others land in self.bad."""
        rows = [i for i in dict.fromkeys(rows) if i not in self.bad]
        raws = self.images[rows][self.column] if rows else []  # one arrow take: reads only these
        return {i: img for i, raw in zip(rows, raws) if (img := self._open(i, raw)) is not None}

    def _decoded(self, rows: list[int]) -> dict[int, object]:
        if self.cache is None:
            return self._load(rows)
        found = {i: Decoded(x) for i, x in self.cache.get(rows).items()}
        loaded = self._load([i for i in rows if i not in found])
        self.cache.put({i: img.x for i, img in loaded.items() if isinstance(img, Decoded)})
        return {**found, **loaded}

    def _substitute(self, row: int, images: dict) -> int:
        """The row standing in for `row` over the whole split (stand_in); its image joins `images`.
        The walk is cheap: rows found bad are never decoded again."""

        def decodes(j: int) -> bool:
            found = images[j] if j in images else self._decoded([j]).get(j)
            if found is not None:
                images[j] = found
            return found is not None

        n = len(self.labels)
        j = stand_in(row, n, decodes)
        if j is None:
            raise none_decode(self.name, f"{n} rows", self.image(row), self.bad[row])
        return j

    def _batch(self, seed: int | None, rows: list[int]) -> tuple[Pixels | None, torch.Tensor, dict[int, str]]:
        def pick() -> tuple[list[int], list]:
            images = self._decoded(rows)
            if self.replace:
                # A stand-in rather than a shorter batch: the micro-batch keeps its size (mixup
                # pairs rows, the loss is a mean per micro-batch, DDP ranks step together), the
                # augmentation draws stay.
                use = [i if i in images else self._substitute(i, images) for i in rows]
            else:
                # evaluation: a stand-in would count an image twice
                use = [i for i in rows if i in images]
            return use, [images[i] for i in use]

        def mark_bad(row: int, error: Exception) -> None:  # bad from now on: never tried again
            self.bad[row] = one_line(error)

        use, x = until_decoded(pick, lambda chosen: self.transform(chosen, seed) if chosen else None,
                               mark_bad)
        bad = {i: self.bad[i] for i in rows if i in self.bad}
        return x, self.labels[use], bad  # uint8 Pixels of B, (B,)


class BatchStream:
    """(x, y) batches of a loader; tallies the images each batch skipped, raises an error a worker
    returned."""

    def __init__(self, loader: DataLoader, skipped: Skipped | None = None, device: torch.device | None = None,
                 collective: bool = False, aug: Augmentation | None = None,
                 normalise: Normalise | None = None):
        self.loader, self.name = loader, loader.dataset.name
        self._batches: Iterator | None = None  # begun at the first batch (`batches`)
        self.image = loader.dataset.image  # names a skipped image here, whichever process decoded
        self.skipped = skipped if skipped is not None else Skipped()
        self.device = device if device is not None else torch.device("cpu")
        self.aug = aug  # the recipe's augmentation, what of it each batch's draws leave to `finish`
        # data.mean and data.std ([-1, 1] when None), applied by `finish`
        self.normalise = normalise
        # collective: a pass where nothing decoded ends quietly; the caller decides with the other
        # ranks (nothing_decoded), since one rank raising alone would leave the others waiting in a
        # gather
        self.collective = collective
        self.decoded = self.failed = 0  # images of this pass
        # micro-batches after which every image is decoded from a cache (train_batches sets it): the
        # wait before is the first epochs' decoding, which a run's later steps never see again
        self.warm_after = 0

    def __iter__(self) -> BatchStream:
        return self

    @property
    def batches(self) -> Iterator:
        """The loader's batches, begun (workers started, keys drawn) when first asked for: until
        then a train stream can still be placed (its `seek` and `load_state_dict`)."""
        if self._batches is None:
            self._batches = iter(self.loader)
        return self._batches

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x float32 (B, 3, S, S) normalised on the stream's device, y (B,) int64 on the CPU); a
        multi-crop stream's x is (globals (2B, 3, S, S), locals (nB, 3, s, s)): Views.finish."""
        for item in self.batches:
            if isinstance(item, Exception):
                # Let go of the loader now: its workers stop at once. Kept alive by the traceback,
                # it would be torn down later by the garbage collector, in an order that costs 5 s
                # per worker.
                self._batches = iter(())
                raise item
            x, y, bad = item
            if len(y) and isinstance(x, Views):
                x = x.finish(self.device, self.normalise)
            elif len(y):
                x = finish(x, self.device, self.aug, self.normalise)
            self.skipped.add(self.name, self._named(bad))
            self.decoded, self.failed = self.decoded + len(y), self.failed + len(bad)
            if len(y):
                return x, y
        if self.failed and not self.decoded and not self.collective:
            raise self.nothing_decoded()
        raise StopIteration

    def rewind(self) -> None:
        """Let the loader's batches go (its workers stop), so that the stream can be placed again
        (a rollback past a loss spike: checkpoints.manager.CheckpointManager.roll_back)."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def _named(self, bad: dict[int | str, str]) -> dict[int | str, Bad]:
        """A batch's {id: reason} -> {id: Bad}; an image already in the tally is not named again."""
        seen = self.skipped.rows.get(self.name, {})
        return {i: seen.get(i) or Bad(self.image(i), reason) for i, reason in bad.items()}

    def nothing_decoded(self) -> DataError:
        """The error for a pass in which images failed and none decoded, naming the first that
        failed."""
        first = next(iter(self.skipped.rows[self.name].values()))
        return none_decode(self.name, str(self.failed), first.image, first.reason)


class Placed:
    """A train loader's keys from where its stream was placed (`start`): `make(start, skips)` gives
    them, called only when the loader begins (BatchStream.batches), so a stream placed before its
    first batch begins there and never draws a key before it. `skips`: the windows of steps whose
    batches the run skips (sampler.batch_step), set with the place."""

    def __init__(self, make: Callable[[object, tuple], Iterator], start: object):
        self.make, self.start, self.skips = make, start, ()

    def __iter__(self) -> Iterator:
        return self.make(self.start, self.skips)


def placeable(stream: BatchStream) -> None:
    """Refuse to place a train stream that has begun: its loader has drawn its keys."""
    if stream._batches is not None:
        raise RuntimeError(f"the train stream of {stream.name} is placed before its first batch, not after")


def checked_state(state: dict, kind: str, world_size: int, keys: tuple[str, ...]) -> dict:
    """A train stream's saved state (its `state_dict`), refused unless a stream of this `kind` wrote
    it under `world_size` processes with every one of `keys`: a state for another rank split would
    start elsewhere."""
    if not isinstance(state, dict) or state.get("kind") != kind or any(k not in state for k in keys):
        raise CheckpointError(f"the train stream's saved state {state!r} is not a {kind} stream's "
                              f"({', '.join(keys)})")
    if state["world_size"] != world_size:
        raise CheckpointError(f"the train stream's saved state was written by {state['world_size']} "
                              f"process(es), this run has {world_size}")
    return state


class MappedTrainStream(BatchStream):
    """The map-style train stream as a checkpointed part (torchtitan's stateful dataloader). Its
    state is the count of micro-batches this rank has taken, {kind: mapped, world_size,
    micro_batches}: its keys are a function of that count alone (sampler.train_keys), so the state
    only confirms what the step implies."""

    def __init__(self, loader: DataLoader, keys: Placed, world_size: int, device: torch.device | None = None,
                 aug: Augmentation | None = None, normalise: Normalise | None = None):
        super().__init__(loader, device=device, aug=aug, normalise=normalise)
        self.keys, self.world_size, self.micro_batches = keys, world_size, keys.start

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = super().__next__()
        self.micro_batches += 1
        return batch

    def seek(self, micro_batch: int) -> None:
        """Start at this rank's micro-batch `micro_batch` of the run (step x accum): index
        arithmetic."""
        placeable(self)
        self.keys.start = self.micro_batches = micro_batch

    def skip(self, skips: tuple) -> None:
        """Skip the batches of these windows of steps from now on (sampler.batch_step)."""
        placeable(self)
        self.keys.skips = tuple(skips)

    def state_dict(self) -> dict:
        """Where this rank's next micro-batch is, json-able."""
        return {"kind": "mapped", "world_size": self.world_size, "micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict) -> None:
        """Start where `state_dict` was taken (before the first batch)."""
        self.seek(checked_state(state, "mapped", self.world_size, ("micro_batches",))["micro_batches"])


def labels(ds: datasets.Dataset, column: str) -> torch.Tensor:
    """The label column as int64 (N,); zeros for unlabeled images (data.label_column="", for
    mpp)."""
    if not column:
        return torch.zeros(len(ds), dtype=torch.int64)
    # through arrow: 8 ms for ImageNet's 1.28M labels, where the numpy format took 0.42 s (twice a
    # start)
    values = ds.select_columns([column]).with_format("arrow")[:][column]  # (N,) pa.ChunkedArray
    return torch.tensor(values.to_numpy(), dtype=torch.int64)


def _ignore_interrupts(worker_id: int) -> None:
    """A terminal's Ctrl-C reaches the whole process group; the main process decides when to stop,
    and it may still need this worker's batches to finish the step it is in."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _loader(ds: datasets.Dataset, cfg: DataConfig, transform, keys: Iterable, cache: SharedImages | None,
            replace: bool):
    return keyed_loader(_Batches(ds, cfg, transform, cache, replace), keys, cfg.num_workers)


def keyed_loader(dataset: KeyedBatches, keys: Iterable, workers: int) -> DataLoader:
    """A loader over a dataset whose keys name whole batches (this module's and streams.py's).

    batch_size=None: each key already names a whole batch; one iterator spans all epochs, so the
    workers persist for the whole run. Our own generator: the loader would otherwise draw its worker
    base seed from the global torch RNG and shift the trainer's dropout/init streams."""
    return DataLoader(
        dataset, batch_size=None, sampler=keys, num_workers=workers,
        generator=torch.Generator().manual_seed(0), pin_memory=torch.cuda.is_available(),
        prefetch_factor=4 if workers else None, worker_init_fn=_ignore_interrupts if workers else None,
    )


def train_batches(
    ds: datasets.Dataset, cfg: DataConfig, img_size: int, micro_batch_size: int, seed: int,
    start_step: int = 0, rank: int = 0, world_size: int = 1, accum: int = 1,
    device: torch.device | None = None, views: MultiCrop | None = None,
) -> MappedTrainStream:
    """Endless augmented micro-batches (x (B, 3, H, W) normalised on `device`, finished there by
    augment.finish; y (B,) int64) for this rank, `accum` per
    optimizer step, starting at this rank's micro-batch `start_step` of the uninterrupted stream
    (skipped batches are never loaded; a checkpoint places it instead: MappedTrainStream). The
    stream's `skipped` counts the images that did not decode (each replaced by the next row that
    does). `views`: DINO's multi-crop instead of the data section's augmentation, x = (globals
    (2B, 3, S, S), locals (nB, 3, s, s)), each image's crops drawn from (seed, its index in the
    run) (multicrop.py)."""
    global_batch = micro_batch_size * accum * world_size
    if len(ds) < global_batch:
        raise DataError(
            f"train split has {len(ds)} images: fewer than one batch of {global_batch} ({micro_batch_size} x "
            f"{accum} micro-batches x {world_size} process(es)); lower data.batch_size"
        )
    by_sample = views is not None  # multi-crop: keys carry sample indices (train_keys)
    keys = Placed(lambda start, skips: train_keys(
        len(ds), micro_batch_size, accum, seed, start, rank, world_size, cfg.repeated_aug,
        by_sample=by_sample, skips=skips), start_step)
    transform = train_transform(cfg, img_size, seed, device, views)
    cache, on_disk = cache_for(encoded(ds.select_columns([cfg.image_column]), cfg.image_column),
                               cfg.image_column, cache_capacity(cfg))
    loader = _loader(ds, cfg, transform, keys, cache=cache, replace=True)
    stream = MappedTrainStream(loader, keys, world_size, device, train_aug(cfg, img_size, views),
                               Normalise(cfg.mean, cfg.std))
    stream.cache = cache
    if rank == 0:
        console.log(cache_line(cfg, cache, on_disk, len(ds)))
    if cache is not None:  # decoded once for all workers: waits are judged once every image is
        # an epoch of repeated augmentation reads about 1 / repeated_aug of the rows
        stream.warm_after = len(ds) // (micro_batch_size * world_size) * cfg.repeated_aug
    return stream


def train_transform(cfg: DataConfig, img_size: int, seed: int, device: torch.device | None,
                    views: MultiCrop | None):
    """The loader workers' transform of a training stream: transforms.build_transform's, or with
    `views` the multi-crop one (keyed by sample index: train_keys' by_sample)."""
    if views is not None:
        return multicrop.transform(views, seed)
    return build_transform(cfg, img_size, train=True, resize_here=resize_in_workers(device))


def train_aug(cfg: DataConfig, img_size: int, views: MultiCrop | None) -> Augmentation | None:
    """What of the data section's augmentation `finish` applies: none in a multi-crop stream."""
    return None if views is not None else augmentations.of(cfg, img_size)


def cache_capacity(cfg: DataConfig) -> int:
    """Bytes of decoded pixels this training process and its workers may keep: data.cache_mb shared
    by the training processes on this host (torchrun's LOCAL_WORLD_SIZE), so the host holds at most
    data.cache_mb."""
    return cfg.cache_mb * 2**20 // max(1, LaunchEnv.read().local_world_size)


def cache_line(cfg: DataConfig, cache: SharedImages | None, on_disk: int, rows: int) -> str:
    """The log line that says whether training keeps images decoded, and why."""
    if cfg.cache_mb <= 0:
        return "decoded-image cache: off (data.cache_mb=0)"
    if cache is None:
        limit = min(CACHE_ENCODED_BYTES, cache_capacity(cfg)) / 2**20
        return (f"decoded-image cache: off: the train images take more than {limit:.0f} MiB on disk; each "
                "crop is decoded from its file (at reduced scale where it allows)")
    return (f"decoded-image cache: on: {rows} images of {on_disk / 2**20:.1f} MiB on disk, kept decoded "
            f"once for all loader workers, at most {cache.capacity / 2**20:.0f} MiB (data.cache_mb)")


def eval_batches(
    ds: datasets.Dataset, cfg: DataConfig, img_size: int, batch_size: int, rank: int = 0, world_size: int = 1,
    resize: int = 0, skipped: Skipped | None = None, resize_method: str = "big_vision",
    device: torch.device | None = None, collective: bool = False,
) -> BatchStream:
    """Deterministic eval batches (x on `device`, y on the CPU) over rows rank, rank + world_size,
    ... (the last may be short); `resize` > 0 selects the few-shot preprocessing (squash to resize x
    resize with `resize_method`, centre crop img_size). Images that do not decode are left out and
    recorded in `skipped` (a caller's tally that outlives this pass, or a new one). A pass where
    nothing decodes raises, unless `collective` (BatchStream.collective)."""
    rows = list(range(rank, len(ds), world_size))
    keys = [(None, rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
    transform = build_transform(cfg, img_size, train=False, resize=resize, resize_method=resize_method)
    loader = _loader(ds, cfg, transform, keys, cache=None, replace=False)
    return BatchStream(loader, skipped, device, collective, normalise=Normalise(cfg.mean, cfg.std))


# Whether the loader workers resize the training crops and run the uint8 augmentation (RandAugment,
# 3-Augment), on every device. Measured on one H100 (make gpu-check's `augmentation`, batch 256 at
# 224 of photographs of 375-640 px): shipping whole crops and doing that work on the GPU took 9.7 ms
# (crop + flip) and 20.3 ms (DeiT's recipe) of GPU and launch time per micro-batch, 28% and 59% of a
# ViT-S/16 step; resized in the workers, 1.3 and 2.4 ms (the copy is 12x smaller, and the main
# thread launches no per-op kernels). The route stays a switch (the same functions either way) for
# gpu_check to compare.
RESIZE_IN_WORKERS = True


def resize_in_workers(device: torch.device | None) -> bool:
    """Whether a training stream for a model on `device` resizes in its workers (RESIZE_IN_WORKERS;
    always on the CPU, where the workers share out the work the main process would do alone)."""
    return RESIZE_IN_WORKERS or device is None or device.type == "cpu"
