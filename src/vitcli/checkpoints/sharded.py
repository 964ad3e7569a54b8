"""The sharded checkpoint format (run.strategy: fsdp): the directory `WORKDIR/state-<step>/`.

Each process writes its own shard with torch.distributed.checkpoint (DCP), which also reads them
back into any number of processes, sharded or not, so a run may resume on another process count. The
non-tensor part (step, recipe, data position) sits beside the shards as extra.json (its tensors in
extra.safetensors), so reading it never unpickles; a SHA256SUMS manifest seals the whole directory
(files.atomic_dir). Where it lives among the others, and when it is written, is checkpoints.state's
and checkpoints.manager's business.

DCP is imported by the functions that write and load shards, not with this module: the checkpoint
manager imports it for every run, and importing DCP takes seconds (12.8 s measured under load) that
a run without shards would spend for nothing. Reading and verifying the extra part needs no DCP.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as torch_dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from vitcli.errors import CheckpointError, first_line
from vitcli.runtime import files
from vitcli.runtime.dist import Dist, barrier

# what a sharded checkpoint's extra part must hold; its tensors are DCP's
SHARDED_KEYS = ("step", "recipe")
EXTRA_JSON, EXTRA_TENSORS = "extra.json", "extra.safetensors"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
# a sharded checkpoint without one is incomplete
SHARDED_FILES = (DCP_METADATA, EXTRA_JSON, EXTRA_TENSORS)
# DCP's warning on each save and load of a one-process run
_SINGLE_PROCESS = "torch.distributed is disabled"
# extra.json's stand-in for a tensor kept in extra.safetensors: {"__tensor__": "t0"}
_TENSOR = "__tensor__"


def write(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, dist: Dist,
          states: dict[str, dict] | None = None, fail: Callable[[Path], None] | None = None) -> Path:
    """Write the directory `path`: every process its shard of the model and optimizer (and of
    `states`, more state dicts laid out like the model's: the weight EMA), rank 0 `extra`. Every
    process calls it.

    Into a temporary directory first; after a barrier (every shard written) rank 0 adds `extra` and
    seals it (SHA256SUMS, fsync, one rename, files.atomic_dir), so `path` exists only whole. Write
    after an optimizer step: an optimizer without state would get one from torch's step at lr 0
    (Adam's count at 1). `fail`: the faults met once rank 0's files are written (writer.injected).
    """
    import torch.distributed.checkpoint as dcp  # here, not above: see the module's docstring

    sealing = files.atomic_dir(path) if dist.is_main else contextlib.nullcontext()
    with sealing as tmp:
        tmp = _rank0_path(tmp, dist)
        # DCP's own waits for the slowest writer on `control` too, as runtime.dist.barrier says why
        with _single_process_is_intended():
            dcp.save(_tensors(model, optimizer, states), checkpoint_id=tmp, process_group=dist.control,
                     no_dist=dist.world_size == 1)
        barrier(dist)
        if dist.is_main:
            _write_rest(tmp, extra, fail)
    return path


def write_async(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict, dist: Dist,
                group, states: dict[str, dict] | None = None,
                fail: Callable[[Path], None] | None = None, stager=None) -> Callable[[], Path]:
    """`write`, with DCP's async_save: the shards are staged into host memory now (every process
    calls it), and written by DCP's thread; the returned `finish` (for the writer's thread) waits
    for them, then on rank 0 adds `extra` and seals the directory as `write` does; it returns `path`.

    `group`: a Gloo group of the checkpoint's own, not Dist.control: DCP's thread runs its
    collectives while the loop runs its own on `control`, and two threads' collectives on one group
    may interleave differently on different ranks (torchtitan keeps a group apart for the same
    reason). `stager`: DCP's (pinned buffers on CUDA), None for its default. No barrier is needed
    before sealing: DCP's future completes on each rank only after its coordinator gathered every
    rank's result and wrote the index (.metadata).
    """
    import torch.distributed.checkpoint as dcp  # here, not above: see the module's docstring

    sealing = contextlib.ExitStack()
    tmp = sealing.enter_context(files.atomic_dir(path)) if dist.is_main else None
    try:
        tmp = _rank0_path(tmp, dist)
        # DCP warns from its own thread, where no catch_warnings of this one reaches: for good
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        future = dcp.async_save(_tensors(model, optimizer, states), checkpoint_id=tmp,
                                process_group=group, no_dist=dist.world_size == 1, async_stager=stager)
    except BaseException as e:
        sealing.__exit__(type(e), e, e.__traceback__)  # the temporary directory goes, unsealed
        raise

    def finish() -> Path:
        with sealing:  # sealed and renamed if all went well, removed if not
            future.result()
            if dist.is_main:
                _write_rest(tmp, extra, fail)
        return path

    return finish


def _tensors(model: nn.Module, optimizer: torch.optim.Optimizer, states: dict[str, dict] | None) -> dict:
    """What DCP writes: the model's and the optimizer's state dicts as DCP lays them out, and
    `states`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP's: see the docstring

    model_state, optim_state = get_state_dict(model, optimizer)
    return {**(states or {}), "model": model_state, "optimizer": optim_state}


