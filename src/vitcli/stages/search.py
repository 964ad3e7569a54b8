"""Searches: `--search KEY=DIST ... --trials N`, an Optuna study whose trials are training runs, each
in WORKDIR/trial-<k>, and the sweep's table of them (stages/sweep.py's sweep.json and sweep.csv, the
best on val/top1 marked, the pruned ones said).

What is decided here, and why:
- The study lives in WORKDIR/search.journal (Optuna's JournalStorage on a JournalFileBackend): one
  file, appended under a lock, that SLURM array tasks share over NFS without a database.
- A trial's directory is a slot, `trial-<k>`, not its values: two trials may draw the same values
  (a categorical key), and two tasks must never train one directory. Without --search-task the
  slot is the lowest free one (the trial's number, in one process); a SLURM array task I owns
  `trial-<I>` (--search-task I), so the batch script knows its directory before it starts.
- Proposals are seeded per trial: TPESampler(seed=(run.seed, the number of trials before it)), so
  the same command proposes the same trials, and an interrupted search resumed proposes what it
  would have (a sampler seeded once would start its stream over in the resumed process).
- Pruning: Optuna's MedianPruner as it comes, on val/top1 reported at each periodic evaluation
  (run.eval_every, through the loop's Job.on_eval). A pruned trial is PRUNED in the study and
  `pruned` in the table; its directory keeps an unfinished run (no summary.json), which the skip
  rule does not take for finished, and which the search never trains again: the study says why.
- Resuming: a trial left RUNNING (Ctrl-C, SIGKILL, a requeue) is taken up again by the same
  command (by its array task's slot, with --search-task) with the values it drew, its run resumed
  from its last checkpoint; a finished trial is never retrained (the skip rule, and the study).
  So run one search in a workdir at a time, or its array tasks.
- A trial whose training fails (a non-finite loss, the device's memory) is FAIL in the study and
  `failed` in the table, with its error; it counts among the N (what its values do is the search's
  result), and the search goes on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from vitcli.checkpoints import remote
from vitcli.errors import RecipeError, TrainingError
from vitcli.recipe.grid import Point, point_name
from vitcli.recipe.schema import Recipe
from vitcli.recipe.space import Search, slot_name
from vitcli.run.build import run_training
from vitcli.runtime.dist import Dist, setup
from vitcli.runtime.metrics import console
from vitcli.runtime.run_dir import finished
from vitcli.runtime.run_files import SEARCH_JOURNAL, SWEEP_CSV
from vitcli.runtime.workdir import refuse_single_run
from vitcli.stages.sweep import DEV, publish, row, table

STUDY = "search"  # the study's name in its journal: one per workdir
SLOT = "point"  # the user attribute of a trial naming its directory
ERROR = "error"  # ... and a failed trial's error


def run_search(recipe: Recipe, workdir: Path, resume: bool | None = None, overwrite: bool = False, *,
               search: Search) -> dict:
    """`vit pretrain --search`: join the process group once, then search."""
    return search_study(search, workdir, setup(recipe.run.device), resume)


def search_study(search: Search, workdir: Path, dist: Dist, resume: bool | None = None) -> dict:
    """The study's trials run (or taken up again) to search.trials, or search.task's alone; returns
    what sweep.json holds, written once every trial is done."""
    refuse_single_run(workdir)
    optuna = _optuna()
    study = open_study(search, workdir)
    if search.task is not None:
        slot = slot_name(search.task)
        mine = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(SLOT) == slot]
        if not mine:
            _run(study, search, (_ask(study, search, slot), set()), workdir, dist, resume)
        elif mine[0].state == optuna.trial.TrialState.RUNNING:
            _run(study, search, _adopt(study, mine[0]), workdir, dist, resume)
    else:
        for stale in _states(study, "RUNNING"):  # one search at a time: none is another's
            _run(study, search, _adopt(study, stale), workdir, dist, resume)
        while len(study.get_trials(deepcopy=False)) < search.trials:
            _run(study, search, (_ask(study, search, _free_slot(study)), set()), workdir, dist, resume)
    return tabulate(study, search, workdir, dist)


def _optuna():
    """Optuna, imported only where a search runs (the `search` extra), its own log lines off."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def open_study(search: Search, workdir: Path):
    """The workdir's study, created (maximising val/top1, its space remembered) on the first call;
    a journal holding a search of another space is a RecipeError."""
    optuna = _optuna()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    workdir.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(workdir / SEARCH_JOURNAL)))
    try:  # loaded first: creating one that exists would append to the journal (a rerun writes nothing)
        study = optuna.load_study(study_name=STUDY, storage=storage, pruner=_pruner(search))
    except KeyError:
        study = _create(storage, search)
    held = study.user_attrs.get("space")
    if held is not None and held != search.texts():
        raise RecipeError(f"{workdir} holds a search of another space ({' '.join(held)}): give the same "
                          "--search options to resume it, or a new --workdir")
    return study


def _create(storage, search: Search):
    """The study, created with its space remembered; or, when another array task was first, its."""
    optuna = _optuna()
    try:
        study = optuna.create_study(storage=storage, study_name=STUDY, direction="maximize",
                                    pruner=_pruner(search))
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=STUDY, storage=storage, pruner=_pruner(search))
    study.set_user_attr("space", search.texts())
    return study


