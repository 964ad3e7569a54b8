"""Searches (`--search KEY=DIST ... --trials N`): an Optuna study in WORKDIR/search.journal whose
trials are runs in WORKDIR/trial-<k>, the weak ones pruned on val/top1 (PRUNED in the study,
`pruned` in the table, their runs left unfinished); Ctrl-C and the same command resume it, no
finished trial retrained, to the same trials an uninterrupted search runs; SLURM array tasks share
the journal; bad input is one line before anything is written."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from helpers import REPO, refused, run_vit, snapshot
from vitcli import cli
from vitcli.runtime.run_dir import finished
from vitcli.runtime.run_files import SEARCH_JOURNAL, SWEEP_CSV, SWEEP_FILE
from vitcli.train import loop

QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")
# the quickstart's network at depth 1, six steps on 2 classes, evaluated every 2 steps; pruned after
# one trial finished (search.prune_after=1). Untrained, the seeds' held-out accuracies differ by
# chance: a trial whose best so far is below the first's at a step is pruned there
TINY = ["model.depth=1", "schedule.epochs=0", "schedule.steps=6", "schedule.warmup_steps=1",
        "data.synthetic.num_classes=2", "data.synthetic.train_size=32", "data.synthetic.val_size=64",
        "data.synthetic.test_size=16", "data.batch_size=16", "run.log_every=1", "run.eval_every=2",
        "run.ckpt_every=2", "search.prune_after=1"]
SPACE = ["--search", "optim.lr=log:1e-4:3e-3", "--search", "run.seed=0:1000", "--trials", "3"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def pretrain(workdir: Path, *args) -> list:
    return ["pretrain", "-r", QUICK, "--workdir", workdir, *TINY, *args]


def study(workdir: Path) -> list[tuple]:
    """(number, state, params, intermediate values, value) of every trial in the workdir's journal."""
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(workdir / SEARCH_JOURNAL)))
    trials = optuna.load_study(study_name="search", storage=storage).get_trials()
    return [(t.number, t.state.name, t.params, t.intermediate_values, t.value) for t in trials]


