"""`vit pretrain --preflight`: every figure reported, as a table and as JSON; the workdir never
made; the throwaway folder gone on every way out (a return, an error, Ctrl-C in the loop and outside
it)."""

import json
import os
import shutil
import signal

import pytest

from helpers import run_vit
from vitcli.run import measure, micro_batch
from vitcli.stages import preflight as pf
from vitcli.train import cost, loop

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.batch_size=16",
        "data.num_workers=0", "schedule.epochs=0", "schedule.steps=40", "schedule.warmup_steps=1",
        "run.eval_every=10", "run.ckpt_every=15", "fewshot.every=0"]
# a SLURM time limit of 1 minute, warned 10 s ahead: the requeue count is computed
SLURM = ["slurm.time=1", "slurm.signal_seconds=10"]
FIELDS = {
    "stage", "preflight/steps_run", "preflight/steps_timed", "data/micro_batch_size", "data/accumulation",
    "train/step_s", "train/img_per_s",
    "train/first_epoch_step_s", "train/first_epoch_steps",
    "train/data_wait", "train/input_advice", "train/mfu", "mem/main_peak_mb", "mem/worker_peak_mb",
    "mem/cache_growth_mb", "mem/device_allocated_mb", "mem/device_reserved_mb", "schedule/steps",
    "schedule/checkpoint_writes", "eval/val_runs", "eval/val_s", "eval/test_runs", "eval/test_s",
    "time/checkpoint_s", "eta/fixed_s", "eta/steps_s", "eta/eval_s", "eta/checkpoint_s", "eta/seconds",
    "eta/processes", "eta/gpu_hours", "disk/checkpoint_bytes", "disk/checkpoints_kept", "disk/model_bytes",
    "disk/needed_bytes", "disk/checked_bytes", "disk/free_bytes", "disk/fits", "slurm/time_limit_s",
    "slurm/requeues", "slurm/least_time_limit_s", "warnings"}


def preflight(monkeypatch, capsys, tmp_path, *extra, timed_s=0.0):
    """`vit pretrain --preflight` into tmp_path/runs/w, its steady steps timed for `timed_s` at
    least (0: no second short run, in seconds of a test); (exit code, stdout, stderr)."""
    monkeypatch.setattr(measure, "TIMED_S", timed_s)
    return run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path / "runs" / "w", "--preflight",
                   "--preflight-steps", "4", *TINY, *extra)


def nothing_left(tmp_path):
    """No workdir made (nor its parent), and no throwaway folder beside it."""
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_json_has_every_figure_the_table_shows_them_and_the_sizes_are_the_runs(monkeypatch, capsys, tmp_path):
    code, out, err = preflight(monkeypatch, capsys, tmp_path, "--json", *SLURM, timed_s=1.0)
    assert code == 0, err
    f = json.loads(out)
    assert set(f) == FIELDS
    nothing_left(tmp_path)
    run = cost.plan(4)[1]
    # 64 images kept decoded: a sample of 3 windows' images, then the cache; then more steps, for 1
    # s of them at the short run's pace
    assert f["preflight/steps_run"] == run and f["train/first_epoch_steps"] == 64 // 16
    assert f["preflight/steps_timed"] > run and f["train/first_epoch_step_s"] > 0
    assert f["schedule/steps"] == 40 and f["eval/test_runs"] == 1
    assert f["eval/val_runs"] == cost.evaluations(40, 10)
    assert f["schedule/checkpoint_writes"] == cost.checkpoint_writes(40, 15, 30.0, f["train/step_s"])
    assert f["eta/seconds"] == pytest.approx(f["eta/fixed_s"] + f["eta/steps_s"] + f["eta/eval_s"]
                                             + f["eta/checkpoint_s"])
    assert f["mem/device_allocated_mb"] is None and f["eta/gpu_hours"] is None  # a CPU run
    assert f["train/mfu"] > 0 and f["train/img_per_s"] == pytest.approx(16 / f["train/step_s"])
    # no loader worker; but runtime.memory counts every child of the process, and in-process a
    # pytest worker can hold one of another test's, so only the main figure is asserted here
    assert f["mem/main_peak_mb"] > 0
    assert 0 < f["disk/checkpoint_bytes"] and 0 < f["disk/model_bytes"] < f["disk/checkpoint_bytes"]
    assert f["disk/needed_bytes"] == cost.disk_needed(f["disk/checkpoint_bytes"], 2, f["disk/model_bytes"])
    assert f["disk/fits"] and f["disk/free_bytes"] >= max(f["disk/needed_bytes"], f["disk/checked_bytes"])
    assert f["slurm/time_limit_s"] == 60
    assert f["slurm/requeues"] == cost.requeues(f["eta/seconds"], f["eta/fixed_s"], 60, 10)
    # the shortest limit that moves the run on: start-up, a step, a checkpoint and the warning
    least = f["eta/fixed_s"] + f["train/step_s"] + f["time/checkpoint_s"] + 10
    assert least <= f["slurm/least_time_limit_s"] < least + 60

    # the table, on a disk with 1 KiB free: said, and warned of
    usage = shutil.disk_usage
    monkeypatch.setattr(pf.shutil, "disk_usage", lambda path: usage(path)._replace(free=2**10))
    code, out, err = preflight(monkeypatch, capsys, tmp_path)
    monkeypatch.setattr(pf.shutil, "disk_usage", usage)
    assert code == 0, err
    for what, _ in pf.ROWS:
        assert what in out, what
    assert "no slurm.time" in out and "none (CPU)" in out and "does NOT fit" in out
    assert "warning: the run needs" in " ".join(err.split())
    nothing_left(tmp_path)

    # what it weighed is what the run writes: a checkpoint (and its checksum file), the model
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path / "real", *TINY,
                           "schedule.steps=2")
    assert code == 0, err
    state = sum((tmp_path / "real" / name).stat().st_size for name in ("state-2.pt", "state-2.pt.sha256"))
    assert f["disk/checkpoint_bytes"] == pytest.approx(state, rel=0.01)
    # within the recipe in its metadata, which differs (schedule.steps, slurm.*, the paths), padded to 8 bytes
    assert f["disk/model_bytes"] == pytest.approx((tmp_path / "real" / "model.safetensors").stat().st_size,
                                                  rel=0.01)