def _pruner(search: Search):
    cfg = search.config
    return _optuna().pruners.MedianPruner(n_startup_trials=cfg.prune_after,
                                          n_warmup_steps=cfg.prune_warmup_steps)


def trial_seed(seed: int, n: int) -> int:
    """The sampler's seed for the trial asked after `n` others: fixed by (run.seed, n) alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{n}".encode()).digest()[:4], "little")


def _ask(study, search: Search, slot: str):
    optuna = _optuna()
    n = len(study.get_trials(deepcopy=False))
    study.sampler = optuna.samplers.TPESampler(seed=trial_seed(search.seed, n),
                                               n_startup_trials=search.config.startup_trials)
    trial = study.ask()
    trial.set_user_attr(SLOT, slot)
    return trial


def _adopt(study, frozen):
    """A RUNNING trial of an earlier process as a Trial to report to and tell (the values it drew),
    and the steps it reported already."""
    optuna = _optuna()
    # the Trial of an id: Optuna offers no public way from a FrozenTrial to it
    return optuna.trial.Trial(study, frozen._trial_id), set(frozen.intermediate_values)


def _states(study, name: str) -> list:
    state = _optuna().trial.TrialState[name]
    return sorted((t for t in study.get_trials(deepcopy=False) if t.state == state), key=lambda t: t.number)


def _free_slot(study) -> str:
    used = {t.user_attrs.get(SLOT) for t in study.get_trials(deepcopy=False)}
    return next(slot_name(k) for k in range(len(used) + 1) if slot_name(k) not in used)


def _run(study, search: Search, taken: tuple, workdir: Path, dist: Dist, resume: bool | None) -> None:
    """One trial (`taken`: it and the steps it reported already): its values drawn (or the ones it
    holds), its run trained in its slot with each evaluation reported, and its outcome told to the
    study: COMPLETE with val/top1, PRUNED or FAIL."""
    optuna = _optuna()
    trial, reported = taken
    slot = trial.user_attrs[SLOT]
    values = {d.key: d.suggest(trial) for d in search.dists}
    if dist.is_main:
        console.rule(f"trial {trial.number + 1} of {search.trials}: {slot}, {point_name(values)}")
    recipe = remote.below(search.resolve(values), slot)  # its checkpoints in a place of their own
    if reported and trial.should_prune():
        # stopped (Ctrl-C) at the step the pruner stopped it: pruned there, as it would have been
        console.log(f"[yellow]{slot}: pruned at step {max(reported)}")
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    try:
        summary = run_training(recipe, workdir / slot, dist, resume, skip_note=f"{slot}: finished, skipped",
                               table=False, on_eval=_reporter(trial, reported))
    except optuna.TrialPruned as e:
        console.log(f"[yellow]{slot}: {e}")
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return
    except (TrainingError, torch.OutOfMemoryError) as e:  # one process (the CLI refuses torchrun)
        console.log(f"[red]{slot} failed: {e}; the search goes on")
        trial.set_user_attr(ERROR, f"{type(e).__name__}: {e}")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    if not isinstance(summary.get(DEV), float | int):
        trial.set_user_attr(ERROR, f"the run has no {DEV} (data.val_split)")
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return
    study.tell(trial, summary[DEV])


def _reporter(trial, reported: set):
    """Job.on_eval for a trial: val/top1 reported at its step, and TrialPruned returned (the loop
    raises it after the step's checkpoint and signals) when the pruner says so. A step a resumed
    trial `reported` before is not reported again."""

    def report(step: int, metrics: dict):
        value = metrics.get(DEV)
        if value is None or step in reported:
            return None
        trial.report(value, step)
        return _pruned(trial, step, value)

    return report


def _pruned(trial, step: int, value: float):
    """TrialPruned when the pruner stops the trial at its last report, else None."""
    if not trial.should_prune():
        return None
    return _optuna().TrialPruned(f"pruned at step {step}: its best {DEV} so far below the median of "
                                 f"the trials before it at that step ({value:.4f} now)")


def tabulate(study, search: Search, workdir: Path, dist: Dist) -> dict:
    """The study's trials as the sweep's table (a row per trial, in the order asked: its values,
    status, final metrics and trial/steps, the steps it trained), written once every one of the N
    is done; what sweep.json holds."""
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    keys = [d.key for d in search.dists]
    rows = [_row(t, keys, workdir) for t in trials]
    summary = {**table(rows, keys), "pruned": [r["point"] for r in rows if r["status"] == "pruned"]}
    done = sum(r["status"] != "pending" for r in rows)
    if done >= search.trials and done == len(rows):
        publish(workdir, summary, dist, f"search of {len(rows)} trials ({len(summary['pruned'])} pruned)")
    elif dist.is_main:
        console.log(f"{done} of {search.trials} trials done: the process that finishes the last writes "
                    f"{workdir / SWEEP_CSV}")
    return summary


def _row(trial, keys: list[str], workdir: Path) -> dict:
    state = trial.state.name
    point = Point(trial.user_attrs.get(SLOT, f"#{trial.number}"), {k: trial.params.get(k) for k in keys})
    if state == "FAIL":
        return row(point, None, trial.user_attrs.get(ERROR, "failed"))
    summary = finished(workdir / point.name) if state == "COMPLETE" else None
    out = row(point, summary)
    if state == "PRUNED":
        out["status"] = "pruned"
    steps = summary["steps"] if summary else max(trial.intermediate_values, default=None)
    return {**out, "trial/steps": steps} if steps is not None else out
