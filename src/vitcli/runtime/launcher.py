"""Where this process sits in the job, as its launcher says: read in one place (submitit's
TorchDistributedEnvironment), torch-free, so the CLI may ask before importing anything heavy.

torchrun (and the SLURM batch script's torchrun, cluster/slurm.py) sets RANK, WORLD_SIZE, LOCAL_RANK
and LOCAL_WORLD_SIZE in every process it starts; without them this is the one process of its job.
runtime.dist joins the process group from what `LaunchEnv.read()` returns; the rest (the CLI's
messages, the CPU thread advice, the shares of the decoded-image cache and of the host's memory) ask
it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # torchrun's, read here alone


@dataclass(frozen=True)
class LaunchEnv:
    """This process's rank of `world_size`, and of `local_world_size` on this machine
    (`local_rank`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        """The launcher's variables in `environ` (default os.environ); without them, a single
        process."""
        env = os.environ if environ is None else environ
        return cls(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")))

    @property
    def is_main(self) -> bool:
        """The process that talks and writes (rank 0)."""
        return self.rank == 0