def csv_rows(workdir: Path) -> list[dict]:
    with open(workdir / SWEEP_CSV) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The search run once, uninterrupted, as the command line runs it (cli.main, in this process)."""
    workdir = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["vit", *map(str, pretrain(workdir, *SPACE))])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code
    assert not code
    return workdir


def test_a_search_runs_its_trials_prunes_the_weak_and_tabulates_them(reference):
    trials = study(reference)
    assert [t[1] for t in trials].count("PRUNED") >= 1, trials  # and the others COMPLETE
    assert {t[1] for t in trials} <= {"COMPLETE", "PRUNED"} and len(trials) == 3
    rows = csv_rows(reference)
    assert [r["point"] for r in rows] == ["trial-000", "trial-001", "trial-002"]
    for (number, state, params, reports, value), r in zip(trials, rows, strict=True):
        assert float(r["optim.lr"]) == params["optim.lr"] and int(r["run.seed"]) == params["run.seed"]
        assert sorted(reports) in ([2], [2, 4]), reports  # reported at each periodic evaluation
        point = reference / r["point"]
        if state == "PRUNED":  # stopped where it was pruned, its run left unfinished
            assert r["status"] == "pruned" and r["val/top1"] == "" and finished(point) is None
            assert int(r["trial/steps"]) == max(reports) < 6
        else:
            summary = finished(point)
            assert r["status"] == "finished" and summary["val/top1"] == value == float(r["val/top1"])
            assert int(r["trial/steps"]) == summary["steps"] == 6
    table = json.loads((reference / SWEEP_FILE).read_text())
    complete = {r["point"]: float(r["val/top1"]) for r in rows if r["status"] == "finished"}
    assert table["best"] == max(complete, key=complete.get)
    assert table["pruned"] == [r["point"] for r in rows if r["status"] == "pruned"]


def test_ctrl_c_then_the_same_command_resumes_to_the_same_trials(reference, tmp_path, monkeypatch, capsys):
    real, calls = loop._accumulate_grads, []

    def ctrl_c_in_the_second_trial(*args, **kwargs):  # a real SIGINT, at its second step
        calls.append(1)
        if len(calls) == 6 + 2:  # the first trial's 6 steps, then 2
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "_accumulate_grads", ctrl_c_in_the_second_trial)
        code, _, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *SPACE))
    assert code == 130, err  # the step finished, its checkpoint written
    assert (tmp_path / "trial-001" / "state-2.pt").is_file()
    assert [t[1] for t in study(tmp_path)] == ["COMPLETE", "RUNNING"]  # taken up by the next command
    first = snapshot(tmp_path / "trial-000")

    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *SPACE))
    assert code == 0, err
    assert snapshot(tmp_path / "trial-000") == first, "a finished trial is never retrained"
    assert study(tmp_path) == study(reference), "the trials an uninterrupted search runs, exactly"
    again = csv_rows(tmp_path)
    keep = ["point", "optim.lr", "run.seed", "status", "val/top1", "trial/steps"]
    assert [{k: r[k] for k in keep} for r in again] == [{k: r[k] for k in keep} for r in csv_rows(reference)]

    before = snapshot(tmp_path)  # a finished search again: nothing trained, no file touched
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *SPACE))
    assert code == 0 and snapshot(tmp_path) == before and "search of 3 trials" in out


def test_two_array_tasks_share_one_journal_at_once(tmp_path, monkeypatch, capsys):
    """Two `--search-task` processes at the same time, as a SLURM array's tasks: each asks the study
    for a trial and trains it in its own slot; the one that finishes the last writes the table."""
    two = ["--search", "optim.lr=log:1e-4:3e-3", "--trials", "2"]
    other = subprocess.Popen([sys.executable, "-m", "vitcli", *map(str, pretrain(
        tmp_path, *two, "--search-task", "1"))], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    training = tmp_path / "trial-001" / "metrics.jsonl"  # task 1 holds its trial: task 0 asks now
    deadline = time.monotonic() + 240
    while not training.exists() and other.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    code, _, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *two, "--search-task", "0"))
    assert code == 0, err
    _, err = other.communicate(timeout=240)
    assert other.returncode == 0, err.decode()[-2000:]
    trials = study(tmp_path)
    assert sorted(t[0] for t in trials) == [0, 1] and {t[1] for t in trials} <= {"COMPLETE", "PRUNED"}
    assert sorted(r["point"] for r in csv_rows(tmp_path)) == ["trial-000", "trial-001"]


def test_the_slurm_job_array_runs_one_trial_slot_per_task(tmp_path, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path / "w", *SPACE, "--slurm", "--dry-run"))
    assert code == 0, err
    assert "#SBATCH --array=0-2" in out and '--search-task "$SLURM_ARRAY_TASK_ID"' in out
    assert "--search optim.lr=log:1e-4:3e-3 --search run.seed=0:1000 --trials 3" in out
    assert "# search: 3 points as a job array" in err and "#   2: trial-002" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize(("args", "says"), [
    (["--search", "optim.lr=log:0:1", "--trials", "2"], "--search optim.lr=log:0:1: a log range"),
    (["--search", "optim.lr=1e-3", "--trials", "2"], "not a DIST"),
    (["--search", "optim.lr=log:1e-4:3e-3"], "--search needs --trials N"),
    (["--trials", "2"], "--trials belongs to a search"),
    (["--search", "optim.lr=log:1e-4:3e-3", "--trials", "2", "--sweep", "run.seed=0,1"],
     "--search with --sweep"),
    (["--search", "optim.lr=log:1e-4:3e-3", "--trials", "2", "--overwrite"], "--search with --overwrite"),
    (["--search", "optim.lr=log:1e-4:3e-3", "--trials", "2", "--search-task", "2"], "numbered 0 to 1"),
    (["--search", "optim.lr=log:1e-4:3e-3", "--trials", "2", "data.val_split="], "needs data.val_split"),
    (["--search", "data.mixup_alpha=0,-1", "--trials", "2"], "data.mixup_alpha"),  # a corner refused
])
def test_bad_input_is_one_line_before_anything_is_written(args, says, tmp_path, monkeypatch, capsys):
    err = refused(monkeypatch, capsys, tmp_path, *pretrain(tmp_path / "w", *args))
    assert says in err, err


def test_a_workdir_holding_a_search_of_another_space_is_refused(reference, tmp_path, monkeypatch, capsys):
    other = ["--search", "optim.lr=log:1e-4:1e-2", "--search", "run.seed=0:1000", "--trials", "3"]
    code, _, err = run_vit(monkeypatch, capsys, *pretrain(reference, *other))
    assert code == 2 and "holds a search of another space" in err, err
