"""The arithmetic of `--preflight` (train/cost.py), each rule checked against a step-by-step
simulation of what train.loop and a SLURM job do."""

import io
import math

import datasets
import pytest
from PIL import Image

from vitcli.data.batching import batches
from vitcli.recipe.schema import DataConfig
from vitcli.stages import preflight
from vitcli.train import cost


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 20, 33, 100])
def test_the_plan_times_at_least_the_steps_asked_after_one_window_of_warm_up(steps):
    every, run = cost.plan(steps)
    assert run % every == 0 and run - every >= steps
    assert (run - every) // every <= cost.WINDOWS  # the timed steps in at most WINDOWS windows
    assert run - every < steps + every  # never a whole window more than asked


def rows_of(windows, batch):
    """metrics.jsonl's train rows for windows of (seconds, waited, steps), as train.loop._log writes
    them."""
    rows, step = [], 0
    for seconds, waited, steps in windows:
        step += steps
        rows.append({"step": step, "train/img_per_s": steps * batch / seconds,
                     "train/data_wait": waited / seconds})
        rows.append({"step": step, "val/top1": 0.5})  # an evaluation's row carries no window
    return rows


def test_windows_are_read_back_from_the_metrics_rows():
    made = [(2.0, 0.5, 5), (1.0, 0.1, 5), (1.2, 0.0, 3)]
    got = cost.windows(rows_of(made, batch=64), batch=64)
    assert [(pytest.approx(s), pytest.approx(w), n) for s, w, n in made] == got


def test_the_steady_windows_leave_out_the_warm_up_and_a_slow_second_one():
    warm_up, slow, steady = (9.0, 1.0, 5), (4.0, 0.2, 5), [(1.0, 0.1, 5), (1.1, 0.3, 5), (0.9, 0.0, 5)]
    assert cost.timed_windows([warm_up, slow, *steady], 5) == ([], steady)
    step_s, wait, steps = cost.rate(steady)
    seconds = sum(w[0] for w in steady)
    assert steps == 15 and step_s == pytest.approx(seconds / 15)
    assert wait == pytest.approx(sum(w[1] for w in steady) / seconds)
    # a window within SLOW of the others is kept: a busy moment is part of the run
    kept = (1.0 * cost.SLOW * 0.99, 0.0, 5)  # per step within SLOW of the median (1.0 s a window)
    assert cost.timed_windows([warm_up, kept, *steady], 5)[1] == [kept, *steady]
    # one slow window at most: more is the machine, not the warm-up, and the run meets it too
    assert cost.timed_windows([warm_up, slow, slow, *steady], 5)[1] == [slow, *steady]


def test_the_cold_and_the_warm_windows_are_told_apart():
    every, boundary = 5, 15  # windows 0-2 decode (the first the warm-up), 3-4 read the cache
    cold = [(9.0, 3.0, 5), (2.0, 1.0, 5), (2.2, 1.2, 5)]
    warm = [(1.0, 0.1, 5), (1.2, 0.1, 5)]
    assert cost.timed_windows(cold + warm, every, boundary) == (cold[1:], warm)
    # a slow second window is judged against its own kind: the cold ones are not warm-up for being
    # cold
    assert cost.timed_windows(cold + cold[1:] + warm, every, 25) == (cold[1:] * 2, warm)


def loop_evaluations(total, every):
    """train.loop: _periodic at every multiple but the last step, then every evaluator once more."""
    return sum(1 for done in range(1, total + 1) if every and done % every == 0 and done != total) + 1


@pytest.mark.parametrize("total, every", [(938, 250), (1000, 250), (250, 250), (1, 5), (7, 0), (10, 1)])
def test_evaluations_are_counted_as_the_loop_runs_them(total, every):
    assert cost.evaluations(total, every) == loop_evaluations(total, every)


def loop_writes(total, every, minutes, step_s):
    """train.loop's saves: each `every` steps, the last step, and when the clock since the last one
    is due."""
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
    assert cost.checkpoint_writes(total, every, minutes, step_s) == loop_writes(total, every, minutes, step_s)


def test_step_seconds_add_up_the_steps_one_by_one():
    total, cold_steps, cold_s, warm_s = 938, 78, 0.09, 0.07
    for cached in (1.0, 0.25):
        warm = cached * warm_s + (1 - cached) * cold_s  # the share the cache does not hold is decoded
        each = [cold_s if step < cold_steps else warm for step in range(total)]
        assert cost.step_seconds(total, cold_steps, cold_s, warm_s, cached) == pytest.approx(sum(each))
    assert cost.step_seconds(10, 78, cold_s, warm_s) == pytest.approx(10 * cold_s)  # never warm


