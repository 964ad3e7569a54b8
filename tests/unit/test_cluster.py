"""The SLURM pieces without a cluster: time limits read as sbatch reads them, the slurm section's checks, the
requeue rules, and the batch script as text (valid bash, the lines sbatch and torchrun need)."""

import subprocess
from pathlib import Path

import pytest

from helpers import run_vit
from vitcli.cluster import slurm
from vitcli.cluster.requeue import decide
from vitcli.errors import RecipeError
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_seconds
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import SlurmConfig

DAY, HOUR, MINUTE = 86_400, 3_600, 60
SHORT = ["schedule.steps=10", "schedule.warmup_steps=1"]


@pytest.mark.parametrize("text, seconds", [
    ("90", 90 * MINUTE), ("05:30", 5 * MINUTE + 30), ("1:30:00", HOUR + 30 * MINUTE),
    ("2-12", 2 * DAY + 12 * HOUR), ("2-12:30", 2 * DAY + 12 * HOUR + 30 * MINUTE),
    ("1-00:00:05", DAY + 5), ("", 0), ("UNLIMITED", 0), ("infinite", 0)])
def test_time_limits_read_as_sbatch_reads_them(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("override, names", [
    ("slurm.nodes=0", "slurm.nodes"), ("slurm.time=1h", "slurm.time"), ("slurm.mem=lots", "slurm.mem"),
    ("slurm.port=70000", "slurm.port"), ("slurm.extra=[exclusive]", "slurm.extra"),
    ("slurm.time=1", "slurm.signal_seconds")])
def test_a_bad_slurm_key_is_refused_at_resolve_time_naming_it(override, names):
    with pytest.raises(RecipeError, match=names.replace(".", r"\.")):
        resolve("pretrain", None, [*SHORT, override])


def test_processes_per_node_follow_the_gpus_unless_said():
    assert procs_per_node(SlurmConfig()) == 1
    assert procs_per_node(SlurmConfig(gpus_per_node=8)) == 8
    assert procs_per_node(SlurmConfig(gpus_per_node=8, procs_per_node=2)) == 2


def attempt(signal="USR2", action="requeue", progress=True):
    return {"signal": signal, "action": action, "progress": progress}


def test_a_finished_run_is_never_requeued_even_when_the_warning_came_late():
    assert decide(140, "USR2", finished=True, progress=True, history=[], max_requeues=3).action == "done"


def test_a_crash_is_not_requeued():
    outcome = decide(1, "", finished=False, progress=True, history=[], max_requeues=3)
    assert outcome.action == "fail" and "without a signal" in outcome.why


def test_a_stop_slurm_asked_for_is_requeued():
    assert decide(1, "USR2", False, True, [], 3).action == "requeue"
    assert decide(1, "TERM", False, True, [], 3).action == "requeue"


def test_time_limit_requeues_are_bounded_and_preemptions_are_not():
    history = [attempt() for _ in range(3)]
    spent = decide(1, "USR2", False, True, history, max_requeues=3)
    assert spent.action == "fail" and "slurm.max_requeues=3" in spent.why
    assert decide(1, "TERM", False, True, history, max_requeues=3).action == "requeue"
    preempted = [attempt("TERM") for _ in range(10)]  # preemptions do not count against the bound
    assert decide(1, "USR2", False, True, preempted, max_requeues=3).action == "requeue"


def test_a_time_limit_without_progress_is_requeued_once_and_not_a_second_time_in_a_row():
    assert decide(1, "USR2", False, False, [attempt()], 20).action == "requeue"
    again = decide(1, "USR2", False, False, [attempt(progress=False)], 20)
    assert again.action == "fail" and "nor the one before" in again.why
    # progress in between: the count starts over
    assert decide(1, "USR2", False, False, [attempt(progress=False), attempt()], 20).action == "requeue"
    # a preemption is the cluster's doing, however early it comes
    assert decide(137, "TERM", False, False, [attempt("TERM", progress=False)], 20).action == "requeue"


def job(tmp_path: Path, points: int = 0) -> slurm.Job:
    return slurm.Job("pretrain", ("--sweep", "optim.lr=1e-3,3e-3") if points else (),
                     tmp_path / "my runs" / "vit b", tmp_path, "/opt/venv/bin/python", points)


def test_the_batch_script_is_bash_with_sbatchs_lines_and_one_torchrun_per_node(tmp_path):
    cfg = SlurmConfig(nodes=4, gpus_per_node=8, cpus_per_task=64, mem="0", partition="gpu", time="2-00:00:00",
                      qos="high", account="vision", constraint="h100", extra=["--exclusive"])
    text = slurm.batch_script(cfg, job(tmp_path), "a test")
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
    lines = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    for want in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64", "--mem=0",
                 "--partition=gpu", "--time=2-00:00:00", "--qos=high", "--account=vision",
                 "--constraint=h100", "--signal=B:USR2@90", "--requeue", "--open-mode=append", "--exclusive"):
        assert f"#SBATCH {want}" in lines, want
    assert f"#SBATCH --output={tmp_path}/my runs/vit b/slurm/%j.out" in lines
    assert "--array" not in text
    assert "--nproc-per-node=8" in text and "--rdzv-backend=c10d" in text and "SIGUSR2" in text
    assert "'/tmp" not in text or f"'{tmp_path}/my runs/vit b'" in text  # a path with spaces, quoted


def test_a_sweep_is_a_job_array_each_task_one_point(tmp_path):
    cfg = SlurmConfig(array_parallel=2)
    text = slurm.batch_script(cfg, job(tmp_path, points=6), "a test")
    assert "#SBATCH --array=0-5%2" in text and '--sweep-point "$SLURM_ARRAY_TASK_ID"' in text
    assert "%A_%a.out" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir", "w",
                             *SHORT, "slurm.nodes=2", "slurm.gpus_per_node=4")
    assert code == 0, err
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out and "--nproc-per-node=4" in out
    assert list(tmp_path.iterdir()) == []


def test_the_batch_is_checked_against_the_jobs_processes(monkeypatch, capsys):
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", *SHORT,
                           "data.batch_size=12", "slurm.nodes=2", "slurm.gpus_per_node=4")
    assert code == 2 and "data.batch_size" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--resume", "--overwrite"])
def test_resume_flags_are_refused_with_slurm(flag, monkeypatch, capsys):
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", flag, *SHORT)
    assert code == 2 and "--slurm with" in err and "itself" in err


def test_without_sbatch_one_line_says_where_to_submit_from(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--workdir", tmp_path / "w",
                           *SHORT)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "sbatch is not on PATH" in lines[0], err
    assert not (tmp_path / "w").exists()
