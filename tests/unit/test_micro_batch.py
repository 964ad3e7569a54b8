"""data.micro_batch_size: auto in its pure parts: which micro-batches keep the global batch, the
bisection that finds the largest that fits, the recipe's checks, a resumed run taking its
checkpoint's, and how a trial's end is read."""

import json
import math
import signal
import tempfile
from pathlib import Path

import pytest

from vitcli.checkpoints import manager
from vitcli.errors import DataError, RecipeError, TrainingError
from vitcli.recipe.layers import to_dict
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import micro_batches
from vitcli.run import micro_batch
from vitcli.run.micro_batch import candidates, largest_fitting
from vitcli.runtime.dist import Dist

BASE = ["schedule.steps=10", "schedule.warmup_steps=1", "data.batch_size=64"]


def test_the_candidates_are_the_divisors_of_the_batch_per_process():
    assert candidates(12) == [1, 2, 3, 4, 6, 12]
    assert candidates(12, even=True) == [2, 4, 6, 12], "Mixup and CutMix pair the images of a micro-batch"
    assert candidates(1) == [1]
    for share in (1, 12, 97, 360, 4096):
        assert all(share % m == 0 for m in candidates(share)), "accumulation keeps the global batch"


@pytest.mark.parametrize("share", [4096, 360, 97, 1])
def test_the_search_finds_the_largest_that_fits_in_logarithmically_many_trials(share):
    options = candidates(share)
    bound = math.ceil(math.log2(len(options) + 1))
    for limit in range(share + 2):  # fits(m) <=> m <= limit: every place the limit can fall
        tried = []
        found = largest_fitting(options, lambda m, limit=limit, tried=tried: tried.append(m) or m <= limit)
        assert found == max((m for m in options if m <= limit), default=None), limit
        assert len(tried) <= bound, (limit, tried)
        above = [m for m in options if m > limit]
        if found is not None and above:  # the next candidate's outcome is known: the run says it
            assert min(above) in tried


def test_auto_is_a_value_of_the_micro_batch_and_a_budget_is_checked_when_resolved():
    r = resolve("pretrain", None, [*BASE, "data.micro_batch_size=auto", "run.memory_budget_mb=2048"])
    assert (r.data.micro_batch_size, r.run.memory_budget_mb) == ("auto", 2048)
    assert resolve("pretrain", None, [*BASE, "data.micro_batch_size=16"]).data.micro_batch_size == 16
    with pytest.raises(ValueError, match="resolved"):  # read as 0 it would train without accumulation
        micro_batches(r)
    refused = {"data.micro_batch_size=Auto": "data.micro_batch_size: 'Auto' is not auto",
               "data.micro_batch_size=-1": "data.micro_batch_size must be >= 0",
               "run.memory_budget_mb=-1": "run.memory_budget_mb must be >= 0"}
    for override, message in refused.items():
        with pytest.raises(RecipeError, match=message):
            resolve("pretrain", None, [*BASE, "data.micro_batch_size=auto", override])


def test_auto_with_mixing_needs_an_even_batch_per_process():
    mixed = [*BASE, "data.micro_batch_size=auto", "data.mixup_alpha=0.8"]
    resolve("pretrain", None, mixed)
    with pytest.raises(RecipeError, match="the batch per process, 63, is odd"):
        resolve("pretrain", None, [*mixed, "data.batch_size=63"])


def test_a_resumed_auto_run_takes_its_checkpoints_micro_batch_without_trying(monkeypatch):
    """manager accepts `auto` against the checkpoint's number (and a changed budget), and resolved
    takes that number; an explicit number that differs is still refused."""
    monkeypatch.setattr(micro_batch, "search", lambda *a: pytest.fail("a resumed run tried micro-batches"))
    auto = resolve("pretrain", None, [*BASE, "data.micro_batch_size=auto", "run.memory_budget_mb=512"])
    saved = to_dict(resolve("pretrain", None, [*BASE, "data.micro_batch_size=16"]))
    manager._check_same_training(auto, saved, Path("workdir"))
    start = (Path("workdir/state-3.pt"), {"recipe": saved})
    r = micro_batch.resolved(auto, Dist(0, 1, 0, None), start)
    assert micro_batches(r) == (16, 4)
    with pytest.raises(RecipeError, match="data.micro_batch_size"):
        manager._check_same_training(resolve("pretrain", None, [*BASE, "data.micro_batch_size=8"]), saved,
                                     Path("workdir"))


def test_a_number_is_left_as_it_is(monkeypatch):
    monkeypatch.setattr(micro_batch, "search", lambda *a: pytest.fail("searched for a number"))
    r = resolve("pretrain", None, [*BASE, "data.micro_batch_size=8"])
    assert micro_batch.resolved(r, Dist(0, 1, 0, None), None) is r


def ended(tmp_path, result=None, code=0, stopped_at=None, stderr=""):
    """micro_batch._outcome of a trial of micro-batch 8 that ended with this result file, exit code
    and stderr, in a folder of its own."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    if result is not None:
        (folder / micro_batch.RESULT).write_text(json.dumps(result))
    (folder / micro_batch.ERRORS).write_text(stderr)
    return micro_batch._outcome(8, code, stopped_at, folder, budget_mb=1000)


def test_a_trial_fits_when_it_finishes_within_the_budget(tmp_path):
    assert ended(tmp_path, {"peak_mb": 999.0}).fits
    over = ended(tmp_path, {"peak_mb": 1001.0})
    assert not over.fits and over.said == "peak 1001 MiB, over the budget"
    assert not ended(tmp_path, {"failed": "out of memory"}).fits


def test_a_trial_that_does_not_finish_does_not_fit(tmp_path):
    stopped = ended(tmp_path, stopped_at=1003.0)
    assert not stopped.fits and "1003 MiB" in stopped.said
    assert not ended(tmp_path, code=-signal.SIGKILL).fits, "the host's OOM killer"


def test_a_trial_that_fails_otherwise_is_an_error_not_a_misfit(tmp_path):
    """A broken trial must not read as 'too big': the search would settle on a smaller
    micro-batch."""
    with pytest.raises(DataError, match="no such teacher"):
        ended(tmp_path, {"error": "no such teacher", "kind": "DataError"})
    with pytest.raises(TrainingError, match=r"micro-batch 8 failed \(exit 1\): ValueError: bad"):
        ended(tmp_path, code=1, stderr="Traceback (most recent call last):\nValueError: bad\n")


def test_under_torchrun_each_nodes_local_rank_0_searches_and_every_rank_takes_the_smallest(monkeypatch):
    """Nodes may differ (another GPU): local rank 0 of each searches its own device, the others
    wait; every rank then takes the smallest choice gathered."""
    r = resolve("pretrain", None, [*BASE, "data.micro_batch_size=auto"], world_size=4)
    searched = []
    monkeypatch.setattr(micro_batch, "search", lambda r, device, n: searched.append(n) or (16, "mine"))
    monkeypatch.setattr(micro_batch, "barrier", lambda dist: None)
    gathered = [(16, "node 0's"), None, (8, "node 1's"), None]  # ranks 0 and 2 are local rank 0
    monkeypatch.setattr(micro_batch, "all_gather", lambda mine, dist: gathered)
    assert micro_batches(micro_batch.resolved(r, Dist(2, 4, 0, None), None), 4) == (8, 2)
    assert searched == [4], "the searching rank splits the batch over the 4 processes"
    assert micro_batches(micro_batch.resolved(r, Dist(3, 4, 1, None), None), 4) == (8, 2)
    assert searched == [4], "local rank 1 did not search"
