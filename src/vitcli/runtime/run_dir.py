"""A run directory's rules, decided once: which of its files are training states, the newest one's
step, whether the run there is finished, and which recipe keys do not change a result.

Torch-free and quick on purpose: the SLURM batch script's requeue step (cluster.requeue) asks it
inside the time limit's lead, and `--slurm` asks it before submitting. The checkpoint layer
(checkpoints.state) writes, verifies and rotates the states; here they are only found by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vitcli.runtime.run_files import MODEL_FILE, SUMMARY_FILE

# A training state: `state-<step>.pt` beside its checksum `state-<step>.pt.sha256`
# (checkpoints.state), or a sharded run's directory `state-<step>/` (checkpoints.sharded). A
# checksum alone is not a checkpoint.
STATE_NAME = re.compile(r"state-(\d+)(\.pt(\.sha256)?)?")
_CHECKPOINT_NAME = re.compile(r"state-(\d+)(\.pt)?")

# Recipe keys that do not change a result: how a run is watched, fed, placed, checkpointed or
# submitted. Every other key (the seed and the micro-batch included: they decide the data order, the
# initial weights and the summation order) must be the same for two runs to be one. Two uses, each
# adding its own:
NOT_RESULT = ("run.device", "run.compile", "run.log_every", "run.eval_every", "run.ckpt_every",
              "run.ckpt_every_minutes", "run.keep_checkpoints", "run.activation_checkpointing",
              "run.memory_budget_mb", "run.loggers", "data.num_workers", "data.eval_batch_size",
              "data.cache_mb", "fewshot.cache_dir", "slurm.",
              "run.ckpt_dir", "run.hang_factor", "run.hang_floor_s", "run.hang_start_s", "run.ckpt_async",
              "run.mlflow_uri", "run.experiment", "search.")
# 1. resume (checkpoints.manager): may differ between a run and its resumption. Also every
#    `fewshot.` key (a training's few-shot evaluations watch it, they do not train it) and ema.save
#    (which of the trained weights the end writes), and how a loss spike is watched for
#    (train/rollback.py: a run stopped past run.max_rollbacks resumes with more). Not run.strategy:
#    a checkpoint is laid out by it (a file, or shards).
RESUMABLE = NOT_RESULT + ("fewshot.", "ema.save", "run.spike_factor", "run.spike_window",
                          "run.max_rollbacks")
# 2. a finished evaluation's repeat (runtime.finished): may differ between it and the same request
#    again. Also run.strategy (the weights are read whole, however the processes hold them) and
#    fewshot.every (a training's key: an evaluation has no steps).
HOW_RUN = NOT_RESULT + ("run.strategy", "fewshot.every")


def state_file(step: int) -> str:
    """The name of the whole-file checkpoint of `step`."""
    return f"state-{step}.pt"


def state_dir(step: int) -> str:
    """The name of the sharded checkpoint (a directory) of `step`."""
    return f"state-{step}"


def states_by_step(workdir: Path) -> dict[int, list[Path]]:
    """The training states and their checksums in `workdir`, grouped by step (a `.state-*.tmp`
    directory, a write that never finished, is none)."""
    found: dict[int, list[Path]] = {}
    for path in Path(workdir).glob("state-*"):
        match = STATE_NAME.fullmatch(path.name)
        if match:
            found.setdefault(int(match[1]), []).append(path)
    return found


def newest_step(workdir: Path) -> int:
    """The newest checkpoint's step in `workdir` by its name (a file or a directory, not a checksum
    alone); 0 when there is none. Nothing is read: whether it verifies is the checkpoint layer's
    question."""
    names = (_CHECKPOINT_NAME.fullmatch(p.name) for p in Path(workdir).glob("state-*"))
    steps = [int(m[1]) for m in names if m]
    return max(steps, default=0)


def finished(workdir: Path) -> dict | None:
    """What summary.json holds when the run in `workdir` is finished, else None.

    Finished: model.safetensors is there, summary.json is a whole JSON object, and no checkpoint is
    newer than the step it ends at. A run writes its last checkpoint, then model.safetensors, then
    summary.json, so a run killed before them is not finished (it resumes). A checkpoint newer than
    the summary is another run's, begun after it; a finished run whose checkpoints were deleted (to
    free disk) is still finished.
    """
    if not (Path(workdir) / MODEL_FILE).is_file():
        return None
    try:
        summary = json.loads((Path(workdir) / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None  # missing or damaged: not finished, the same command writes it again
    if not isinstance(summary, dict) or not isinstance(summary.get("steps"), int):
        return None
    return summary if newest_step(workdir) <= summary["steps"] else None
