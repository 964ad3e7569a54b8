"""A run says how fast it went and why: train/data_wait in every metrics row, a warning once when it
waits for data, images/s and MFU in its summary, and run.compile's auto choice announced and
recorded (the pure parts: unit/test_throughput.py, unit/test_flops.py, unit/test_precision.py)."""

import json
import time

import pytest
import torch
import yaml

from helpers import run_vit, stopped_at_call, warnings
from vitcli.checkpoints import manager
from vitcli.models.flops import train_flops_per_image
from vitcli.recipe.resolve import resolve
from vitcli.run import build as run_build
from vitcli.runtime import threads
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run
from vitcli.train import loop

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "schedule.warmup_steps=1",
        "data.val_split=", "data.test_split=", "run.precision=fp32", "run.log_every=2"]

pytestmark = pytest.mark.usefixtures("one_thread")


class _Slow:
    """A feed's stream that takes `seconds` longer for each of its first `batches` batches (all when
    None; skipped, warm_after and the state a checkpoint keeps: the stream's)."""

    def __init__(self, stream, seconds: float, batches: int | None = None):
        self.stream, self.seconds, self.batches = stream, seconds, batches

    def __next__(self):
        if self.batches is None or self.batches > 0:
            time.sleep(self.seconds)
            self.batches = None if self.batches is None else self.batches - 1
        return next(self.stream)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_a_run_reports_its_wait_throughput_and_mfu(tmp_path):
    summary = one_run(resolve("pretrain", None, TINY + ["schedule.steps=6"]), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 3 and all(0 <= r["train/data_wait"] <= 1 for r in rows)
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    # the run's throughput after the first (warm-up) window: between the two later windows' rates
    later = [r["train/img_per_s"] for r in rows[1:]]
    assert min(later) * 0.999 <= summary["train/img_per_s"] <= max(later) * 1.001
    assert 0 <= summary["train/data_wait"] <= 1
    assert summary["train/peak_source"] == "measured 2048^2 fp32 matmul" and summary["train/peak_flops"] > 0
    flops = train_flops_per_image(resolve("pretrain", None, TINY, inputs=False).model, 4)
    expected = summary["train/img_per_s"] * flops / summary["train/peak_flops"]
    assert summary["train/mfu"] == pytest.approx(expected) and 0 < summary["train/mfu"] < 1


def test_a_run_starved_of_data_warns_once_naming_the_rates_and_knobs(tmp_path, monkeypatch, logged):
    feed = run_build.train_feed
    monkeypatch.setattr(run_build, "train_feed", lambda *a, **k: lambda *b: _Slow(feed(*a, **k)(*b), 0.05))
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=8"]), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert all(r["train/data_wait"] > 0.1 for r in rows)
    (warning,) = warnings(logged, but=())  # once, though every window waited
    # judged over the warm windows together, once two are in: windows end at steps 2, 4, 6, 8; the
    # built-in data are cached decoded after one epoch (64 images, 4 steps of 16), so those from
    # step 4 on
    assert "step 8: input-bound" in warning and "data.num_workers (now 0)" in warning
    assert "img/s" in warning
    assert "prepare-data" not in warning  # the built-in data: nothing to prepare


def test_the_first_epochs_decoding_of_cached_data_is_not_called_input_bound(tmp_path, monkeypatch, logged):
    """The decoded-image cache makes the first epoch slow and the rest fast (`make demo`: 29%
    waiting over the first windows, 7% over the run): the warning judges the data once they are
    warm."""
    feed = run_build.train_feed
    monkeypatch.setattr(run_build, "train_feed",
                        lambda *a, **k: lambda *b: _Slow(feed(*a, **k)(*b), 0.5, batches=4))
    # a model that takes 200 ms a step: the warm loader's few ms (tens on a loaded machine) are not
    # a tenth
    clip = loop._clip
    monkeypatch.setattr(loop, "_clip", lambda *a: (time.sleep(0.2), clip(*a))[1])
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=8"]), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert rows[1]["train/data_wait"] > 0.5  # steps 3-4 waited, in the first epoch
    assert warnings(logged, but=()) == []


def test_compile_auto_is_chosen_announced_and_recorded(tmp_path, logged):
    summary = one_run(resolve("pretrain", None, TINY + ["schedule.steps=2"]), tmp_path)
    assert summary["run/compile"] is False  # this CPU: auto stays eager
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text())["run"]["compile"] is False
    assert any("eager (auto: the CPU gains nothing" in m for m in logged)


def test_a_model_without_a_flop_count_says_why_there_is_no_mfu(tmp_path):
    # T2T-ViT_t-14 itself at 32 px: its name fixes its sizes
    sized = ("model.patch_size", "model.embed_dim", "model.depth", "model.num_heads", "model.mlp_dim")
    given = [*(o for o in TINY if not o.startswith(sized)), "schedule.steps=2", "model.name=T2T-ViT_t-14"]
    summary = one_run(resolve("pretrain", None, given), tmp_path)
    assert "train/mfu" not in summary and "T2T-ViT_t-14" in summary["train/mfu_skipped"]


def test_a_run_started_with_compile_auto_resumes_with_auto(tmp_path, monkeypatch):
    """The checkpoints hold auto's choice (false here) and the resumed run's recipe says auto again:
    it goes on, as precision's auto does (run.compile may even differ on resume:
    checkpoints.manager.RESUMABLE)."""
    r = resolve("pretrain", None, TINY + ["schedule.steps=4", "run.ckpt_every=1"])
    stopped_at_call(monkeypatch, r, tmp_path, 3)
    assert manager.latest_good_state(tmp_path)[1]["recipe"]["run"]["compile"] is False
    one_run(r, tmp_path)  # auto again: resumes
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row] == [2, 4]


@pytest.mark.parametrize("timings, says", [({1: 0.05, 2: 0.30}, True), ({1: 0.10, 2: 0.06}, False)],
                         ids=["fewer threads are faster", "the threads pay"])
def test_a_run_on_a_shared_machine_says_once_which_thread_count_helps(tmp_path, monkeypatch, capsys,
                                                                      timings, says):
    """The load average says other work holds the cores; the timed ops decide whether to say so. The
    load reader, the cores and the timing are stand-ins: this machine's own load must not decide a
    test."""
    torch.set_num_threads(2)  # torch's default on 2 cores; the module's one_thread fixture puts it back
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.0, 3.0, 3.0))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "timed", lambda counts: {n: timings[n] for n in counts})
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", *TINY, "schedule.steps=6", "--workdir", tmp_path)
    said = [line for line in err.splitlines() if "OMP_NUM_THREADS=1" in line]
    assert code == 0 and len(said) == int(says), err
    if says:
        assert "the cores are shared (load 3.0 on 2 cores)" in " ".join(err.split()), err
        assert "6.0x faster at 1 thread than at this run's 2" in " ".join(err.split()), err


def test_an_idle_machine_times_nothing(tmp_path, monkeypatch, logged):
    torch.set_num_threads(2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "timed", lambda counts: pytest.fail("timed on an idle machine"))
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=2"]), tmp_path)
    assert not [m for m in logged if "cores are shared" in m]
