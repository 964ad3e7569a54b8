"""The pure parts of a rollback past a loss spike: the spike rule, the windows a recipe gives
(data.skip_steps), the step -> batch mapping and the window a rollback adds; and the train streams,
map-style and streamed, skipping those batches as a run without skips would have taken them."""

import math

import pytest
from test_stream_state import _mapped, _same, _streamed, _take

from vitcli.data.batching.sampler import batch_step, merged, skipped, train_keys
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.recipe.rollback_checks import skip_windows
from vitcli.train.rollback import spiked

SHORT = ["schedule.steps=9", "schedule.warmup_steps=1"]


def test_a_spike_is_non_finite_or_above_k_times_the_median_of_a_full_window():
    recent = [2.0, 2.1, 50.0, 1.9]  # one earlier spike does not move the median (2.05)
    assert spiked(math.nan, recent, 0) and spiked(math.inf, [], 3)
    assert not spiked(6.0, recent, 0)  # factor 0: only a non-finite loss
    assert not spiked(6.0, recent, 3) and spiked(6.2, recent, 3)
    assert not spiked(1e6, [], 3)  # nothing to judge against yet


def test_windows_are_read_sorted_and_overlaps_or_malformed_ones_are_refused():
    assert skip_windows(["120-135", " 7 ", "40 - 41"]) == ((7, 7), (40, 41), (120, 135))
    assert skip_windows([5, "6-9"]) == ((5, 5), (6, 9))  # adjacent is fine; a YAML number too
    for bad in (["9-3"], ["0-4"], ["a-b"], ["3-"], ["1-2-3"]):
        with pytest.raises(RecipeError, match=r"^data.skip_steps: cannot read"):
            skip_windows(bad)
    with pytest.raises(RecipeError, match="data.skip_steps: the windows 10-20 and 15-30 overlap"):
        skip_windows(["15-30", "10-20"])


def test_a_recipe_refuses_bad_rollback_keys_at_resolve_time():
    given = resolve("pretrain", None, [*SHORT, "data.skip_steps=[5-7,9]"])
    assert given.data.skip_steps == ["5-7", "9"]
    for override, key in (("data.skip_steps=[5-7,6]", "data.skip_steps"),
                          ("run.spike_factor=1", "run.spike_factor"),
                          ("run.spike_window=0", "run.spike_window"),
                          ("run.max_rollbacks=-1", "run.max_rollbacks")):
        with pytest.raises(RecipeError, match=f"^{key}"):
            resolve("pretrain", None, [*SHORT, override])


def _reference(step: int, skips: tuple) -> int:
    """batch_step by its definition: the step-th batch (from 0) of those no window names."""
    kept = [b for b in range(1000) if not any(a <= b + 1 <= z for a, z in skips)]
    return kept[step]


@pytest.mark.parametrize("skips", [(), ((1, 1),), ((3, 5),), ((3, 5), (6, 6), (20, 29)),
                                   ((1, 4), (8, 8))])
def test_a_step_takes_the_next_batch_no_window_names(skips):
    assert [batch_step(s, skips) for s in range(60)] == [_reference(s, skips) for s in range(60)]


def test_a_rollback_skips_the_batches_the_steps_since_its_checkpoint_took():
    assert skipped((), 4, 7) == ((5, 7),)  # back to step 4 from 7: the batches of steps 5, 6, 7
    # after a skip of 5-7, steps 5..9 took the batches of 8..12: merged with it into one window
    assert skipped(((5, 7),), 4, 9) == ((5, 12),)
    # a window given up front inside the new one is swallowed by it; one after it stays
    assert skipped(((12, 13), (40, 41)), 10, 20) == ((11, 22), (40, 41))
    assert merged(((1, 2),), (3, 4), (8, 9), (1, 2)) == ((1, 4), (8, 9))


def test_the_sampler_keys_of_a_run_with_skips_are_those_of_its_batch_steps():
    plain = train_keys(64, 4, 2, seed=3, start=0, rank=1, world_size=2)
    every = [next(plain) for _ in range(40)]  # 2 micro-batches a step: 20 steps
    skips = ((2, 3), (7, 10))
    keys = train_keys(64, 4, 2, seed=3, start=0, rank=1, world_size=2, skips=skips)
    got = [next(keys) for _ in range(20)]
    want = [every[batch_step(k // 2, skips) * 2 + k % 2] for k in range(20)]
    assert [(s, list(r)) for s, r in got] == [(s, list(r)) for s, r in want]


@pytest.mark.parametrize("make", [_mapped, _streamed])
def test_a_stream_skips_batches_and_resumes_with_them_from_its_state_or_a_seek(make):
    every = _take(make(), 12)  # one micro-batch a step
    skips = ((2, 4), (7, 7))
    kept = [every[batch_step(s, skips)] for s in range(7)]
    stream = make()
    stream.skip(skips)
    assert _same(_take(stream, 3), kept[:3])
    state = stream.state_dict()
    resumed, sought = make(), make()
    resumed.skip(skips)
    resumed.load_state_dict(state)
    sought.skip(skips)
    sought.seek(3)
    assert _same(_take(resumed, 4), kept[3:]) and _same(_take(sought, 4), kept[3:])
    _take(stream, 2)  # then a rollback: the batches it took let go, placed again
    stream.rewind()
    stream.load_state_dict(state)
    assert _same(_take(stream, 4), kept[3:])
