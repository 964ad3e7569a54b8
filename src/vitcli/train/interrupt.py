"""Ctrl-C, SIGTERM and SIGUSR1/2 during training: finish the step, write a checkpoint, say how to
resume, exit 128 + the signal's number (130, 143, 138, 140).

A cluster scheduler sends SIGTERM before it pre-empts a job, and SLURM sends the signal `--signal`
asks for (SIGUSR2, vitcli.cluster.slurm) ahead of a time limit; losing up to `run.ckpt_every` steps
to either is what this prevents. The first signal only raises a flag that the loop reads after each
optimizer step (so no step is half-applied); a second Ctrl-C aborts at once (a scheduler's repeated
signal does not), and the atomic writes still leave no partial file at a target path. Every rank
must stop at the same step: the trainer agrees on the flag by an all-reduce.
"""

from __future__ import annotations

import signal
import threading
from typing import Self

from vitcli.errors import Interrupted
from vitcli.runtime.metrics import console

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Within the block, SIGINT / SIGTERM set `signum` instead of killing the process (main thread
    only)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict = {}

    def __enter__(self) -> Self:
        # signal handlers live on the main thread
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a person's second Ctrl-C: stop now
        if self.signum:
            # a scheduler's signal reaches a rank more than once, milliseconds apart (SLURM signals
            # every process of a step, and torchrun forwards what it got; strace under srun): the
            # checkpoint under way is what all of them ask for, and aborting would lose it. The hard
            # stop stays SIGKILL, after SLURM's KillWait or torchrun's --shutdown-timeout
            return
        self.signum = signum
        again = " (Ctrl-C again aborts at once)" if signum == signal.SIGINT else ""
        name = signal.Signals(signum).name
        console.log(f"[yellow]{name}: finishing this step and writing a checkpoint{again}")


def interrupted(signum: int, step: int, total: int, workdir) -> Interrupted:
    """The one-line outcome: where the checkpoint is and how to resume; exit 128 + the signal's
    number."""
    name = signal.Signals(signum).name
    return Interrupted(f"stopped by {name} at step {step}/{total}: checkpoint written in {workdir}; "
                       "run the same command again to resume from it", exit_code=128 + signum)
