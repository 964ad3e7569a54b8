"""A rollback past a loss spike, in the running process (PaLM, section 5.1: "restart from a
checkpoint roughly 100 steps before the spike, and skip roughly 200-500 data batches").

The rule (`spiked`): a loss read (every run.log_every steps and at checkpoints, where the loop
already reads it) is a spike when it is not finite, or, with run.spike_factor k > 0, when it is
above k x the median of the last run.spike_window losses read before it (a full window: nothing is
judged against fewer). The median, not the mean: one earlier spike does not move it.

What happens (`Guard.roll_back`): the model, optimizer, EMA (and with them an objective's state kept
in the model, DINO's teacher and centres) and the train stream go back to the newest checkpoint, of
step c < d, the step that spiked; and the batches steps c+1 .. d took are skipped: the run goes on
at step c+1 with the batch the spiked step d would have taken next. That window is every batch that
trained into the weights the run throws away, and no more: the batches before c gave the weights it
keeps (PaLM skips a few hundred batches around a spike it saw every step; here the window is what
lies between the checkpoint kept and the read that caught it). The step counter, and with it the
learning-rate schedule, goes on from c; the data position runs ahead of it by the batches skipped
(data.batching.sampler.batch_step), and every random draw of a step is its batch's, so a run given
the same skip up front (data.skip_steps) trains the same steps on the same batches with the same
draws, and ends with the same weights.

The skip is recorded three times before the run goes on: in WORKDIR/rollbacks.jsonl (fsynced: a kill
before the next checkpoint still resumes with it), in metrics.jsonl (a row at step c; the rows of
the steps thrown away go, as a resume drops them), and in WORKDIR/slurm/attempts.jsonl when the run
is a SLURM job's (in its attempt's record, under `rollbacks`); every checkpoint after it holds it in
its `data` part. A run stops (TrainingError, exit 2) past run.max_rollbacks rollbacks, or where no
checkpoint was written before the spike, in one line naming the steps and what to change.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

from vitcli.checkpoints.manager import CheckpointManager, latest_good_state
from vitcli.data.batching.sampler import batch_step, merged, skipped
from vitcli.errors import TrainingError
from vitcli.recipe.schema import Recipe
from vitcli.runtime import faults
from vitcli.runtime.dist import Dist, all_reduce_sum, barrier
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import MetricsLog, console
from vitcli.runtime.run_files import ATTEMPTS_FILE, METRICS_FILE, ROLLBACKS_FILE, SLURM_DIR
from vitcli.train.watchdog import Watchdog

SPIKE = 1000.0  # the `spike` fault's factor on the loss read: far above any run.spike_factor


def spiked(loss: float, recent: list[float], factor: float) -> bool:
    """Whether `loss` is a spike: not finite; or (factor > 0) above factor x the median of `recent`,
    the losses read before it, when they fill the window."""
    if not math.isfinite(loss):
        return True
    return bool(factor) and bool(recent) and loss > factor * statistics.median(recent)


def diverged(r: Recipe, done: int, newest: Path | None, why, loss: float | str) -> str:
    """What a loss that became non-finite by step `done` (as metrics.jsonl numbers steps) says: the
    newest checkpoint on disk, which holds weights from before it (or that there is none), and what
    the recipe can still change (the objective's `why()` first, when it can name the term)."""
    kept = (f"the newest checkpoint, {newest.name}, is kept" if newest is not None
            else "no checkpoint was written before it")
    clip = r.optim.clip_grad_norm
    fix = (f"a lower optim.lr (optim.clip_grad_norm={clip:g} already clips the gradients)" if clip
           else "a lower optim.lr, or optim.clip_grad_norm=1")
    term = why()
    if term:
        return (f"loss became {loss} at step {done}: {term}; {kept}; with --no-resume or in a new "
                "--workdir (the checkpoints here hold this recipe)")
    return (f"loss became {loss} at step {done} (it is read every run.log_every steps and at "
            f"checkpoints); {kept}; try {fix}, with --no-resume or in a new --workdir (the "
            "checkpoints here hold this recipe)")


def poisoned(loss: float, done: int, dist: Dist, workdir: Path) -> float:
    """The loss read at step `done` as an injected fault leaves it (runtime.faults): `nan` makes it
    NaN, `spike` 1000 times itself; read before the update, so the weights never see either, as a
    spike caught before its update."""
    if faults.armed("nan", done, dist.rank, workdir):
        return math.nan
    if faults.armed("spike", done, dist.rank, workdir):
        return loss * SPIKE
    return loss


def poison_planned(done: int) -> bool:
    """Whether a nan or spike fault is planned at step `done` on any rank (the same answer on every
    rank: the loss is read, a collective, where one is)."""
    return any(kind in ("nan", "spike") and step == done for kind, step, _ in faults.planned())


def recorded(workdir: Path) -> list[dict]:
    """The run's rollbacks, oldest first (WORKDIR/rollbacks.jsonl): [] for none."""
    try:
        lines = (workdir / ROLLBACKS_FILE).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


class Guard:
    """The spike rule and the rollbacks of one run: the losses read lately, the steps that spiked,
    the skips the rollbacks recorded. `resumed`: the run goes on from a checkpoint, so the skips
    WORKDIR/rollbacks.jsonl recorded hold; a fresh run's go (they were an abandoned run's). `why`:
    the objective's why_diverged, for the line a run that stops says."""

    def __init__(self, recipe: Recipe, workdir: Path, dist: Dist, resumed: bool,
                 why: Callable[[], str]):
        self.recipe, self.run, self.workdir, self.dist = recipe, recipe.run, workdir, dist
        self.why = why
        self.recent: deque[tuple[int, float]] = deque(maxlen=recipe.run.spike_window)
        # the steps that spiked, the earlier processes' too: a restarted run (torchrun's restarts,
        # a requeue) does not begin its rollbacks afresh, past a spike that recurs each time
        done = recorded(workdir) if resumed else []
        self.spikes: list[int] = [r["from_step"] for r in done]
        if not resumed and dist.is_main:
            (workdir / ROLLBACKS_FILE).unlink(missing_ok=True)
        self.recorded = merged((), *(tuple(w) for r in done for w in r["skips"]))

    def read(self, values: list, done: int, due: bool) -> list[float | None] | None:
        """At a step where the loss is `due` (or a nan or spike fault is planned): tensors (the loss
        first, others or None) -> numbers averaged over processes, the loss as an injected fault
        leaves it, the others None where they were; else None, nothing read (no host sync)."""
        if not (due or poison_planned(done)):
            return None
        numbers = [math.nan if v is None else float(v) for v in values]
        numbers[0] = poisoned(numbers[0], done, self.dist, self.workdir)
        mean = all_reduce_sum([v / self.dist.world_size for v in numbers], self.dist)
        return [mean[0], *(None if math.isnan(v) else v for v in mean[1:])]

    def check(self, loss: float, done: int) -> bool:
        """Whether the loss read at step `done` is a spike; if not, it joins the window."""
        window = [v for _, v in self.recent] if len(self.recent) == self.recent.maxlen else []
        if spiked(loss, window, self.run.spike_factor):
            return True
        self.recent.append((done, loss))
        return False

    def roll_back(self, done: int, loss: float, checkpoints: CheckpointManager, metrics: MetricsLog,
                  newest: Path | None, watchdog: Watchdog) -> tuple[int, MetricsLog]:
        """Back to the newest checkpoint past the spike at step `done`, its window skipped and
        recorded; (the step it holds, metrics.jsonl reopened there). A TrainingError (`diverged`'s
        line; `newest`: the newest checkpoint written) past run.max_rollbacks or with no checkpoint
        to go back to."""
        self.spikes.append(done)
        line = diverged(self.recipe, done, newest, self.why, self._what(loss))
        if len(self.spikes) > self.run.max_rollbacks:
            raise TrainingError(self._exhausted(line))
        watchdog.disarm()  # no step's: the wait for a write in flight may be an upload's
        checkpoints.settle()  # a write in flight (run.ckpt_async) may be the newest
        found = latest_good_state(self.workdir, verbose=self.dist.is_main)
        if found is None:
            raise TrainingError(line)
        start = int(found[1]["step"])
        skips = skipped(checkpoints.skips, start, done)
        before = checkpoints.skips
        window = (batch_step(start, before) + 1, batch_step(done - 1, before) + 1)
        row = {"rollback/from_step": done, "rollback/first_batch": window[0],
               "rollback/last_batch": window[1], "rollback/spiked_loss": loss}
        if self.dist.is_main:
            self._record({"from_step": done, "to_step": start, "loss": _json_number(loss),
                          "window": list(window), "skips": [list(w) for w in skips]})
        barrier(self.dist)  # recorded before any rank goes on
        self.recorded = skips
        checkpoints.roll_back(found, skips)
        reopened = MetricsLog(self.workdir / METRICS_FILE, start, enabled=self.dist.is_main,
                              trackers=metrics.trackers)
        reopened.write(start, row)
        kept = ((s, v) for s, v in self.recent if s <= start)
        self.recent = deque(kept, maxlen=self.recent.maxlen)
        if self.dist.is_main:
            most = self.run.max_rollbacks
            console.log(f"[yellow]warning: step {done}: loss {self._what(loss)}: rolled back to "
                        f"{found[0].name}, skipping the batches of steps {window[0]}-{window[1]} "
                        f"(rollback {len(self.spikes)} of run.max_rollbacks={most})")
        return start, reopened

    def _what(self, loss: float) -> str:
        """The loss as the messages say it: the value, and against what it spiked."""
        if not math.isfinite(loss) or not self.recent:
            return f"{loss}"
        median = statistics.median(v for _, v in self.recent)
        return (f"{loss:.4g}, above run.spike_factor={self.run.spike_factor:g} x the median "
                f"{median:.4g} of the last {len(self.recent)} read")

    def _exhausted(self, line: str) -> str:
        """The one line of a run that spiked once more than it may roll back."""
        if not self.run.max_rollbacks:
            return line  # rollback off: the line of a divergence, as ever
        steps = ", ".join(map(str, self.spikes))
        most = self.run.max_rollbacks
        return (f"the loss spiked at steps {steps}, past run.max_rollbacks={most} rollbacks (the "
                f"same command with a larger one resumes here): {line}")

    def _record(self, record: dict) -> None:
        """The rollback in WORKDIR/rollbacks.jsonl (flushed to disk before the run goes on), and in
        the SLURM attempt's record when the run is a job's (cluster/requeue.py's file: one line per
        attempt, so the rollback goes into the attempt's line, never a line of its own)."""
        with open(self.workdir / ROLLBACKS_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        attempts = self.workdir / SLURM_DIR / ATTEMPTS_FILE
        if attempts.is_file():
            lines = [json.loads(ln) for ln in attempts.read_text().splitlines() if ln.strip()]
            if lines:
                lines[-1].setdefault("rollbacks", []).append(record)
                write_text(attempts, "".join(json.dumps(r) + "\n" for r in lines))


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None