def test_the_eta_of_a_run_is_its_time_when_the_preflight_met_the_same_costs():
    """A run made of parts: what once costs (`once`), steps (decoding in the first epoch),
    evaluations, checkpoint writes. The preflight, the same run cut to a few steps with each part
    met once, recovers `once`, and the ETA the whole run."""
    once, cold_s, step_s, eval_s, write_s, total, every, first = 12.0, 0.4, 0.3, 2.5, 0.4, 1000, 200, 78
    runs, writes = cost.evaluations(total, every), cost.checkpoint_writes(total, every, 0, step_s)
    whole = once + first * cold_s + (total - first) * step_s + runs * eval_s + writes * write_s
    steps_run, warm = 25, 15
    age = once + warm * cold_s + (steps_run - warm) * step_s + eval_s + write_s
    fixed = cost.fixed_seconds(age, cost.step_seconds(steps_run, warm, cold_s, step_s), eval_s, write_s)
    assert fixed == pytest.approx(once)
    stepping = cost.step_seconds(total, first, cold_s, step_s)
    assert cost.eta_seconds(fixed, stepping, [(runs, eval_s)], writes, write_s) == pytest.approx(whole)


@pytest.mark.parametrize("rows, micro, accum, world, repeats", [
    (10_000, 128, 1, 1, 1), (10_000, 32, 4, 1, 1), (1000, 16, 2, 2, 3), (50, 16, 1, 1, 1)])
def test_the_first_epoch_ends_where_the_stream_says_its_data_turn_warm(rows, micro, accum, world, repeats):
    """batches.train_batches's warm_after (micro-batches) over the loop's accumulation, as
    train.loop reads it: the step from which the run's data are decoded from the cache."""
    ds = synthetic_rows(rows)
    cfg = DataConfig(batch_size=micro * accum * world, repeated_aug=repeats, num_workers=0)
    stream = batches.train_batches(ds, cfg, 8, micro, 0, world_size=world, accum=accum)
    assert stream.cache is not None
    assert cost.first_epoch_steps(rows, micro, accum, world, repeats) == -(-stream.warm_after // accum)


def synthetic_rows(n):
    """A split of `n` tiny PNGs: small enough to be kept decoded."""
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(png, format="PNG")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    image = {"bytes": png.getvalue(), "path": None}
    return datasets.Dataset.from_dict({"image": [image] * n, "label": [0] * n}, features=features)


@pytest.mark.parametrize("steps", [1, 4, 20, 50])
def test_the_sample_of_a_cached_split_ends_its_first_epoch_half_way_through_the_timed_windows(steps):
    every, run = cost.plan(steps)
    timed, batch = run // every - 1, 128
    for repeats in (1, 3):
        rows = cost.cold_rows(every, timed // 2, batch, repeats)
        warm = cost.first_epoch_steps(rows, batch, 1, 1, repeats)
        # at least one batch of rows: with repeated augmentation k, a first epoch of k steps at
        # least
        assert warm == max(every * (1 + timed // 2) // repeats, 1) * repeats


def segments(eta, startup, limit, signal_s):
    """Jobs of `limit` seconds, each starting up again and stopping signal_s before its limit, until
    the run's work (eta - startup) is done; None if a job cannot advance it."""
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
    assert cost.requeues(eta, startup, limit, signal_s) == (None if jobs is None else jobs - 1)


def test_disk_holds_the_kept_checkpoints_one_being_written_and_the_model():
    # train.loop writes the new checkpoint before checkpoints.state.keep_newest removes the oldest
    state, model = 123_456, 7_890
    for keep in (1, 2, 5):
        on_disk = [state] * keep
        peak = sum(on_disk) + state + model  # the moment a new one is whole and the oldest not yet gone
        assert cost.disk_needed(state, keep, model) == peak


def test_the_image_cache_grows_to_the_split_or_to_its_capacity():
    held, images, rows = 9.4, 3200, 10_000
    per_image = held / images
    assert cost.cache_growth_mb(held, images, rows, 1024) == pytest.approx(per_image * rows - held)
    assert cost.cache_growth_mb(held, images, rows, 20) == pytest.approx(20 - held)
    assert cost.cache_growth_mb(0.0, 0, rows, 1024) == 0.0  # no cache, or nothing decoded yet
    assert cost.cached_share(held, images, rows, 1024) == 1.0
    assert cost.cached_share(held, images, rows, 20) == pytest.approx(20 / (per_image * rows))


def test_the_cache_is_advised_only_where_it_would_take_the_images():
    small, large = 24 * 2**20, cost.CACHE_ENCODED_BYTES + 1
    assert "data.cache_mb=1024" in cost.cache_knob(0, False, small)
    raised = cost.cache_knob(16, False, small)
    assert f"data.cache_mb={math.ceil(small / 2**20) * 4}" in raised and "now 16" in raised
    assert cost.cache_knob(1024, True, small) is None  # on already
    assert cost.cache_knob(0, False, large) is None  # too large to keep decoded at all


@pytest.mark.parametrize("seconds, text", [(0.0813, "0.0813 s"), (7.25, "7.25 s"), (38.2, "38 s"),
                                           (725, "12 min 5 s"), (12_000, "3 h 20 min")])
def test_durations_read_at_a_glance(seconds, text):
    assert preflight.duration(seconds) == text
