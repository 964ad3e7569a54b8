"""The SLURM pieces without a cluster: time limits read as sbatch reads them, the slurm section's
checks, the requeue rules, and the batch script as text (valid bash, the lines sbatch and torchrun
need)."""

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from helpers import run_vit
from vitcli.cluster import slurm
from vitcli.cluster.requeue import decide, ended_reason, stop_kind
from vitcli.errors import RecipeError
from vitcli.recipe.cluster_checks import procs_per_node, time_limit_seconds, time_limit_text
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import SlurmConfig
from vitcli.runtime.run_files import MODEL_FILE, SUMMARY_FILE

DAY, HOUR, MINUTE = 86_400, 3_600, 60
SHORT = ["schedule.steps=10", "schedule.warmup_steps=1"]


@pytest.mark.parametrize("text, seconds", [
    ("90", 90 * MINUTE), ("05:30", 5 * MINUTE + 30), ("1:30:00", HOUR + 30 * MINUTE),
    ("2-12", 2 * DAY + 12 * HOUR), ("2-12:30", 2 * DAY + 12 * HOUR + 30 * MINUTE),
    ("1-00:00:05", DAY + 5), ("", 0), ("UNLIMITED", 0), ("infinite", 0),
    ("1:00", MINUTE), ("1:00:00", HOUR), ("0", 0),  # sbatch: 0 is no limit
    ("2-0", 2 * DAY), ("0-0:0:90", 90), ("120:30", 2 * HOUR + 30)])
def test_time_limits_read_as_sbatch_reads_them(text, seconds):
    assert time_limit_seconds(text) == seconds


@pytest.mark.parametrize("override, names", [
    ("slurm.nodes=0", "slurm.nodes"), ("slurm.time=1h", "slurm.time"), ("slurm.mem=lots", "slurm.mem"),
    ("slurm.port=70000", "slurm.port"), ("slurm.extra=[exclusive]", "slurm.extra"),
    ("slurm.time=1", "slurm.signal_seconds")])
def test_a_bad_slurm_key_is_refused_at_resolve_time_naming_it(override, names):
    with pytest.raises(RecipeError, match=names.replace(".", r"\.")):
        resolve("pretrain", None, [*SHORT, override])


@pytest.mark.parametrize("text", ["1h", "1:2:3:4", "-5", "1-", "2-1:2:3:4", "1.5", "1:00 00", "1:00\n2"])
def test_a_time_sbatch_does_not_take_is_refused(text):
    with pytest.raises(RecipeError, match="slurm.time"):
        time_limit_seconds(text)


@pytest.mark.parametrize("time_limit", ["1", "1:00", "0:01:30", "0-0:1", "0-0:0:90"])
def test_a_time_limit_no_longer_than_the_warning_is_refused_in_every_form(time_limit):
    with pytest.raises(RecipeError, match=r"slurm\.signal_seconds=90 is not inside"):
        resolve("pretrain", None, [*SHORT, f"slurm.time={time_limit}"])
    assert resolve("pretrain", None, [*SHORT, f"slurm.time={time_limit}", "slurm.signal_seconds=30"])


@pytest.mark.parametrize("key", ["partition", "account", "qos", "constraint", "mem", "time"])
@pytest.mark.parametrize("char", ["\n", "\r", "\x00", "\x1b", "\u2028"])
def test_a_control_character_in_a_slurm_value_is_refused_naming_the_key(key, char):
    with pytest.raises(RecipeError, match=rf"^slurm\.{key}: .* holds the control character"):
        resolve("pretrain", None, [*SHORT, f"slurm.{key}=gpu{char}touch /tmp/owned"])


