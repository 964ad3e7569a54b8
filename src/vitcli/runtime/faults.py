"""Faults injected on purpose, for the fault tests and the soak (`make soak`): the environment
variable VITCLI_FAULTS names them, and a run without it meets none (each check is one dict lookup).

    VITCLI_FAULTS="kill@40:rank=1,hang@75,nan@120,enospc@160,corrupt@200"

Each entry is KIND@STEP, optionally `:rank=R` (default: rank 0). STEP counts optimizer steps as
metrics.jsonl does (the step that has just finished, or whose checkpoint is written). The kinds, and
the part of vit that meets each (the code that calls `armed` with that kind):

- kill: the rank SIGKILLs itself after the step (an OOM kill, a lost node);
- hang: the rank sleeps forever before the step's agreement all-reduce (a collective that never
  completes: the other ranks wait in it);
- crash: the rank raises after the step (a bug, a bad node's exception);
- nan: the step's loss is NaN (a spike, a bad batch);
- spike: the step's loss is 1000 times itself (a spike above run.spike_factor x the median);
- enospc: the checkpoint of the step fails to write with ENOSPC (a full disk);
- corrupt: the checkpoint of the step is damaged after its checksum is written (a bad disk);
- store: the upload of the step's checkpoint to run.ckpt_dir fails between its data and its checksum
  object, as a store that went away mid-upload (checkpoints.remote; rank 0, which uploads);
- kill_write: the rank SIGKILLs itself in the middle of writing the checkpoint of the step, half its
  bytes in the temporary file (a node lost during a write: with run.ckpt_async, while training
  goes on).

Why a variable and not a recipe key: a recipe is the experiment, and a fault is not part of it (it
must not change the recipe a checkpoint is resumed against). Why each fires once: a fault the run
survived must not meet it again when the run comes back (a restart, a rollback that replays the
step). A fault that fired is recorded in WORKDIR/faults-fired.jsonl before it acts (so a SIGKILL
still leaves the record), and `armed` is false for it from then on, in every later process of the
run.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ENV = "VITCLI_FAULTS"
KINDS = ("kill", "hang", "crash", "nan", "spike", "enospc", "corrupt", "kill_write", "store")
FIRED_FILE = "faults-fired.jsonl"


@dataclass(frozen=True)
class Fault:
    """One injected fault: what, at which step, on which rank."""

    kind: str
    step: int
    rank: int = 0

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}:rank={self.rank}"


def parse(text: str) -> tuple[Fault, ...]:
    """VITCLI_FAULTS' entries; a malformed one is a ValueError naming it (the variable is a test
    harness's, set by code, so a mistake there is a bug to see at once)."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        head, _, options = entry.partition(":")
        kind, _, step = head.partition("@")
        rank = options.removeprefix("rank=") if options else "0"
        if kind not in KINDS or not step.isdigit() or not rank.isdigit():
            raise ValueError(f"{ENV}: cannot read {entry!r} (KIND@STEP[:rank=R], KIND one of "
                             f"{', '.join(KINDS)})")
        faults.append(Fault(kind, int(step), int(rank)))
    return tuple(faults)


@cache
def _planned(text: str) -> dict[tuple[str, int, int], Fault]:
    return {(f.kind, f.step, f.rank): f for f in parse(text)}


def planned() -> dict[tuple[str, int, int], Fault]:
    """The faults this process's environment names, by (kind, step, rank)."""
    return _planned(os.environ.get(ENV, ""))


def fired(workdir: Path) -> set[str]:
    """The keys of the faults that already fired in this run (every process's)."""
    try:
        lines = (Path(workdir) / FIRED_FILE).read_text().splitlines()
    except OSError:
        return set()
    return {json.loads(line)["fault"] for line in lines if line.strip()}


def armed(kind: str, step: int, rank: int, workdir: Path) -> bool:
    """Whether the fault (kind, step, rank) is planned and has not fired yet in this run; when it
    is, it is recorded as fired (flushed to disk) before this returns True, so the caller acts on
    it once and only once, even if acting kills the process."""
    fault = planned().get((kind, step, rank)) if planned() else None
    if fault is None or fault.key in fired(workdir):
        return False
    path = Path(workdir) / FIRED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        # the time: the soak's report measures what each fault cost from it
        f.write(json.dumps({"fault": fault.key, "pid": os.getpid(), "time": time.time()}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return True
