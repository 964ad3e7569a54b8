"""The arithmetic of `--preflight` (stages/preflight.py), each rule checked against a step-by-step
simulation of what train.loop and a SLURM job do."""

import math

import pytest

from vitcli.stages import preflight as pf


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 20, 33, 100])
def test_the_plan_times_at_least_the_steps_asked_after_one_window_of_warm_up(steps):
    every, run = pf.plan(steps)
    assert run % every == 0 and run - every >= steps
    assert (run - every) // every <= pf.WINDOWS  # the timed steps in at most WINDOWS windows
    assert run - every < steps + every  # never a whole window more than asked


def rows_of(windows, batch):
    """metrics.jsonl's train rows for windows of (seconds, waited, steps), as train.loop._log writes them."""
    rows, step = [], 0
    for seconds, waited, steps in windows:
        step += steps
        rows.append({"step": step, "train/img_per_s": steps * batch / seconds,
                     "train/data_wait": waited / seconds})
        rows.append({"step": step, "val/top1": 0.5})  # an evaluation's row carries no window
    return rows


def test_windows_are_read_back_from_the_metrics_rows():
    made = [(2.0, 0.5, 5), (1.0, 0.1, 5), (1.2, 0.0, 3)]
    got = pf.windows(rows_of(made, batch=64), batch=64)
    assert [(pytest.approx(s), pytest.approx(w), n) for s, w, n in made] == got


def test_the_steady_step_leaves_out_the_first_window_and_a_slow_second_one():
    warm, slow, steady = (9.0, 1.0, 5), (4.0, 0.2, 5), [(1.0, 0.1, 5), (1.1, 0.3, 5), (0.9, 0.0, 5)]
    step_s, wait, steps = pf.steady([warm, slow, *steady])
    seconds = sum(w[0] for w in steady)
    assert steps == 15 and step_s == pytest.approx(seconds / 15)
    assert wait == pytest.approx(sum(w[1] for w in steady) / seconds)
    # a window within SLOW of the others is kept: a busy moment is part of the run
    kept = (1.0 * pf.SLOW * 0.99, 0.0, 5)  # per step within SLOW of the median (1.0 s a window)
    assert pf.steady([warm, kept, *steady])[2] == 20
    # one slow window at most: more is the machine, not the warm-up, and the run meets it too
    assert pf.steady([warm, slow, slow, *steady])[2] == 20


def test_a_single_window_is_used_rather_than_none():
    assert pf.steady([(2.0, 1.0, 4)]) == (0.5, 0.5, 4)


def loop_evaluations(total, every):
    """train.loop: _periodic at every multiple but the last step, then every evaluator once more."""
    return sum(1 for done in range(1, total + 1) if every and done % every == 0 and done != total) + 1


@pytest.mark.parametrize("total, every", [(938, 250), (1000, 250), (250, 250), (1, 5), (7, 0), (10, 1)])
def test_evaluations_are_counted_as_the_loop_runs_them(total, every):
    assert pf.evaluations(total, every) == loop_evaluations(total, every)


def loop_writes(total, every, minutes, step_s):
    """train.loop's saves: each `every` steps, the last step, and when the clock since the last one is due."""
    writes, since = 0, 0.0
    for done in range(1, total + 1):
        since += step_s
        if done % every == 0 or done == total or (minutes and since >= minutes * 60):
            writes, since = writes + 1, 0.0
    return writes


@pytest.mark.parametrize("total, every, minutes, step_s", [
    (938, 250, 30.0, 0.05), (938, 250, 0.0, 5.0), (938, 250, 1.0, 0.7), (1000, 100, 0.5, 1.0),
    (10, 3, 0.1, 2.0), (5, 500, 0.05, 1.0), (7, 7, 1.0, 61.0)])
def test_checkpoint_writes_are_counted_as_the_loop_writes_them(total, every, minutes, step_s):
    assert pf.checkpoint_writes(total, every, minutes, step_s) == loop_writes(total, every, minutes, step_s)


