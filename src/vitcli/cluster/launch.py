"""torchrun as the SLURM batch script starts it (`python -m vitcli.cluster.launch ...`, torchrun's
own arguments), exiting with a code that says why the ranks stopped.

torchrun (torch 2.14) exits 1 whenever a rank fails, whatever the rank's exit code: a bug's 1, a
hung rank's errors.HUNG_EXIT_CODE (75) and a rank killed by SIGKILL (the kernel's OOM killer, -9 in
torchrun's account) all arrive as 1 (measured: `torchrun --nproc-per-node 2` of a script whose rank 1
exits 75, or kills itself with SIGKILL). The requeue rule (cluster/requeue.py) requeues a hang or a
SIGKILL and not a bug, so this runs torchrun's own `run` and turns its ChildFailedError back into
the cause (requeue.cause: a hang, else a SIGKILL, else a rank's own failure), exits with it, and
writes it where the batch script asks (requeue.EXITS_ENV: srun's own code is the highest of its
nodes', 143 for those it stopped). Imports torch: the job runs it, never `--slurm --dry-run`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from vitcli.cluster.requeue import EXITS_ENV, cause


def main(argv: list[str] | None = None) -> int:
    """torchrun with `argv`; 0 when every rank succeeded, else exit_code of the failed ranks."""
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        failures = e.failures
        first = e.get_first_failure()[0]
        ranks = sorted(failures, key=lambda r: (r != first, failures[r].timestamp, r))
        code = cause([failures[r].exitcode for r in ranks])
        told = ", ".join(f"rank {r} {failures[r].exitcode}" for r in ranks)
        sys.stderr.write(f"vit: torchrun's ranks failed ({told}): the launch exits {code}\n")
        record(code)
        return code
    return 0


def record(code: int) -> None:
    """This node's cause, in the folder the batch script named (EXITS_ENV): node<SLURM_NODEID>."""
    folder = os.environ.get(EXITS_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"node{os.environ.get('SLURM_NODEID', '0')}").write_text(f"{code}\n")


if __name__ == "__main__":
    sys.exit(main())
