"""torchrun as the SLURM batch script starts it (`python -m vitcli.cluster.launch ...`, torchrun's
own arguments), exiting with a code that says why the ranks stopped.

torchrun (torch 2.14) exits 1 whenever a rank fails, whatever the rank's exit code: a bug's 1, a
hung rank's errors.HUNG_EXIT_CODE (75) and a rank killed by SIGKILL (the kernel's OOM killer, -9 in
torchrun's account) all arrive as 1 (measured: `torchrun --nproc-per-node 2` of a script whose rank 1
exits 75, or kills itself with SIGKILL). The requeue rule (cluster/requeue.py) requeues a hang or a
SIGKILL and not a bug, so this runs torchrun's own `run` and turns its ChildFailedError back into
the cause: a rank's own failure (an exit code below 128 other than 75) first, since the others'
deaths follow from it; else a hang; else a SIGKILL; else the first failure's code. Imports torch:
the job runs it, never `--slurm --dry-run`.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from vitcli.errors import HUNG_EXIT_CODE


def exit_code(codes: list[int]) -> int:
    """The code the launch exits with, from every failed rank's exit code as torchrun reports them
    (a negative one: killed by that signal), first failure first."""
    shell = [128 - c if c < 0 else c for c in codes]  # as a shell reports a signal: 128 + its number
    own = [c for c in shell if c < 128 and c != HUNG_EXIT_CODE]
    if own:
        return own[0]
    if HUNG_EXIT_CODE in shell:
        return HUNG_EXIT_CODE
    if 128 + signal.SIGKILL in shell:
        return 128 + signal.SIGKILL
    return shell[0] if shell else 1


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv`; 0 when every rank succeeded, else exit_code of the failed ranks."""
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failures = e.failures
        first = e.get_first_failure()[0]
        ranks = sorted(failures, key=lambda r: (r != first, failures[r].timestamp, r))
        code = exit_code([failures[r].exitcode for r in ranks])
        told = ", ".join(f"rank {r} {failures[r].exitcode}" for r in ranks)
        sys.stderr.write(f"vit: torchrun's ranks failed ({told}): the launch exits {code}\n")
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
