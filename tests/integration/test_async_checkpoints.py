"""Checkpoints written in the background (run.ckpt_async): the same weights as the synchronous
writer, a kill in the middle of a write leaves a workdir that resumes, a full disk at a checkpoint
loses nothing, a damaged newest checkpoint is skipped at resume, and a failed write is one line."""

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from async_fsdp_ranks import STEPS, TINY

from helpers import warnings
from vitcli.checkpoints import manager, state
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import CheckpointError
from vitcli.recipe.resolve import resolve
from vitcli.runtime.faults import ENV as FAULTS
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


def weights(workdir):
    return load_weights(workdir / MODEL_FILE)[0]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def temporaries(workdir):
    return sorted(p.name for p in workdir.glob(".*.tmp"))


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """The synchronous writer's run: its workdir and summary."""
    workdir = tmp_path_factory.mktemp("sync")
    return workdir, one_run(recipe("run.ckpt_async=false"), workdir)


def test_async_and_sync_writers_leave_the_same_weights_and_checkpoints(tmp_path, sync_run):
    sync_dir, sync_summary = sync_run
    summary = one_run(recipe(), tmp_path)
    assert not [t for t in threading.enumerate() if t.name.startswith("write ")], (
        "a writer outlived the run"
    )
    assert same(weights(tmp_path), weights(sync_dir))
    for step in range(1, STEPS + 1):  # each staged copy is the state of its step, not a later one
        ours, theirs = (state.load_state(d / f"state-{step}.pt") for d in (tmp_path, sync_dir))
        for part in ("model", "ema"):
            assert same(ours[part], theirs[part]), (step, part)
        assert ours["optimizer"]["state"].keys() == theirs["optimizer"]["state"].keys()
        for k, slot in ours["optimizer"]["state"].items():
            assert same(slot, theirs["optimizer"]["state"][k]), (step, k)
    for s in (summary, sync_summary):  # the stall, and the writes' own time apart
        assert s["time/checkpoint_s"] > 0 and s["time/checkpoint_write_s"] > 0
    assert temporaries(tmp_path) == []


def test_a_full_disk_at_a_checkpoint_warns_loses_nothing_and_the_next_one_is_written(
    tmp_path, monkeypatch, logged, sync_run
):
    monkeypatch.setenv(FAULTS, "enospc@2")
    one_run(recipe(), tmp_path)
    (warning,) = warnings(logged)
    assert "state-2.pt" in warning and "No space left on device" in warning and "\n" not in warning
    assert "the next checkpoint tries again" in warning and "free space there" in warning
    assert not (tmp_path / "state-2.pt").exists() and temporaries(tmp_path) == [], (
        "its temp file went"
    )
    assert [p.name for p in state.checkpoints(tmp_path)] == [
        "state-4.pt",
        "state-3.pt",
        "state-1.pt",
    ]
    assert same(weights(tmp_path), weights(sync_run[0])), (
        "training went on from its state in memory"
    )


def test_a_full_disk_at_the_last_checkpoint_stops_in_one_line_and_resuming_finishes(
    tmp_path, monkeypatch, capsys, sync_run
):
    from helpers import run_vit

    monkeypatch.setenv(FAULTS, f"enospc@{STEPS}")
    args = ["pretrain", "--workdir", tmp_path, *TINY]
    code, _, err = run_vit(monkeypatch, capsys, *args)
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]  # after the log
    assert code == 2 and "Traceback" not in err, err
    assert f"state-{STEPS}.pt" in line and "No space left on device" in line, line
    assert "last checkpoint is not written" in line and "run the same command again" in line, line
    assert (
        manager.latest_good_state(tmp_path)[1]["step"] == STEPS - 1 and temporaries(tmp_path) == []
    )
    code, _, err = run_vit(
        monkeypatch, capsys, *args
    )  # the fault fired once: the disk has room now
    assert code == 0, err
    assert same(weights(tmp_path), weights(sync_run[0]))


def test_three_failed_writes_in_a_row_stop_the_run_at_the_next_checkpoint(tmp_path, monkeypatch):
    def full(path, whole, fail=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(state, "save_state", full)
    with pytest.raises(CheckpointError) as e:
        one_run(recipe("schedule.steps=6"), tmp_path)
    line = str(e.value)  # judged at step 4's checkpoint: the writes of steps 1-3 failed
    assert "state-3.pt" in line and "3 checkpoints in a row failed" in line and "\n" not in line


def test_an_error_in_the_writer_thread_surfaces_in_the_training_process_as_one_line(
    tmp_path, monkeypatch
):
    def broken(path, whole, fail=None):
        raise TypeError("cannot pickle 'generator' object")

    monkeypatch.setattr(state, "save_state", broken)
    with pytest.raises(CheckpointError) as e:
        one_run(recipe(), tmp_path)
    line = str(e.value)  # not a disk's: no retry, the run stops at the next checkpoint
    assert line.startswith(
        f"{tmp_path / 'state-1.pt'}: could not be written (TypeError: cannot pickle"
    )
    assert "\n" not in line


def test_a_corrupted_newest_checkpoint_is_skipped_at_resume(
    tmp_path, monkeypatch, logged, sync_run
):
    monkeypatch.setenv(FAULTS, f"corrupt@{STEPS}")
    one_run(recipe(), tmp_path)
    (tmp_path / MODEL_FILE).unlink()  # as if killed before the end's own files
    with pytest.raises(CheckpointError, match="sha256 differs"):
        state.verify_checksum(tmp_path / f"state-{STEPS}.pt")
    one_run(recipe(), tmp_path)
    (warning,) = warnings(logged)
    assert f"state-{STEPS}.pt" in warning and f"resuming from state-{STEPS - 1}.pt" in warning
    assert same(weights(tmp_path), weights(sync_run[0]))


def test_a_kill_in_the_middle_of_a_background_write_leaves_a_workdir_that_resumes(
    tmp_path, sync_run
):
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        FAULTS: "kill_write@3",
    }
    cmd = [sys.executable, "-m", "vitcli.cli", "pretrain", "--workdir", str(tmp_path), *TINY]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (half,) = temporaries(tmp_path)  # the write of step 3, half its bytes there
    assert half.startswith(".state-3.pt.")
    path, saved = manager.latest_good_state(tmp_path)
    assert path.name == "state-2.pt" and saved["step"] == 2, "the one before stayed whole"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert temporaries(tmp_path) == [], "the killed write's temp file went"
    assert same(weights(tmp_path), weights(sync_run[0]))