def test_the_eta_of_a_run_is_its_time_when_the_preflight_met_the_same_costs():
    """A run made of parts: what once costs (`once`), steps, evaluations, checkpoint writes. The preflight,
    the same run cut to a few steps with each part met once, recovers `once`, and the ETA the whole run."""
    once, step_s, eval_s, write_s, total, every = 12.0, 0.3, 2.5, 0.4, 1000, 200
    runs, writes = pf.evaluations(total, every), pf.checkpoint_writes(total, every, 0, step_s)
    whole = once + total * step_s + runs * eval_s + writes * write_s
    steps_run = 25
    age = once + steps_run * step_s + eval_s + write_s
    fixed = pf.fixed_seconds(age, steps_run, step_s, eval_s, write_s)
    assert fixed == pytest.approx(once)
    assert pf.eta_seconds(fixed, total, step_s, [(runs, eval_s)], writes, write_s) == pytest.approx(whole)


def segments(eta, startup, limit, signal_s):
    """Jobs of `limit` seconds, each starting up again and stopping signal_s before its limit, until the
    run's work (eta - startup) is done; None if a job cannot advance it."""
    work, jobs = eta - startup, 0
    while work > 0 or jobs == 0:
        advance = limit - signal_s - startup
        if advance <= 0:
            return None
        work, jobs = work - advance, jobs + 1
    return jobs


@pytest.mark.parametrize("eta, startup, limit, signal_s", [
    (3600.0, 30.0, 4 * 3600.0, 90.0), (10 * 3600.0, 60.0, 3600.0, 90.0), (7200.0, 0.0, 3600.0, 0.0),
    (7201.0, 0.0, 3600.0, 0.0), (1000.0, 200.0, 250.0, 90.0), (50.0, 10.0, 60.0, 10.0)])
def test_requeues_are_the_jobs_a_time_limit_needs_less_the_first(eta, startup, limit, signal_s):
    jobs = segments(eta, startup, limit, signal_s)
    assert pf.requeues(eta, startup, limit, signal_s) == (None if jobs is None else jobs - 1)


def test_disk_holds_the_kept_checkpoints_one_being_written_and_the_model():
    # train.loop writes the new checkpoint before checkpoints.state.keep_newest removes the oldest
    state, model = 123_456, 7_890
    for keep in (1, 2, 5):
        on_disk = [state] * keep
        peak = sum(on_disk) + state + model  # the moment a new one is whole and the oldest not yet gone
        assert pf.disk_needed(state, keep, model) == peak


def test_the_image_cache_grows_to_the_split_or_to_its_capacity():
    held, images, rows = 9.4, 3200, 10_000
    per_image = held / images
    assert pf.cache_growth_mb(held, images, rows, 1024) == pytest.approx(per_image * rows - held)
    assert pf.cache_growth_mb(held, images, rows, 20) == pytest.approx(20 - held)
    assert pf.cache_growth_mb(0.0, 0, rows, 1024) == 0.0  # no cache, or nothing decoded yet


def test_the_cache_is_advised_only_where_it_would_take_the_images():
    small, large = 24 * 2**20, pf.CACHE_ENCODED_BYTES + 1
    assert "data.cache_mb=1024" in pf.cache_knob(0, False, small)
    raised = pf.cache_knob(16, False, small)
    assert f"data.cache_mb={math.ceil(small / 2**20) * 4}" in raised and "now 16" in raised
    assert pf.cache_knob(1024, True, small) is None  # on already
    assert pf.cache_knob(0, False, large) is None  # too large to keep decoded at all


@pytest.mark.parametrize("seconds, text", [(0.0813, "0.0813 s"), (7.25, "7.25 s"), (38.2, "38 s"),
                                           (725, "12 min 5 s"), (12_000, "3 h 20 min")])
def test_durations_read_at_a_glance(seconds, text):
    assert pf.duration(seconds) == text