def test_a_control_character_in_an_extra_line_is_refused_naming_its_index(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text('slurm:\n  extra: ["--exclusive", "--mail-type=END\\ntouch /tmp/owned"]\n')
    with pytest.raises(RecipeError, match=r"^slurm\.extra\[1\]: .* holds the control character '\\n'"):
        resolve("pretrain", path, SHORT)


def test_a_newline_in_a_slurm_value_is_refused_by_the_dry_run_and_nothing_is_written(tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir", "w",
                             *SHORT, "slurm.partition=gpu\ntouch owned")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "slurm.partition" in err and list(tmp_path.iterdir()) == []


def test_a_workdir_with_a_newline_is_refused_before_the_script_is_shown(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir",
                             "w\ntouch owned", *SHORT)
    assert code == 2 and out == "" and "--workdir" in err and "control character" in err, err
    assert list(tmp_path.iterdir()) == []


HOSTILE = {"partition": "gpu --uid=0", "account": 'a"b #c', "qos": "q\\x y", "constraint": "h100&a100",
           "mem": "", "time": "1:00:00"}


def test_a_hostile_value_that_is_not_refused_stays_one_argument_on_its_line(tmp_path):
    plain = slurm.batch_script(SlurmConfig(partition="p", account="a", qos="q", constraint="c",
                                           time="1:00:00"), job(tmp_path), "a test")
    text = slurm.batch_script(SlurmConfig(**HOSTILE), job(tmp_path), "a test")
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
    assert len(text.splitlines()) == len(plain.splitlines())
    for name, value in HOSTILE.items():
        if value:  # sbatch reads an #SBATCH line as shlex does: blanks split, quotes and \ escapes group
            (line,) = [ln for ln in text.splitlines() if ln.startswith(f"#SBATCH --{name}=")]
            assert shlex.split(line.removeprefix("#SBATCH ")) == [f"--{name}={value}"], line
    with pytest.raises(RecipeError, match=r"slurm\.partition: .* control character"):  # not resolved
        slurm.batch_script(SlurmConfig(partition="gpu\ntouch /tmp/owned"), job(tmp_path), "a test")
    (output,) = [ln for ln in text.splitlines() if ln.startswith("#SBATCH --output=")]
    assert shlex.split(output.removeprefix("#SBATCH ")) == [f"--output={slurm.log_pattern(job(tmp_path))}"]


def test_every_path_on_a_shell_line_of_the_script_is_quoted(tmp_path):
    odd = slurm.Job("pretrain", ("--task", "a b;touch x"), tmp_path / "it's $(here)" / "w`x`",
                    tmp_path / "c d", "/opt/my venv/bin/python")
    for nodes, starts in ((1, "/opt/my venv/bin/python"), (2, "srun")):
        text = slurm.batch_script(SlurmConfig(nodes=nodes), odd, "a test")
        assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
        (launch,) = [ln for ln in text.splitlines() if "vitcli.cluster.launch" in ln]
        words = shlex.split(launch)
        assert words[0] == starts, launch
        assert words[words.index("--recipe") + 1] == str(odd.workdir / "slurm" / "recipe.yaml")
        assert words[words.index("--workdir") + 1] == str(odd.workdir)
        assert words[-3:] == ["--task", "a b;touch x", "&"] and "/opt/my venv/bin/python" in words
        assert f"WORKDIR={shlex.quote(str(odd.workdir))}" in text
        assert f"cd {shlex.quote(str(odd.cwd))}" in text
        (log,) = [ln for ln in text.splitlines() if ln.startswith("LOG=")]
        assert shlex.split(log.removeprefix("LOG=")) == [f"{odd.workdir}/slurm/$SLURM_JOB_ID.out"]


def test_more_processes_on_a_node_than_gpus_is_refused_naming_both_keys(monkeypatch, capsys):
    with pytest.raises(RecipeError, match=r"slurm\.procs_per_node=3 is more than slurm\.gpus_per_node=2"):
        resolve("pretrain", None, [*SHORT, "slurm.procs_per_node=3", "slurm.gpus_per_node=2"])
    for fine in (["slurm.procs_per_node=2", "slurm.gpus_per_node=2"],
                 ["slurm.procs_per_node=1", "slurm.gpus_per_node=2"],  # fewer processes than GPUs
                 ["slurm.procs_per_node=4"]):  # several on a CPU node
        assert resolve("pretrain", None, [*SHORT, *fine])
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", *SHORT,
                             "slurm.procs_per_node=3", "slurm.gpus_per_node=2")
    assert code == 2 and out == "" and "slurm.procs_per_node" in err and "slurm.gpus_per_node" in err


