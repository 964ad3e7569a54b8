"""train/data_wait: the seconds the loop spends in next(stream), and the warning a run gives once
when it waits for data more than a tenth of the time."""

import time

import pytest

from vitcli.train.throughput import INPUT_BOUND, Feeding, Waited, input_bound


def test_the_wait_is_what_next_took():
    def slow():
        while True:
            time.sleep(0.02)
            yield 1

    waited = Waited(slow())
    t0 = time.perf_counter()
    assert [next(waited) for _ in range(3)] == [1, 1, 1]
    spent = time.perf_counter() - t0
    took = waited.take()
    assert 0.06 <= took <= spent and waited.take() == 0.0  # take() empties it


def test_up_to_a_tenth_of_the_time_waiting_is_not_input_bound():
    assert input_bound(INPUT_BOUND * 10, 10.0, 640, Feeding(2)) is None
    assert input_bound(0.0, 0.0, 0, Feeding(2)) is None


def test_past_a_tenth_it_names_both_rates_and_the_knobs():
    # a 10 s window, 4 s of it waiting, 800 images: the model took them at 800 / 6 img/s; with 2
    # workers the loader made them in the background all along, 800 / 10 img/s
    warning = input_bound(4.0, 10.0, 800, Feeding(2))
    assert "40%" in warning and "loader delivered 80 img/s" in warning and "take 133 img/s" in warning
    assert "data.num_workers (now 2)" in warning and "vit prepare-data" in warning


def test_a_loader_faster_than_the_model_without_workers_is_told_apart():
    # 2 s of a 10 s window waiting for 1000 images: the loader made them at 500 img/s, the model
    # took them at 125: the loader is not slow, it runs between the steps
    warning = input_bound(2.0, 10.0, 1000, Feeding(0))
    assert "data.num_workers=1 or more (now 0" in warning and "4.0x faster than the model" in warning
    assert "faster than the model" not in input_bound(2.0, 10.0, 1000, Feeding(2))
    assert "faster than the model" not in input_bound(8.0, 10.0, 1000, Feeding(0))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("wait", [1.01, 5.0, 9.9])
def test_the_loaders_rate_counts_the_time_it_worked(wait, workers):
    """Without workers it decodes inside next(): images over the wait. With workers it decodes
    throughout and the loop takes all it makes: images over the window, so always below the model's
    rate."""
    warning = input_bound(wait, 10.0, 1000, Feeding(workers))
    loader, model = 1000 / (wait if workers == 0 else 10.0), 1000 / (10.0 - wait)
    assert f"delivered {loader:.0f} img/s" in warning and f"take {model:.0f} img/s" in warning
    assert workers == 0 or loader < model


def test_a_loader_about_as_fast_as_the_model_is_not_called_faster():
    # 5.2 s of a 10 s window waiting, no workers: the loader 1000 / 5.2, the model 1000 / 4.8, "1.0x
    # faster"
    warning = input_bound(4.9, 10.0, 1000, Feeding(0))
    assert "faster than the model" not in warning and "more data.num_workers (now 0)" in warning


@pytest.mark.parametrize("feeding, absent", [
    (Feeding(2, prepared=True), "vit prepare-data"),  # already the prepared copy
    (Feeding(2, builtin=True), "vit prepare-data"),  # the built-in data: nothing to prepare
])
def test_only_knobs_that_apply_are_offered(feeding, absent):
    warning = input_bound(4.0, 10.0, 800, feeding)
    assert absent not in warning and "data.num_workers (now 2)" in warning
