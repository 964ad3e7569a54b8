"""The one owner of a run's training state (torchtitan's CheckpointManager): whether a run resumes
and from which checkpoint, writing one (whole or sharded) and rotating, and loading one back into
the model, the optimizer and the train stream.

What a checkpoint holds is a dict of stateful parts: `model` and `optimizer`; `ema`, the weight EMA,
when the recipe keeps one (ema.decay > 0); the train state, `step` and `recipe`; and `data`, the
position in the data (examples seen, the world size, and `streams`, every rank's train stream state:
its `state_dict()`, json; and `skips`, the windows of steps whose batches the run skips: the
recipe's data.skip_steps and those rollbacks past a loss spike added, train/rollback.py). A whole
checkpoint (`state-<step>.pt`, checkpoints.state) holds them all in one file; a sharded one
(`state-<step>/`, checkpoints.sharded) keeps the model, optimizer and EMA as shards and the rest
beside them. A checkpoint from before a run kept an EMA has none, and its
recipe's missing `ema` section reads as EMA off: a recipe that turns EMA on is then a changed
recipe, refused on resume like any other (_check_same_training), never an EMA begun from the weights
halfway through.

No RNG state is saved (big_vision keeps none): every random draw of training is a function of (seed,
step, micro-batch) (sampler.micro_seed, loop._objective), so a resumed run draws what the
uninterrupted one drew. An older checkpoint's `rng` entry is left unread.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from vitcli.checkpoints import remote, state
from vitcli.checkpoints.sharded import load as load_shards
from vitcli.checkpoints.sharded import verified_extra
from vitcli.checkpoints.sharded import write as write_shards
from vitcli.checkpoints.sharded import write_async as write_shards_async
from vitcli.checkpoints.writer import Staging, Writer, damage, injected
from vitcli.data.batching.sampler import Windows, merged
from vitcli.errors import CheckpointError, RecipeError, first_line
from vitcli.recipe.layers import flatten, to_dict
from vitcli.recipe.rollback_checks import skip_windows
from vitcli.recipe.schema import Recipe, micro_batches
from vitcli.runtime import faults, files
from vitcli.runtime.dist import Dist, all_gather, barrier
from vitcli.runtime.metrics import console
from vitcli.runtime.run_dir import RESUMABLE, finished, newest_step
from vitcli.runtime.workdir import check_resume_flags, refuse_finished, set_aside

# The keys that may differ between a run and its resumption: run_dir.RESUMABLE; all others match.
# data.micro_batch_size=auto matches the micro-batch the checkpoint's run chose (run.micro_batch),
# so the budget that chose it may change.
MICRO_BATCH = "data.micro_batch_size"

# a checkpoint write that fails on a full disk or a lost mount is a warning, the run going on from
# its state in memory; this many in a row stop it (the disk is not coming back by itself, and every
# step since the newest checkpoint on disk is at stake)
FAILURES_IN_A_ROW = 3
_FIX = ("free space there (or mend the mount) and run the same command again: it resumes from the "
        "newest checkpoint on disk")

# (path, what it holds: all of a file; a directory's part beside its shards)
Checkpoint = tuple[Path, dict]


def latest_good_state(workdir: Path, verbose: bool = True) -> Checkpoint | None:
    """The newest checkpoint that verifies and is complete, as (path, state); None when there is
    none at all.

    For a file `state-<step>.pt`, state is all of it (state.STATE_KEYS). For a directory
    `state-<step>/` (a sharded run), state is only its extra part (sharded.SHARDED_KEYS at least),
    read without unpickling; the model and optimizer tensors stay on disk until
    CheckpointManager.load reads them into the live, already sharded model. Either is checked
    against its checksums first.

    Each newer one skipped is named in a warning (if `verbose`); if none is usable, a
    CheckpointError names them, unless they were only cut short (a kill before their checksum: the
    run's first save), when the run starts over (None) with a warning.
    """
    failures = []
    for path in state.checkpoints(workdir):
        try:
            saved = verified_extra(path) if path.is_dir() else state.complete_state(path)
        except CheckpointError as e:
            failures.append(str(e))
            continue
        # outside the try: a format this vitcli cannot read is refused, not passed over
        state.check_format(path, saved)
        for failure in failures if verbose else []:
            console.log(f"[yellow]warning: {failure}; resuming from {path.name} instead")
        return path, saved
    if len(failures) > len(state.orphans(workdir)):  # damaged, not only cut short: the user decides
        raise CheckpointError(f"no usable checkpoint in {workdir}: {'; '.join(failures)}; "
                              "--no-resume starts over")
    # the first save was killed: nothing was lost but its steps
    for failure in failures if verbose else []:
        console.log(f"[yellow]warning: {failure}; no checkpoint before it: starting at step 0")
    return None


def resume_point(recipe: Recipe, workdir: Path, dist: Dist, resume: bool | None = None,
                 overwrite: bool = False, auto_precision: bool = False) -> Checkpoint | None:
    """The checkpoint to resume from (read once, handed to the loop), or None for a fresh run.

    `resume`: --resume (True), --no-resume (False) or neither (None: resume when the workdir holds a
    checkpoint); `overwrite` starts over even where a checkpoint could be resumed, and lets a fresh
    run replace a finished one. Refused if the recipe changed what is trained. `recipe` has its
    precision resolved; with `auto_precision` (the user's recipe said auto) a checkpoint trained at
    the other precision, on a machine that chose differently, is continued with a warning instead.
    """
    check_resume_flags(resume, overwrite)
    fresh = overwrite or resume is False
    from_remote(recipe, workdir, dist, fetch=not fresh)
    found = None if fresh else latest_good_state(workdir, verbose=dist.is_main)
    if found is None:
        if resume:
            raise RecipeError(f"--resume: no checkpoint to resume in {workdir} (expected state-<step>.pt, or "
                              "a state-<step>/ directory with run.strategy=fsdp)")
        refuse_finished(workdir, overwrite)
        return None
    saved = found[1]["recipe"]
    if auto_precision:
        saved = _accept_precision(recipe, saved, workdir)
    _check_same_training(recipe, saved, workdir)
    return found


def from_remote(recipe: Recipe, workdir: Path, dist: Dist, fetch: bool) -> None:
    """run.ckpt_dir, if set, checked before anything is trained (writable, and not the workdir):
    one line naming the URI and the error; with `fetch`, its newest good checkpoint newer than the
    workdir's is downloaded there first (checkpoints.remote), for latest_good_state to find. Rank 0
    asks the store; every rank learns its verdict."""
    if not recipe.run.ckpt_dir:
        return
    error = None
    if dist.is_main:
        try:
            mirror = remote.Mirror(recipe.run.ckpt_dir, recipe.run.keep_checkpoints)
            if mirror.local and Path(mirror.root).resolve() == Path(workdir).resolve():
                raise CheckpointError(f"run.ckpt_dir={recipe.run.ckpt_dir} is the workdir itself: "
                                      "name another place (a bucket, another disk), or leave it "
                                      "empty")
            mirror.check()
            if fetch:
                mirror.fetch_newer(workdir, newest_step(workdir))
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - the store's own errors (a listing that failed)
            # one line, which every rank learns below instead of waiting for rank 0 forever
            error = f"run.ckpt_dir={recipe.run.ckpt_dir}: {first_line(e, named=True)}"
    error = next(filter(None, all_gather(error, dist)), None)
    if error is not None:
        raise CheckpointError(error)


def finished_summary(workdir: Path, start: Checkpoint | None) -> dict | None:
    """What summary.json holds when the workdir's run is finished (run_dir.finished) and `start`,
    its resume point, verified, is its last step: the same command then has nothing to train,
    evaluate or write. None otherwise (a damaged last checkpoint: the steps after `start` are
    trained again)."""
    summary = finished(workdir) if start is not None else None
    return summary if summary is not None and summary["steps"] == int(start[1]["step"]) else None


def _accept_precision(recipe: Recipe, saved: dict, workdir: Path) -> dict:
    """`saved` with this machine's precision, after a loud warning if the checkpoint trained at
    another."""
    was = saved["run"]["precision"]
    if was != recipe.run.precision:
        console.log(f"[bold yellow]warning: {workdir} trained at {was}; run.precision=auto chooses "
                    f"{recipe.run.precision} on this machine, so the rest of the run continues at "
                    f"{recipe.run.precision} (set run.precision={was} to keep it)")
    return {**saved, "run": {**saved["run"], "precision": recipe.run.precision}}


def _check_same_training(recipe: Recipe, saved_recipe: dict, workdir: Path) -> None:
    """Refuse to continue a run whose recipe trains differently. A key the saved recipe lacks (a key
    vitcli gained since the checkpoint was written) counts as its default: what the run trained
    with."""
    saved, now = flatten(saved_recipe), flatten(to_dict(recipe))
    defaults = flatten(to_dict(Recipe(stage=recipe.stage)))
    saved = {k: saved.get(k, defaults.get(k)) for k in now}
    # continues with the checkpoint's choice (run.micro_batch.resolved)
    if now[MICRO_BATCH] == "auto":
        now[MICRO_BATCH] = saved[MICRO_BATCH]
    diffs = [k for k in now if saved[k] != now[k] and not k.startswith(RESUMABLE)]
    if diffs:
        k, more = diffs[0], f", and {len(diffs) - 1} more" if len(diffs) > 1 else ""
        raise RecipeError(
            f"{workdir} holds a run with a different recipe ({k}: {saved.get(k)!r} there, "
            f"{now[k]!r} now{more}); use a new --workdir, or "
            + ("--overwrite to start over there (the finished run is kept in previous-<time>/)"
               if finished(workdir) is not None else "--no-resume to start over there")
        )


def prepare_workdir(workdir: Path, fresh: bool, ckpt_dir: str = "") -> Path | None:
    """Before a run writes anything (rank 0): the killed writes of an earlier run go (ours only, by
    their pattern: files.remove_stale_temps, state.remove_stale_dirs); a `fresh` run first sets the
    previous run's files aside, its checkpoints with them (and those in run.ckpt_dir, `ckpt_dir`),
    so that nothing old looks resumable. Returns where the workdir's went."""
    workdir.mkdir(parents=True, exist_ok=True)
    files.remove_stale_temps(workdir)
    state.remove_stale_dirs(workdir)
    if fresh:
        if ckpt_dir:
            remote.Mirror(ckpt_dir).set_aside()
        return set_aside(workdir, state.state_files(workdir))
    # a checkpoint whose checksum a kill never wrote (latest_good_state skipped it): kept, out of
    # the way
    set_aside(workdir, state.orphans(workdir), outputs=False, why="the half-written checkpoints")
    return None


def save(workdir: Path, parts: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dist: Dist,
         keep: int, sharded: bool, ema: TensorState | None = None) -> Path:
    """Write the checkpoint of parts["step"]: `parts` with the model, optimizer and `ema` (if any),
    as one file by rank 0 or (`sharded`) as a directory every rank writes its shard into; then keep
    the `keep` newest. Every rank calls it; it returns once the checkpoint is in place (the
    synchronous writer; CheckpointManager may write in the background), or raises CheckpointError
    naming the file. Any checkpoint of that step or later goes first (an abandoned run's), so that
    whatever a kill leaves behind, the newest checkpoint is from this run."""
    writer = Writer(background=False)
    path = _submit(writer, None, workdir, parts, model, optimizer, dist, keep, sharded, ema)
    failure = writer.wait()
    barrier(dist)  # no process moves on (or reads it) before the checkpoint is in place
    if failure is not None:
        raise CheckpointError(failure.line)
    return path


def _submit(writer: Writer, staging: Staging | None, workdir: Path, parts: dict, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, dist: Dist, keep: int, sharded: bool,
            ema: TensorState | None = None, written: Callable[[Path], None] | None = None) -> Path:
    """Hand the checkpoint of parts["step"] to `writer`: staged first (`staging`: a copy the
    writer's thread reads while training goes on), or, without it, written from the live tensors.
    In the writer, in order: older runs' checkpoints from this step on go, the checkpoint is
    written (checksum last), the `keep` newest are kept, and `written(path)` is told (rank 0)."""
    step = int(parts["step"])
    tensors = {} if ema is None else {"ema": ema.state_dict()}
    after = _after(workdir, step, keep, dist, written)
    fail = injected(step, dist.rank, workdir)
    if sharded:
        path = state.checkpoint_dir(workdir, step)
        if dist.is_main:  # before the temporary directory: nothing of this write is ever discarded
            state.discard_from(workdir, step)
        if staging is not None:
            finish = write_shards_async(path, model, optimizer, parts, dist, staging.group(dist), tensors,
                                        fail, staging.dcp_stager(dist.device))
            writer.submit(lambda: after(finish()), path)
        else:
            writer.submit(lambda: after(write_shards(path, model, optimizer, parts, dist, tensors, fail)),
                          path)
        return path
    path = state.checkpoint_path(workdir, step)
    if dist.is_main:
        whole = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **tensors}
        # `parts` is built for this checkpoint and not changed after: only the tensors are staged
        whole = {**parts, **(whole if staging is None else staging.stage(whole))}

        def write() -> None:
            state.discard_from(workdir, step)
            state.save_state(path, whole, fail=fail)
            after(path)

        writer.submit(write, path)
    return path


def _after(workdir: Path, step: int, keep: int, dist: Dist,
           written: Callable[[Path], None] | None) -> Callable[[Path], None]:
    """What follows a checkpoint `path` complete and checksummed, on rank 0: the `corrupt` fault of
    its step (writer.damage), the `keep` newest kept, then `written(path)`."""

    def after(path: Path) -> None:
        if not dist.is_main:
            return
        if faults.armed("corrupt", step, dist.rank, workdir):
            damage(path)
        state.keep_newest(workdir, keep)
        if written is not None:
            written(path)

    return after


class TensorState(Protocol):
    """A part saved as tensors laid out like the model's (train.ema.WeightEma): loaded in place."""

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class TrainStream(Protocol):
    """The train stream as a checkpointed part (data.batches.MappedTrainStream,
    data.streams.TrainStream): placed before its first batch, by its saved state or, without one, at
    a micro-batch of the run."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def seek(self, micro_batch: int) -> None: ...

    def skip(self, skips: tuple) -> None: ...

    def rewind(self) -> None: ...


class CheckpointManager:
    """Saves, rotates and loads the training state of one run, for the loop. `model` is the module
    as parallelized (not compiled: its state dict has the plain names); `stream`: this rank's train
    stream, not yet begun; `sharded`: parallelize sharded the model, so its parts are saved as
    shards in `state-<step>/`, else as one `state-<step>.pt`; `ema`: the weight EMA, if the run
    keeps one."""

    def __init__(self, workdir: Path, recipe: Recipe, dist: Dist, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, stream: TrainStream, sharded: bool,
                 resume_from: Checkpoint | None = None, ema: TensorState | None = None):
        self.workdir, self.recipe, self.dist = workdir, recipe, dist
        self.model, self.optimizer, self.stream, self.sharded = model, optimizer, stream, sharded
        self.resume_from, self.ema = resume_from, ema
        # run.ckpt_dir: rank 0 uploads each checkpoint once it is in place
        self.mirror = (remote.Mirror(recipe.run.ckpt_dir, recipe.run.keep_checkpoints)
                       if recipe.run.ckpt_dir and dist.is_main else None)
        self.skips: Windows = ()  # windows of steps whose batches are skipped (load)
        # the loop's stall at checkpoints (a preflight's estimate of a run scales it): staging and
        # waiting for the write before, with run.ckpt_async; the whole write without
        self.seconds = 0.0
        self.writer = Writer(background=recipe.run.ckpt_async)
        self.staging = Staging() if recipe.run.ckpt_async else None
        self.failed: list[str] = []  # the lines of the writes that failed since the last that did not
        self.recipe_dict = to_dict(recipe)  # in every checkpoint: made once (1 ms of the stall)

    def load(self, recorded: Windows = ()) -> int:
        """The model, optimizer, EMA and train stream as the checkpoint left them; the step to
        continue from (0: a fresh run, nothing loaded). The batches skipped from then on: the
        recipe's data.skip_steps, the checkpoint's and the `recorded` ones (a rollback's, kept
        beside the checkpoints in case none was written since: train/rollback.py), merged."""
        data = self.resume_from[1].get("data", {}) if self.resume_from else {}
        kept = [tuple(w) for w in data.get("skips", [])]
        kept += list(recorded) if self.resume_from else []  # a fresh run's are an abandoned one's
        self.skips = merged(skip_windows(self.recipe.data.skip_steps), *kept)
        self.stream.skip(self.skips)
        if self.resume_from is None:
            return 0
        path, saved = self.resume_from
        if path.is_dir():  # `saved` is the part beside the shards
            states = {} if self.ema is None else {"ema": self.ema.state_dict()}  # loaded in place
            load_shards(path, self.model, self.optimizer, self.dist.control, states)
        else:
            _load_whole(path, saved, self.model, self.optimizer)
            self._load_ema(path, saved)
        step = int(saved["step"])
        self._load_stream(saved.get("data", {}).get("streams") or [], step)
        if self.dist.is_main:
            console.log(f"resuming from {path} at step {step}")
        return step

    def _load_ema(self, path: Path, saved: dict) -> None:
        """The EMA of a whole checkpoint, in place; one this run keeps must be there (the recipe
        check lets no EMA-less checkpoint resume into a run that keeps one, but a hand-made file
        could)."""
        if self.ema is None:
            return
        if "ema" not in saved:
            raise CheckpointError(f"{path}: holds no EMA weights, but ema.decay={self.recipe.ema.decay} "
                                  "keeps them; resume with the recipe it was saved with")
        try:
            self.ema.load_state_dict(saved["ema"])
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    def _load_stream(self, states: list[dict], step: int) -> None:
        """This rank's train stream at `step`: where its state in the checkpoint says (a streamed
        split goes on from its saved position, reading nothing twice), which must agree with the
        step; from a checkpoint without one (an older map-style run's) or of another world size,
        placed by the step alone."""
        micro_batch = step * micro_batches(self.recipe, self.dist.world_size)[1]
        if len(states) != self.dist.world_size:
            _warn_resplit(states, self.dist)
            self.stream.seek(micro_batch)
            return
        self.stream.load_state_dict(states[self.dist.rank])
        at = self.stream.state_dict()["micro_batches"]
        if at != micro_batch:
            raise CheckpointError(f"the checkpoint of step {step} has this rank's train stream at "
                                  f"micro-batch {at}, not {micro_batch}: its data position and step disagree")

    def settle(self) -> None:
        """The write in flight ended and judged on every rank alike, before the checkpoints are read
        back in this process (a rollback): every rank then finds the same newest one."""
        self._judge(all_gather(self.writer.wait(), self.dist))

    def roll_back(self, checkpoint: Checkpoint, recorded: Windows) -> int:
        """Back to `checkpoint` in this process (a loss spike: train/rollback.py), its stream let
        go and placed again, skipping `recorded` too; the step it holds."""
        self.stream.rewind()
        self.resume_from = checkpoint
        return self.load(recorded)

    def save(self, step: int) -> Path:
        """A checkpoint of everything resuming needs after `step`, every rank's train stream state
        with it; the oldest beyond run.keep_checkpoints go. Every rank calls it. With run.ckpt_async
        it returns once the state is staged, and a thread writes it; the previous write (ended
        first: one at a time) is judged here."""
        t0 = time.perf_counter()
        r, dist = self.recipe, self.dist
        earlier = self.writer.wait()
        # one collective for both: every rank's stream, and every rank's word on the last write
        streams, said = zip(*all_gather((self.stream.state_dict(), earlier), dist), strict=True)
        self._judge(said)
        data = {"step": step, "examples": step * r.data.batch_size, "world_size": dist.world_size,
                "streams": list(streams), "skips": [list(w) for w in self.skips]}
        parts = {"step": step, "data": data, "recipe": self.recipe_dict, "format": state.FORMAT}
        path = _submit(self.writer, self.staging, self.workdir, parts, self.model, self.optimizer, dist,
                       r.run.keep_checkpoints, self.sharded, self.ema, self._written)
        if not self.writer.background:  # also the barrier: no process moves on before it is in place
            self.settle()
        self.seconds += time.perf_counter() - t0
        return path

    def _written(self, path: Path) -> None:
        """Called in the writer (rank 0's thread with run.ckpt_async) once the checkpoint `path` is
        complete, checksummed and rotated: its copy to run.ckpt_dir, if the run keeps one (the
        upload retries, then warns: it never fails the write, and the next one catches up)."""
        if self.mirror is not None:
            self.mirror.upload(path)

    def _judge(self, said: tuple | list) -> None:
        """What a write's failure does to the run, on every rank alike (`said`: every rank's
        writer.Failure or None). A full disk or a lost mount (transient) is a warning: the state is
        still in memory, the checkpoint before stays the newest on disk, and the next checkpoint
        tries again; the FAILURES_IN_A_ROW-th in a row stops the run. Any other failure stops it at
        once."""
        failures = [f for f in said if f is not None]
        if not failures:
            self.failed = []
            return
        line = failures[0].line
        self.failed.append(line)
        if not all(f.transient for f in failures):
            raise CheckpointError(f"{line}; the run stops, its newest checkpoint on disk is whole")
        if len(self.failed) >= FAILURES_IN_A_ROW:
            raise CheckpointError(f"{line}; {len(self.failed)} checkpoints in a row failed to write, so the "
                                  f"run stops: {_FIX}")
        if self.dist.is_main:
            console.log(f"[yellow]warning: {line}; training goes on and the next checkpoint tries "
                        f"again (the newest on disk is older: {_FIX})")

    @contextlib.contextmanager
    def writing(self) -> Iterator[CheckpointManager]:
        """The training loop's block: on every way out, the write in flight ends first (no thread
        writes while the process exits). On the normal way, the last write is judged and must have
        succeeded (the run is finished only with its last checkpoint); on an exception (a signal's
        Interrupted, an error) a failed write is a warning, and the exception goes on."""
        try:
            yield self
        except BaseException:
            failure = self.writer.wait()  # this rank's only: the others may not be here
            if failure is not None:
                console.log(f"[yellow]warning: {failure.line}; a resume starts from the newest "
                            "checkpoint on disk")
            raise
        finally:
            self.writer.wait_quietly()
            if self.staging is not None:
                self.staging.close()
        # the last write: in flight until now, or (written in the loop) judged there already
        said = [f.line for f in all_gather(self.writer.wait(), self.dist) if f is not None]
        last = said or (self.failed[-1:] if not self.writer.background else [])
        if last:
            raise CheckpointError(f"{last[0]}; the run's last checkpoint is not written: {_FIX}")

    def spent(self) -> dict[str, float]:
        """time/checkpoint_s: the seconds the loop waited at checkpoints (the stall: staging, and
        the wait for the previous write, with run.ckpt_async; the whole write without);
        time/checkpoint_write_s: the seconds the writes took, in whichever thread wrote."""
        return {"time/checkpoint_s": self.seconds, "time/checkpoint_write_s": self.writer.seconds}


def _load_whole(path: Path, saved: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A whole checkpoint's model and optimizer, in place. The recipe matched (resume_point), so
    tensors that do not fit mean the network's code changed since the checkpoint was written: one
    line naming the file and torch's first complaint, not torch's page of keys."""
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: its tensors do not fit this vitcli's network ({first_line(e)}): "
                              f"written by another version (checkpoint format {saved.get('format', 0)}); "
                              "resume with that version, or start over with --no-resume") from None


def _warn_resplit(states: list[dict], dist: Dist) -> None:
    """A streamed split's saved positions are per rank: on another world size each rank re-reads its
    new share (a map-style split's batches do not depend on the world size: nothing to say)."""
    # older states: streamed only
    streamed = states and states[0].get("kind", "streamed") == "streamed"
    if streamed and dist.is_main:
        console.log(f"[yellow]warning: the stream was split over {len(states)} process(es), now "
                    f"{dist.world_size}: each rank re-reads its new share up to this step, and the "
                    "example order differs from the run's")