def test_processes_per_node_follow_the_gpus_unless_said():
    assert procs_per_node(SlurmConfig()) == 1
    assert procs_per_node(SlurmConfig(gpus_per_node=8)) == 8
    assert procs_per_node(SlurmConfig(gpus_per_node=8, procs_per_node=2)) == 2


def attempt(signal="USR2", action="requeue", progress=True):
    return {"signal": signal, "action": action, "progress": progress}


def test_a_finished_run_is_never_requeued_even_when_the_warning_came_late():
    assert decide(140, "USR2", finished=True, progress=True, history=[], max_requeues=3).action == "done"


def test_a_command_that_succeeded_is_done_though_its_run_is_unfinished():
    """A search's array task whose trial was pruned: its run stops unfinished, and the task exits 0."""
    outcome = decide(0, "", finished=False, progress=True, history=[], max_requeues=3)
    assert outcome.action == "done" and "pruned" in outcome.why
    assert decide(0, "USR2", False, True, [], 3).action == "requeue"  # stopped by the warning: not done


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


def test_a_cancel_ends_the_job_and_a_preemption_or_the_time_limit_requeues_it():
    """A SIGTERM told apart by what the job's record says (requeue.ended_by)."""
    cancelled = decide(143, "TERM", False, True, [], 3, ended="cancelled")
    assert cancelled.action == "cancel" and "scancel" in cancelled.why and cancelled.stop == "cancel"
    for ended in ("preempted", "requeued", ""):  # "": the job still runs (a grace time's SIGTERM)
        assert decide(143, "TERM", False, True, [], 3, ended=ended).action == "requeue", ended
    timed_out = decide(143, "TERM", False, True, [attempt()] * 3, 3, ended="timeout")
    assert timed_out.action == "fail" and "slurm.max_requeues=3" in timed_out.why  # counted as one
    assert decide(143, "TERM", True, True, [], 3, ended="cancelled").action == "done"


# slurmstepd's lines in a job's log, as SLURM 22.05 writes them (from tests/slurm_cluster.py's cluster)
STEPD = "slurmstepd-vm: error: *** JOB {} ON vm CANCELLED AT 2026-11-29T06:34:44{} ***\n"


def test_the_reason_slurm_ended_a_job_is_read_from_its_log():
    log = "step 10\n" + STEPD.format(7, " DUE TO PREEMPTION") + "requeued\n" + STEPD.format(7, "")
    assert ended_reason(log, "7") == ""  # the last line counts: a user's scancel after a requeue
    assert ended_reason(STEPD.format(7, " DUE TO PREEMPTION"), "7") == "PREEMPTION"
    assert ended_reason(STEPD.format(7, " DUE TO TIME LIMIT"), "7") == "TIME LIMIT"
    assert ended_reason(STEPD.format(8, " DUE TO PREEMPTION"), "7") is None  # another job's
    assert ended_reason("no such line", "7") is None
    assert ended_reason(STEPD.format("12_1", " DUE TO PREEMPTION"), "13", "12_1") == "PREEMPTION"


@pytest.mark.parametrize("rc, signal, ended, kind", [
    (140, "USR2", "", "time limit"), (143, "TERM", "cancelled", "cancel"),
    (143, "TERM", "preempted", "preemption"), (143, "TERM", "requeued", "preemption"),
    (143, "TERM", "timeout", "time limit"), (143, "TERM", "", "preemption"),
    (75, "", "", "hang"), (137, "", "", "kill"), (1, "", "", "crash"), (2, "", "", "crash")])
def test_what_stopped_the_step(rc, signal, ended, kind):
    assert stop_kind(rc, signal, ended) == kind


def restart(kind="kill", progress=True):
    return {"signal": "", "stop": kind, "action": "requeue", "progress": progress}


