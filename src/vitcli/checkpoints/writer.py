"""The checkpoint writer (run.ckpt_async): the loop pays for staging a checkpoint's state, a thread
pays for its I/O (torchtitan's async checkpointing, DCP's async_save).

Staging copies every tensor of the state into buffers of this writer's own (`Staging`): pinned host
memory when the tensor is on CUDA (the copy runs at the bus's speed and does not block the device's
stream), plain CPU tensors otherwise. The buffers are kept and refilled at each checkpoint, so after
the first one staging allocates nothing: a memcpy per tensor is most of the stall. Then a thread
writes, checksums and rotates (`Writer.submit`), while training goes on from the live tensors.

At most one write is in flight: the next checkpoint first waits for the previous one (its buffers
are refilled, and the two writes' rotations must not interleave). A write that fails is not raised
in the thread: its one line (`Failure`) waits for the training process, which reads it at the next
checkpoint or at the end (checkpoints.manager decides what a failure does to the run). With
run.ckpt_async=false the same job runs in the caller, on the live tensors, as before: the
measurement's baseline (make bench).

The thread is not a daemon: a process that ends while a write is in flight finishes the write first
(the loop waits for it anyway, on every way out: CheckpointManager.writing).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from vitcli.errors import first_line
from vitcli.runtime import faults
from vitcli.runtime.dist import Dist

# `faults.armed` kinds met while a checkpoint is written (see `injected`)
WRITE_FAULTS = ("enospc", "kill_write")


@dataclass(frozen=True)
class Failure:
    """A checkpoint write that failed: its one line (the file, the error), and whether the run may
    go on and write the next one (an OSError: a full disk, a lost mount), or not (a bug)."""

    line: str
    transient: bool


class Writer:
    """Runs checkpoint writes one at a time, in a background thread (`background`) or in the
    caller; keeps the seconds they took and the failure of the last one."""

    def __init__(self, background: bool):
        self.background = background
        self.seconds = 0.0  # spent writing, in whichever thread wrote
        self._thread: threading.Thread | None = None
        self._failure: Failure | None = None

    def submit(self, job: Callable[[], None], path: Path) -> None:
        """Run `job`, the write of `path`, after the write in flight (if any) ended; in the
        background or now. Its failure is kept for `wait`."""
        self.wait_quietly()
        if not self.background:
            self._run(job, path)
            return
        self._thread = threading.Thread(
            target=self._run, args=(job, path), name=f"write {path.name}"
        )
        self._thread.start()

    def wait(self) -> Failure | None:
        """Wait for the write in flight; return the failure of the last write (once), or None."""
        self.wait_quietly()
        failure, self._failure = self._failure, None
        return failure

    def wait_quietly(self) -> None:
        """Wait for the write in flight, keeping its failure for `wait`."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self, job: Callable[[], None], path: Path) -> None:
        t0 = time.perf_counter()
        try:
            job()
        except OSError as e:  # the disk's, the mount's: `path` and the error, strerror and all
            self._failure = Failure(
                f"{path}: could not be written ({first_line(e, named=True)})", True
            )
        except Exception as e:  # noqa: BLE001 - any other is raised in the training process, once
            self._failure = Failure(
                f"{path}: could not be written ({first_line(e, named=True)})", False
            )
        finally:
            self.seconds += time.perf_counter() - t0


class Staging:
    """Copies of a state's tensors, into buffers kept from one checkpoint to the next; for a sharded
    state (DCP's async_save), the process group and the stager its writes use."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._group = None
        self._dcp_stager = None

    def stage(self, state):
        """`state` (nested dicts, lists, tuples; tensors, numbers, strings) with every tensor
        replaced by its copy in host memory, landed; what is not a tensor is rebuilt, not
        shared."""
        staged = self._stage(state, ())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies from the device (non_blocking) landed
        return staged

    def _stage(self, state, key: tuple):
        if isinstance(state, torch.Tensor):
            return self._copy(state.detach(), key)
        if isinstance(state, dict):
            return {k: self._stage(v, (*key, k)) for k, v in state.items()}
        if isinstance(state, list | tuple):
            return type(state)(self._stage(v, (*key, i)) for i, v in enumerate(state))
        return state

    def _copy(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        held = self._buffers.get(key)
        if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
            pinned = tensor.is_cuda  # pinned: the copy from the device runs at the bus's speed
            held = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
            self._buffers[key] = held
        held.copy_(tensor, non_blocking=tensor.is_cuda)
        return held

    def group(self, dist: Dist):
        """The Gloo group of the sharded writes' collectives (sharded.write_async says why one of
        their own), made at the first (every rank is there); None with one process."""
        if self._group is None and dist.world_size > 1:
            self._group = torch_dist.new_group(backend="gloo")
        return self._group

    def dcp_stager(self, device: torch.device):
        """DCP's stager for async_save: into pinned buffers it keeps, on CUDA; None (DCP's default,
        plain host copies) on a CPU."""
        if self._dcp_stager is None and device.type == "cuda":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # DCP's

            self._dcp_stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=True,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=True,
                )
            )
        return self._dcp_stager

    def close(self) -> None:
        """The buffers freed, DCP's stager's too (the run's last checkpoint is written: the final
        evaluation and weights need the memory more)."""
        self._buffers.clear()
        if self._dcp_stager is not None:
            self._dcp_stager.close()
            self._dcp_stager = None


def injected(step: int, rank: int, workdir: Path) -> Callable[[Path], None]:
    """The faults (runtime.faults) met inside the write of step `step`'s checkpoint, given its
    temporary file once its bytes are there: `enospc` cuts the file to half and raises ENOSPC (a
    disk that filled up during the write); `kill_write` cuts it to half and SIGKILLs the process (a
    node lost during the write)."""

    def meet(tmp: Path) -> None:
        for kind in WRITE_FAULTS:
            if faults.armed(kind, step, rank, workdir):
                os.truncate(tmp, os.path.getsize(tmp) // 2)
                if kind == "kill_write":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    return meet


def damage(path: Path) -> None:
    """The `corrupt` fault: flip bytes in the middle of a written checkpoint (of a directory's
    largest file), after its checksum (a disk that went bad): resume must find it damaged and fall
    back."""
    if path.is_dir():
        path = max((p for p in path.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        chunk = f.read(16)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
        f.flush()
        os.fsync(f.fileno())
