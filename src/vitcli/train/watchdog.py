"""A watchdog per rank: a training step that stalls past a bound (a collective a peer never joins,
a loader that deadlocked, a wedged device) dumps every thread's Python stack to the log and ends
the process with errors.HUNG_EXIT_CODE (75), for torchrun's `--max-restarts` or the SLURM job's
requeue to bring the run back from its last checkpoint. A hung collective cannot be unwound: the
process ends with os._exit, and its last checkpoint is what the restart resumes.

The loop tells it when each step starts and ends (`step`, `done`); what runs between two steps
(evaluations, checkpoint writes) is not watched: each waits in collectives with their own timeouts
(runtime.dist.BARRIER_TIMEOUT, 2 hours, for a checkpoint's barrier, sized for a large checkpoint on
slow storage; the process group's for an evaluation's all-reduces), and a bound loose enough for a
healthy slow write would be no bound for a step.

The bound (`bound`, a pure function): `run.hang_start_s` for the first WARMUP steps of a process
(compilation, the loader's start-up, the first images decoded, a resumed run's first step: far
longer than a step, and no median yet), then max(run.hang_floor_s, run.hang_factor x the median of
the last WINDOW steps). The median, not the mean: a slow step (a log row's sync, a data hiccup) must
not raise the bound, nor a fast run of them lower it.

Two timers, because a watchdog that needs the GIL cannot fire while a hung C call holds it:
- at the bound, a Python thread (the usual case: a collective, a sleep, file I/O and CUDA's waits
  release the GIL) writes one line naming the rank, the step and the bound, dumps every thread's
  stack (faulthandler.dump_traceback) and exits 75;
- at BACKSTOP x the bound, faulthandler's own C thread (dump_traceback_later, re-armed each step),
  which needs no GIL, dumps the stacks under its `Timeout (h:mm:ss)!` header and exits 1: its exit
  code is fixed at 1 by CPython; it fires only where the Python thread could not.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Self, TextIO

from vitcli.errors import HUNG_EXIT_CODE
from vitcli.recipe.schema import RunConfig
from vitcli.runtime import faults

WINDOW = 50  # the recent steps whose median time sets the bound
# steps timed before the median holds: torch.compile may recompile on the second step, and CUDA
# graphs record over the first few
WARMUP = 5
# the C timer's bound against the Python thread's: time for that thread's own dump first
BACKSTOP = 1.5


def bound(times: Sequence[float], factor: float, floor_s: float, start_s: float) -> float | None:
    """Seconds a step may run before it is a hang, after the steps that took `times` seconds in this
    process (oldest first); None: not watched (factor 0: off; start_s 0 during the warm-up)."""
    if not factor:
        return None
    if len(times) < WARMUP:
        return start_s or None
    return max(floor_s, factor * statistics.median(times[-WINDOW:]))


class Watchdog:
    """The watchdog of one rank: `step(n)` as step n starts, `done()` as it ends; use it as a
    context manager (its thread runs inside the block). It also injects the faults of
    runtime.faults that test it and the restarts (`before_agree`, `done`), in the run's
    `workdir`."""

    def __init__(self, run: RunConfig, rank: int, workdir: Path, out: TextIO | None = None):
        self.factor, self.floor_s = run.hang_factor, run.hang_floor_s
        self.start_s = run.hang_start_s
        self.rank, self.workdir, self.out = rank, workdir, out
        self.times: deque[float] = deque(maxlen=WINDOW)
        self._cond = threading.Condition()
        self._deadline: float | None = None  # monotonic; None: between steps
        self._step, self._started, self._bound = 0, 0.0, 0.0
        self._thread: threading.Thread | None = None
        self._closed = False

    def __enter__(self) -> Self:
        if self.factor:
            self._thread = threading.Thread(target=self._watch, name="vitcli-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._closed, self._deadline = True, None
            self._cond.notify()
        if self._thread is not None:
            faulthandler.cancel_dump_traceback_later()
            self._thread.join()

    def step(self, n: int) -> None:
        """Step `n` (as metrics.jsonl counts them) starts: armed with the bound."""
        self._step = n
        if self._thread is None:
            return
        limit = bound(list(self.times), self.factor, self.floor_s, self.start_s)
        now = time.monotonic()
        with self._cond:
            self._step, self._started, self._bound = n, now, limit
            self._deadline = None if limit is None else now + limit
            self._cond.notify()
        if limit is not None:
            faulthandler.dump_traceback_later(BACKSTOP * limit, exit=True, file=self._file())

    def done(self) -> None:
        """The step has finished: its time counts towards the median; disarmed until the next.
        Then VITCLI_FAULTS' `kill` or `crash` of this step, if planned."""
        if self._thread is not None:
            with self._cond:
                if self._deadline is not None:
                    self._deadline = None
                    faulthandler.cancel_dump_traceback_later()
                self.times.append(time.monotonic() - self._started)
        die_after_step(self._step, self.rank, self.workdir)

    def disarm(self) -> None:
        """Unwatched until the next step, its time no step's: what runs now is not a step (a
        rollback waiting for the write in flight, its upload included, and reading a checkpoint
        back), as checkpoint writes and evaluations between steps are not."""
        if self._thread is not None:
            with self._cond:
                if self._deadline is not None:
                    self._deadline = None
                    faulthandler.cancel_dump_traceback_later()

    def before_agree(self) -> None:
        """Just before the step's agreement all-reduce: VITCLI_FAULTS' `hang` of this step, if
        planned."""
        hang_before_agree(self._step, self.rank, self.workdir)

    def _file(self) -> TextIO:
        """`out`, else stderr: sys.stderr where it has a file descriptor (faulthandler writes to
        one), else the process's own (a test's captured sys.stderr has none)."""
        if self.out is not None:
            return self.out
        try:
            sys.stderr.fileno()
            return sys.stderr
        except (AttributeError, OSError, ValueError):
            return sys.__stderr__

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                elif time.monotonic() < self._deadline:
                    self._cond.wait(self._deadline - time.monotonic())
                else:
                    self._fire()

    def _fire(self) -> None:
        """The step overran: one line, every thread's stack, exit 75 (the lock held: nothing else
        of this process moves the watchdog now)."""
        faulthandler.cancel_dump_traceback_later()  # this dump is the one
        how = (f"the first {WARMUP} steps' run.hang_start_s" if len(self.times) < WARMUP
               else f"max(run.hang_floor_s={self.floor_s:g}, run.hang_factor={self.factor:g} x the "
                    f"median step {statistics.median(self.times):.3g} s)")
        ran = time.monotonic() - self._started
        line = (f"rank {self.rank}: step {self._step} has run {ran:.1f} s, past its bound of "
                f"{self._bound:.1f} s ({how}): hung; every thread's stack follows, then exit "
                f"{HUNG_EXIT_CODE}\n")
        # to the descriptor, as faulthandler writes: the stream's buffer may be locked by the very
        # write that hung
        fd = self._file().fileno()
        os.write(fd, line.encode())
        faulthandler.dump_traceback(file=fd, all_threads=True)
        os._exit(HUNG_EXIT_CODE)


# The faults of runtime.faults that test the watchdog and torchrun's restarts (the watchdog injects
# them where the loop tells it it is): a rank that hangs before the step's agreement, one SIGKILLed
# or crashing after its step.


def hang_before_agree(step: int, rank: int, workdir: Path) -> None:
    """VITCLI_FAULTS' `hang`: this rank never reaches the step's agreement all-reduce, so the others
    wait in it."""
    if faults.armed("hang", step, rank, workdir):
        hang_forever()


def hang_forever() -> None:
    """Sleep until killed (the frame a hang's stack dump names)."""
    while True:
        time.sleep(3600)


def die_after_step(step: int, rank: int, workdir: Path) -> None:
    """VITCLI_FAULTS' `kill` (SIGKILL: an OOM kill, a lost node) and `crash` (an exception: a bug, a
    bad node)."""
    if faults.armed("kill", step, rank, workdir):
        os.kill(os.getpid(), signal.SIGKILL)
    if faults.armed("crash", step, rank, workdir):
        raise RuntimeError(f"injected crash after step {step} on rank {rank} (VITCLI_FAULTS)")