def test_a_hang_or_a_sigkill_is_requeued_a_bounded_number_of_times_and_a_bug_is_not():
    hung = decide(75, "", False, True, [], 20, max_restarts=2)
    assert hung.action == "requeue" and "restart 1 of 2" in hung.why and hung.stop == "hang"
    killed = decide(137, "", False, True, [restart("hang")], 20, max_restarts=2)
    assert killed.action == "requeue" and "restart 2 of 2" in killed.why
    spent = decide(137, "", False, True, [restart("hang"), restart()], 20, max_restarts=2)
    assert spent.action == "fail" and "slurm.max_restarts=2" in spent.why
    assert decide(75, "", False, True, [], 20, max_restarts=0).action == "fail"
    # time limits and preemptions do not spend restarts, nor restarts time limits
    assert decide(75, "", False, True, [attempt(), attempt("TERM")] * 3, 20, 2).action == "requeue"
    assert decide(140, "USR2", False, True, [restart()] * 3, 3, 5).action == "requeue"
    assert decide(1, "", False, True, [], 20, max_restarts=2).action == "fail"


def test_a_failure_that_recurs_without_progress_is_not_requeued_again():
    assert decide(137, "", False, False, [restart(progress=True)], 20, 5).action == "requeue"
    again = decide(137, "", False, False, [restart(progress=False)], 20, 5)
    assert again.action == "fail" and "nor the one before" in again.why
    # a time limit without progress after a hang without progress: the same rule
    assert decide(140, "USR2", False, False, [restart("hang", progress=False)], 20, 5).action == "fail"


@pytest.mark.parametrize("seconds", [60, 61, 179, 180, 3599, 3600, 86_400, 93_661, 10 * 86_400 + 1])
def test_a_time_limit_is_written_as_sbatch_reads_it_rounded_up_to_a_minute(seconds):
    text = time_limit_text(seconds)
    assert seconds <= time_limit_seconds(text) < seconds + 60, text


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
    assert f'#SBATCH --output="{tmp_path}/my runs/vit b/slurm/%j.out"' in lines  # one argument to sbatch
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


@pytest.mark.parametrize("sweep", [[], ["--sweep", "optim.lr=1e-3,3e-3"]],
                         ids=["one run", "a sweep"])
def test_dry_run_refuses_a_finished_run_as_the_submission_does(sweep, tmp_path, monkeypatch,
                                                               capsys):
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / MODEL_FILE).touch()
    (workdir / SUMMARY_FILE).write_text(json.dumps({"steps": 10}))
    before = sorted(workdir.iterdir())
    for dry in (["--dry-run"], []):
        code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", *dry, "--workdir",
                                 workdir, *sweep, *SHORT)
        assert code == 2 and "holds a finished" in err and out == "", (dry, err)
        assert len(err.strip().splitlines()) == 1 and sorted(workdir.iterdir()) == before


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


def test_a_finished_sweep_is_refused_as_a_finished_run_is(tmp_path, monkeypatch, capsys):
    workdir, sweep = tmp_path / "w", ["--sweep", "optim.lr=1e-3,3e-3"]
    for point in ("optim.lr=0.001", "optim.lr=0.003"):
        (workdir / point).mkdir(parents=True)
        (workdir / point / MODEL_FILE).touch()
        (workdir / point / SUMMARY_FILE).write_text(json.dumps({"steps": 10}))
    before = sorted(workdir.rglob("*"))
    for dry in (["--dry-run"], []):
        code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", *dry, "--workdir", workdir,
                                 *sweep, *SHORT)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (dry, err)
        assert f"{workdir} holds a finished sweep (its 2 points): nothing to submit" in err
        assert sorted(workdir.rglob("*")) == before
    (workdir / "optim.lr=0.003" / SUMMARY_FILE).unlink()  # one point left to train: submitted
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir", workdir,
                             *sweep, *SHORT)
    assert code == 0 and "#SBATCH --array=0-1" in out, err


def test_a_dry_run_of_a_sweep_lists_its_points_as_the_array_runs_them(tmp_path, monkeypatch, capsys):
    sweep = ["--sweep", "optim.lr=1e-3,3e-3", "--sweep", "run.seed=0,1"]
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir",
                             tmp_path / "w", *SHORT, *sweep, "data.num_workers=0")
    assert code == 0 and "#SBATCH --array=0-3" in out, err
    listed = [line for line in err.splitlines() if line.startswith("#")]
    assert listed[0] == f"# sweep: 4 points as a job array, task i running point i, each its own run in " \
                        f"{tmp_path / 'w'}/<point>"
    assert "slurm.cpus_per_task" not in err  # one process, no loader worker: one CPU is enough
    assert listed[1:] == ["#   0: optim.lr=0.001,run.seed=0", "#   1: optim.lr=0.001,run.seed=1",
                          "#   2: optim.lr=0.003,run.seed=0", "#   3: optim.lr=0.003,run.seed=1"]
    assert not (tmp_path / "w").exists()