def test_an_auto_micro_batch_is_chosen_as_the_run_chooses_it(monkeypatch, capsys, tmp_path):
    # the search itself (trials in child processes) is test_micro_batch_auto's: here what it chose
    # is used
    monkeypatch.setattr(micro_batch, "search", lambda r, device, world_size=1: (8, "a test's choice"))
    code, out, err = preflight(monkeypatch, capsys, tmp_path, "--json", "data.micro_batch_size=auto")
    assert code == 0, err
    f = json.loads(out)
    assert (f["data/micro_batch_size"], f["data/accumulation"]) == (8, 2)
    assert "data.micro_batch_size: auto -> 8" in err
    nothing_left(tmp_path)


def test_a_finished_workdir_is_said_so_and_timed_only_with_overwrite(monkeypatch, capsys, tmp_path):
    """The command would not train a finished run again: --preflight says so in one line, exit 2,
    measuring nothing and writing nothing; --overwrite, which would start it over, is timed."""
    workdir = tmp_path / "runs" / "w"
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", workdir, *TINY,
                           "schedule.steps=2")
    assert code == 0, err
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    code, out, err = preflight(monkeypatch, capsys, tmp_path, "schedule.steps=2")
    said = " ".join(err.split())
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert (f"--preflight: {workdir} holds this run, finished at step 2: nothing to do "
            "(--overwrite starts it over)") in said
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
    code, out, err = preflight(monkeypatch, capsys, tmp_path, "schedule.steps=2", "--overwrite",
                               "--json")
    assert code == 0, err
    assert json.loads(out)["schedule/steps"] == 2
    # the throwaway folder came and went beside the workdir, whose files are untouched
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()) == [
        entry for entry in before if entry[0] not in ("runs", "w")]


def stopping_at_step(monkeypatch, stop):
    """The loop's gradient step calls `stop()` at the second optimizer step."""
    real, calls = loop._accumulate_grads, {"n": 0}

    def step(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            stop()
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "_accumulate_grads", step)


def test_ctrl_c_in_the_loop_removes_the_throwaway_folder(monkeypatch, capsys, tmp_path):
    # the loop's own stop: a checkpoint at the end of the step, written into the folder that then
    # goes
    stopping_at_step(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    code, _, err = preflight(monkeypatch, capsys, tmp_path)
    assert code == 130 and "preflight stopped by SIGINT" in err and "untouched" in err, err
    nothing_left(tmp_path)


@pytest.mark.parametrize("raised, code", [(KeyboardInterrupt, 130), (RuntimeError, 1)])
def test_an_abort_or_an_error_removes_the_throwaway_folder(raised, code, monkeypatch, capsys, tmp_path):
    def stop():
        raise raised

    stopping_at_step(monkeypatch, stop)
    exit_code, _, err = preflight(monkeypatch, capsys, tmp_path)
    assert exit_code == code, err
    nothing_left(tmp_path)


def test_a_sweep_is_not_preflighted(monkeypatch, capsys, tmp_path):
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--workdir", tmp_path / "w", "--preflight",
                           "--lr-sweep", "0.01,0.03", *TINY)
    assert code == 2 and "--preflight times one run" in err, err
    nothing_left(tmp_path)