def _write_rest(tmp: Path, extra: dict, fail: Callable[[Path], None] | None) -> None:
    """Rank 0's part of a checkpoint directory before it is sealed: `extra`, and the faults met."""
    write_extra(tmp, extra)
    if fail is not None:
        fail(tmp / EXTRA_TENSORS)


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """Without DCP's warning on each save and load of a one-process run ("assuming the intent is to
    save in a single process"): it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield


def _rank0_path(path: Path | None, dist: Dist) -> Path:
    """Rank 0's temporary directory, made known to every process."""
    if dist.world_size == 1:
        return path
    box = [str(path) if dist.is_main else None]
    torch_dist.broadcast_object_list(box, src=0, group=dist.control)
    return Path(box[0])


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group=None,
         states: dict[str, dict] | None = None) -> dict:
    """Read the checkpoint directory `path` into the live model and optimizer (already sharded as
    they will train, on any number of processes), and `states` (as `write` took them) in place;
    return its extra part. Every process calls it; DCP's waits for the slowest reader go through
    `group` (Dist.control: on the CPU, not under NCCL's watchdog).

    The manifest is verified first, so no damaged byte is read; DCP's own index (.metadata) is a
    pickle, read only once its checksum matches. The tensors load in place through DCP, which
    reshards them as needed.
    """
    import torch.distributed.checkpoint as dcp  # here, not above: see the module's docstring
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    extra = verified_extra(path)
    # the layout to fill; an optimizer without state (a fresh one) first gets it from a step at lr 0
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {**(states or {}), "model": model_state, "optimizer": optim_state}
    try:
        with _single_process_is_intended():
            dcp.load(loaded, checkpoint_id=path, process_group=group,
                     no_dist=not torch_dist.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's own is a BaseException
        # model, ema and optimizer
        parts = " and ".join([", ".join(["model", *(states or {})]), "optimizer"])
        raise CheckpointError(f"{path}: does not fit this {parts} ({_first_failure(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    return extra


def _first_failure(error: BaseException) -> str:
    """`Type: message` of the first rank's error that a CheckpointException carries (its str is a
    traceback per rank), or of the error itself; first line only."""
    from torch.distributed.checkpoint.api import CheckpointException  # imported already by `load`

    if isinstance(error, CheckpointException) and error.failures:
        error = error.failures[min(error.failures)][0]
    return first_line(error, named=True)


def write_extra(directory: Path, extra: dict) -> None:
    """The non-tensor part of a sharded checkpoint (step, recipe, data position), so that reading it
    never unpickles: plain data as extra.json, any tensors in it (an older run's RNG byte tensors)
    in extra.safetensors."""
    tensors: dict[str, torch.Tensor] = {}
    plain = _split_tensors(extra, tensors)
    save_file(tensors, str(Path(directory) / EXTRA_TENSORS))
    (Path(directory) / EXTRA_JSON).write_text(json.dumps(plain, indent=1) + "\n")


def _split_tensors(obj, tensors: dict[str, torch.Tensor]):
    """`obj` with each tensor moved into `tensors` under a fresh name and replaced by {_TENSOR:
    name}."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        # clone: safetensors refuses shared storage
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {_TENSOR: name}
    if isinstance(obj, dict):
        return {k: _split_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, tensors) for v in obj]
    return obj


def read_extra(directory: Path) -> dict:
    """What write_extra wrote, tensors back in place; a CheckpointError naming the file it cannot
    read."""
    directory = Path(directory)
    try:
        tensors = load_file(str(directory / EXTRA_TENSORS))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{directory / EXTRA_TENSORS}: not a readable safetensors file ({e})") from None
    try:
        plain = json.loads((directory / EXTRA_JSON).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory / EXTRA_JSON}: not readable JSON ({e})") from None
    return _join_tensors(plain, tensors, directory)


def _join_tensors(obj, tensors: dict[str, torch.Tensor], directory: Path):
    if isinstance(obj, dict) and set(obj) == {_TENSOR}:
        if obj[_TENSOR] not in tensors:
            raise CheckpointError(f"{directory / EXTRA_TENSORS}: no tensor {obj[_TENSOR]}, "
                                  f"which {EXTRA_JSON} names")
        return tensors[obj[_TENSOR]]
    if isinstance(obj, dict):
        return {k: _join_tensors(v, tensors, directory) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors, directory) for v in obj]
    return obj


def verified_extra(path: Path) -> dict:
    """The extra part of a sharded checkpoint whose manifest verifies and which holds every file and
    key."""
    listed = files.verify_manifest(path)
    absent = [name for name in SHARDED_FILES if name not in listed]
    if absent:
        raise CheckpointError(f"{path}: not a complete sharded state (no {', '.join(absent)})")
    extra = read_extra(path)
    missing = [k for k in SHARDED_KEYS if k not in extra]
    if missing:
        raise CheckpointError(f"{path}: not a complete training state "
                              f"(no {', '.join(missing)} in {EXTRA_JSON})")
    return extra