def test_cpus_left_to_the_partition_and_a_short_time_limit_are_said_naming_the_keys(tmp_path, monkeypatch,
                                                                                   capsys):
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir",
                             tmp_path / "w", *SHORT, "slurm.procs_per_node=4", "data.num_workers=3",
                             "slurm.time=3:00", "slurm.signal_seconds=90")
    assert code == 0 and out.startswith("#!/bin/bash"), err
    warned = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 2, err
    assert "slurm.cpus_per_task=0" in warned[0] and "slurm.cpus_per_task, e.g. 16" in warned[0]
    assert "slurm.time=3:00 leaves 90 s before the warning" in warned[1] and "--preflight" in warned[1]
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--slurm", "--dry-run", "--workdir",
                           tmp_path / "w", *SHORT, "slurm.cpus_per_task=16", "slurm.time=1:00:00")
    assert code == 0 and "warning" not in err, err


def test_preflight_says_a_time_limit_too_short_for_a_step_and_names_the_one_that_works():
    from types import SimpleNamespace

    from vitcli.run.estimate import slurm as slurm_figures
    from vitcli.stages.preflight import warnings

    recipe = resolve("pretrain", None, [*SHORT, "slurm.time=3:00", "slurm.signal_seconds=90"])
    fixed, step, saving = 95.0, 0.5, 2.0  # what a preflight measured: start-up, a step, a checkpoint
    f = {"train/input_advice": None, "disk/fits": True, "eta/fixed_s": fixed, "train/step_s": step,
         "time/checkpoint_s": saving, **slurm_figures(recipe, 3600.0, fixed, step, saving)}
    (line,) = warnings(f, recipe, SimpleNamespace(world_size=1))
    works = line.split("slurm.time=")[-1].split()[0]
    assert line.startswith("slurm.time=3:00 is too short: the start-up (95 s)") and "without progress" in line
    assert fixed + step + saving + 90 <= time_limit_seconds(works) < fixed + step + saving + 90 + 60
    longer = resolve("pretrain", None, [*SHORT, f"slurm.time={works}", "slurm.signal_seconds=90"])
    f.update(slurm_figures(longer, 3600.0, fixed, step, saving))
    assert not any("too short" in w for w in warnings(f, longer, SimpleNamespace(world_size=1)))


def test_the_step_ends_decided_by_the_cause_each_node_wrote_not_sruns_highest_code(tmp_path, monkeypatch):
    """srun exits 143 when it stopped the other nodes (measured on slurm-wlm 22.05): the cause is
    what the nodes' launches wrote, read and removed by requeue.end."""
    from vitcli.cluster import requeue

    asked = []
    monkeypatch.setattr(requeue.subprocess, "run", lambda args, **kw: asked.append(args) or
                        subprocess.CompletedProcess(args, 0, "", ""))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    for written, action, stop in (({"node0": "1"}, "fail", "crash"),
                                  ({"node0": "143", "node1": "75"}, "requeue", "hang"),
                                  ({}, "fail", "crash")):  # nothing written: the step's own 143
        run, exits = tmp_path / f"run-{len(written)}", tmp_path / f"exits-{len(written)}"
        for name, code in written.items():
            exits.mkdir(exist_ok=True)
            (exits / name).write_text(code + "\n")
        requeue.begin(run)
        outcome = requeue.end(run, 143, "", max_requeues=3, max_restarts=2, exits=exits)
        assert (outcome.action, outcome.stop) == (action, stop) and not exits.exists()
        assert requeue.attempts(run)[-1]["rc"] == 143
    assert asked == [["scontrol", "requeue", "12"]]  # the hang alone
