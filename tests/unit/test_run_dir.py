"""A run directory's rules, decided once (runtime.run_dir): its newest checkpoint by name, whether
its run is finished (one answer for the workdir refusal, the checkpoint manager, the sweep, the
SLURM requeue step and `--slurm`), and the one list of recipe keys that do not change a result, with
its two uses."""

import json
import subprocess
import sys

import pytest

from vitcli.checkpoints import manager
from vitcli.cluster import requeue
from vitcli.errors import OutputError
from vitcli.recipe.layers import flatten, to_dict
from vitcli.recipe.schema import Recipe
from vitcli.runtime import finished as finished_evaluations
from vitcli.runtime import run_dir
from vitcli.runtime.run_dir import finished, newest_step
from vitcli.runtime.run_files import MODEL_FILE, SUMMARY_FILE
from vitcli.runtime.workdir import refuse_finished
from vitcli.stages import sweep


def test_the_newest_step_and_finished_are_read_from_the_names(tmp_path):
    assert newest_step(tmp_path) == 0 and finished(tmp_path) is None
    for name in ("state-40.pt", "state-120.pt", "state-80", "state-7.pt.sha256",
                 ".state-200.pt.abc.tmp", "state-300.pt.sha256", "state-x.pt"):
        (tmp_path / name).touch()
    assert newest_step(tmp_path) == 120, "a checksum alone, a temporary or another name is none"
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"steps": 120, "val/top1": 0.5}))
    assert finished(tmp_path) is None, "no final weights yet"
    (tmp_path / MODEL_FILE).touch()
    assert finished(tmp_path) == {"steps": 120, "val/top1": 0.5}
    (tmp_path / "state-160").mkdir()  # a checkpoint newer than the summary: another run's, after it
    assert finished(tmp_path) is None


@pytest.mark.parametrize("summary", ["{\"steps\": 12", "[12]", "{\"stage\": \"pretrain\"}",
                                     "{\"steps\": \"12\"}"])
def test_a_damaged_summary_is_not_a_finished_run(tmp_path, summary):
    (tmp_path / MODEL_FILE).touch()
    (tmp_path / "state-12.pt").touch()
    (tmp_path / SUMMARY_FILE).write_text(summary)
    assert finished(tmp_path) is None


def test_a_finished_run_whose_checkpoints_were_deleted_is_still_finished(tmp_path):
    (tmp_path / MODEL_FILE).touch()
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"steps": 12}))
    assert finished(tmp_path) == {"steps": 12}


def states(tmp_path):
    """(name, workdir) for each kind of run directory the five users must agree on."""
    def make(name, files, summary=None):
        path = tmp_path / name
        path.mkdir()
        for f in files:
            (path / f).touch()
        if summary is not None:
            (path / SUMMARY_FILE).write_text(json.dumps(summary))
        return name, path

    return [make("empty", []), make("training", ["state-4.pt"]),
            make("killed before its summary", ["state-8.pt", MODEL_FILE]),
            make("finished", ["state-4.pt", "state-8.pt", MODEL_FILE], {"steps": 8}),
            make("finished, checkpoints deleted", [MODEL_FILE], {"steps": 8}),
            make("another run after it", ["state-8.pt", "state-12.pt", MODEL_FILE], {"steps": 8})]


def test_every_user_of_finished_gives_the_same_answer(tmp_path):
    for name, workdir in states(tmp_path):
        expected = name.startswith("finished")
        assert (finished(workdir) is not None) == expected, name
        try:
            refuse_finished(workdir, overwrite=False)
            refused = False
        except OutputError:
            refused = True
        assert refused == expected, name
        refuse_finished(workdir, overwrite=True)  # --overwrite: never refused
        steps = newest_step(workdir)  # the manager's resume point (here: the newest by name)
        start = (workdir / f"state-{steps}.pt", {"step": steps})
        resumed = manager.finished_summary(workdir, start)
        assert (resumed is not None) == (expected and steps == 8), name
        # a step that failed (exit 1): done only when the run is finished (an exit 0 is done either way:
        # a search's pruned trial ends unfinished, test_cluster.py)
        outcome = requeue.decide(1, "", finished(workdir) is not None, False, [], 3)
        assert (outcome.action == "done") == expected, name
        # what the batch script's end step decides (no signal: done or fail, no scontrol)
        ended = requeue.end(workdir, 1, "", 3)
        assert (ended.action == "done") == expected, name
    assert sweep.finished is finished, "a sweep point is finished by the same rule"


def test_the_manager_verifies_its_resume_point_on_top(tmp_path):
    """A finished run whose last checkpoint is damaged resumes from the one before: not finished
    for the manager."""
    (tmp_path / MODEL_FILE).touch()
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"steps": 8}))
    assert manager.finished_summary(tmp_path, (tmp_path / "state-4.pt", {"step": 4})) is None
    last = (tmp_path / "state-8.pt", {"step": 8})
    assert manager.finished_summary(tmp_path, last) == {"steps": 8}
    assert manager.finished_summary(tmp_path, None) is None


def test_one_list_of_keys_that_do_not_change_a_result_with_its_two_uses():
    keys = list(flatten(to_dict(Recipe())))
    for use in (run_dir.RESUMABLE, run_dir.HOW_RUN):
        assert use[:len(run_dir.NOT_RESULT)] == run_dir.NOT_RESULT
        for key in use:  # each names a key, or a section by its prefix
            assert any(k == key or (key.endswith(".") and k.startswith(key)) for k in keys), key
    assert manager.RESUMABLE is run_dir.RESUMABLE
    assert finished_evaluations.HOW_RUN is run_dir.HOW_RUN
    assert "slurm." in run_dir.RESUMABLE and "run.ckpt_every_minutes" in run_dir.RESUMABLE
    assert "run.strategy" not in run_dir.RESUMABLE, "a checkpoint is laid out by the strategy"


def test_the_rules_and_the_requeue_step_are_torch_free():
    probe = ("import sys, vitcli.runtime.run_dir, vitcli.cluster.requeue; "
             "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
