"""One corrupt image never ends a run: training puts the next decodable row in its place (the stream
stays the same across worker counts and resumes), evaluation and feature extraction leave it out,
every stream counts what it skipped and names each image once, by its file's path (row and split
where it has none); a split with no decodable image, an error inside a loader worker and a damaged
feature-cache file are each one line or one warning, never a traceback."""

from __future__ import annotations

import io
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from helpers import REPO, run_vit
from vitcli.data.batching import batches, streams
from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources
from vitcli.errors import DataError
from vitcli.evaluators import heldout, inference
from vitcli.evaluators.heldout import ClassificationEvaluator
from vitcli.fewshot import features, report
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig, OptimConfig
from vitcli.runtime.dist import Dist
from vitcli.runtime.metrics import console, read_metrics
from vitcli.stages.run import one_run
from vitcli.train.losses import loss_fn

N = 32  # rows per split; the label of a row is its index, so a batch's labels say which rows it holds
BAD_TRAIN, BAD_TEST = (5, 17), (3,)
BAD_FILES = ("train/a/02.jpg", "train/b/05.jpg")  # the image folder's: cut in half, and empty
TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
    "model.mlp_dim=64", "data.batch_size=8", "data.eval_batch_size=8", "data.val_split=", "optim.lr=3e-3",
    "schedule.warmup_steps=1", "schedule.steps=8", "run.log_every=1", "run.device=cpu",
]
CPU = Dist(0, 1, 0, torch.device("cpu"))
HERE = Path(__file__).resolve().parent


def _png(i: int) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _split(bad) -> datasets.Dataset:
    rows = [{"bytes": b"not an image" if i in bad else _png(i), "path": None} for i in range(N)]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=N)})
    return datasets.Dataset.from_dict({"image": rows, "label": list(range(N))}, features=feats)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """A saved dataset: train with 2 undecodable rows, test with 1, `broken` with nothing decodable,
    `odd_broken` with its odd rows undecodable."""
    path = tmp_path_factory.mktemp("corrupt") / "ds"
    splits = {"train": _split(BAD_TRAIN), "test": _split(BAD_TEST), "broken": _split(range(N)),
              "odd_broken": _split(range(1, N, 2))}
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return str(path)


def _jpeg(i: int) -> bytes:
    pixels = np.random.default_rng(i).integers(0, 256, (36, 36, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """An image folder (each row only its file's path): train holds 16 JPEGs in classes a and b, one
    cut in half (its header parses, its data does not decode) and one empty; test holds one of each
    kind."""
    root = tmp_path_factory.mktemp("folder")
    for split, n, bad in (("train", 16, BAD_FILES), ("test", 2, ("test/a/00.jpg", "test/b/01.jpg"))):
        for i in range(n):
            name = f"{split}/{'ab'[i % 2]}/{i:02d}.jpg"
            data = _jpeg(i)
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(b"" if name == bad[1] else data[: len(data) // 2] if name == bad[0]
                                      else data)
    return root


def _named_once(logged: list[str], *names: str) -> None:
    """Each name is in exactly one logged message."""
    for name in names:
        assert len([m for m in logged if name in m]) == 1, (name, logged)


@pytest.fixture
def logged(monkeypatch) -> list[str]:
    """Every console.log message, unwrapped (rich would fold long paths at the terminal width)."""
    messages: list[str] = []
    monkeypatch.setattr(console, "log", lambda msg, *a, **k: messages.append(str(msg)))
    return messages


def _take(stream, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(stream, k))


def _one_line(error: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(error.value)
    assert "\n" not in msg and "Traceback" not in msg and "worker process" not in msg, msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# ---------------------------------------------------------------- training


def test_train_stream_replaces_corrupt_rows_the_same_way_in_workers_and_on_resume(source):
    ds = sources.load_source(source, "train")

    def stream(workers: int, start_step: int = 0) -> batches.BatchStream:
        cfg = DataConfig(num_workers=workers, crop_min_area=0.3)
        return batches.train_batches(ds, cfg, 32, 8, seed=3, start_step=start_step)

    main = stream(0)
    straight = _take(main, 12)  # three epochs of four batches
    assert main.skipped.as_dict() == {f"{source} split 'train'": list(BAD_TRAIN)}  # met thrice, counted once
    labels = torch.cat([y for _, y in straight]).tolist()
    assert all(len(y) == 8 for _, y in straight) and not set(BAD_TRAIN) & set(labels)
    assert labels.count(BAD_TRAIN[0] + 1) == 2 * 3  # the next row stands in: itself and row 5, each epoch
    workers = stream(2)
    for (xa, ya), (xb, yb) in zip(straight, _take(workers, 12), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert workers.skipped.total == 2  # counted in the reading process, though decoded in the workers
    for (xa, ya), (xb, yb) in zip(straight[5:], _take(stream(0, start_step=5), 7), strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_pretrain_with_corrupt_images_finishes_and_counts_them(source, tmp_path, monkeypatch, logged):
    real, streams = batches.train_batches, []

    def spy(*args, **kwargs):
        streams.append(real(*args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(batches, "train_batches", spy)
    losses = {}
    for workers in (0, 2):
        r = resolve("pretrain", None, TINY + [f"data.source={source}", f"data.num_workers={workers}"])
        results = one_run(r, tmp_path / str(workers))
        assert streams[-1].skipped.total == 2  # 8 steps of 8: both bad rows met twice, counted once
        assert results["test/skipped_images"] == 1  # the final evaluation left its bad row out
        summary = json.loads((tmp_path / str(workers) / "summary.json").read_text())
        assert summary["data/skipped_images"] == 2 and summary["test/skipped_images"] == 1
        rows = read_metrics(tmp_path / str(workers) / "metrics.jsonl")
        losses[workers] = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(losses[0]) == 8 and all(np.isfinite(losses[0]))
    assert losses[0] == losses[2]  # the same batches whatever the worker count, so the very same losses
    first = next(m for m in logged if "undecodable" in m)
    named = [r for r in BAD_TRAIN if f"row {r} of {source} split 'train'" in first]
    assert "1 undecodable image" in first and named, first
    # a source without file paths names rows and split, once in each run (two runs: twice)
    for row in BAD_TRAIN:
        assert len([m for m in logged if f"row {row} of {source} split 'train':" in m]) == 2, logged


ROUTES = {"map-style": {}, "map-style, 2 workers": {"num_workers": 2}, "streamed": {"streaming": True}}


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_training_route_names_a_bad_file_by_its_path_once(folder, route, logged):
    """Three epochs meet each bad file three times: each is counted once and named in one warning,
    by its path, on every route (its cut-in-half file fails in the worker that decodes it)."""
    cfg = DataConfig(**{"source": str(folder), "num_workers": 0, "crop_min_area": 0.3, "shuffle_buffer": 4,
                        **ROUTES[route]})
    if cfg.streaming:
        stream = streams.stream_train_batches(sources.load_stream(cfg), cfg, 32, 4, seed=0)
    else:
        stream = batches.train_batches(sources.load_source(str(folder), "train"), cfg, 32, 4, seed=0)
    _take(stream, 12)
    assert stream.skipped.total == 2
    _named_once(logged, *(str(folder / name) for name in BAD_FILES))
    assert not [m for m in logged if "row " in m], logged


# ---------------------------------------------------------------- evaluation and features


def test_evaluation_leaves_a_corrupt_image_out_and_counts_it_once(source, logged):
    ds = sources.load_source(source, "test")
    ys = [y for _, y in batches.eval_batches(ds, DataConfig(num_workers=0), 32, 8)]
    assert torch.cat(ys).tolist() == [i for i in range(N) if i not in BAD_TEST]
    logged.clear()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, N))
    cfg = DataConfig(num_workers=0, eval_batch_size=8)
    evaluator = ClassificationEvaluator("test", ds, cfg, 32, CPU, "fp32", loss=loss_fn(OptimConfig()))
    for _ in range(2):
        results = dict(evaluator.run(model))
        assert results["test/skipped_images"] == 1 and 0 <= results["test/top1"] <= 1
    assert len([m for m in logged if "undecodable" in m]) == 1  # warned once, not once per evaluation
    assert f"row 3 of {source} split 'test': UnidentifiedImageError" in logged[0]


def test_evaluation_and_extraction_name_a_bad_file_by_its_path_once(folder, tmp_path, logged):
    """Held-out evaluation and feature extraction, each run twice into one tally as a training run
    does, name each bad file once, by its path; the feature cache keeps the names."""
    ds, cfg = sources.load_source(str(folder), "train"), DataConfig(num_workers=0, eval_batch_size=8)
    files = [str(folder / name) for name in BAD_FILES]
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))
    evaluator = ClassificationEvaluator("val", ds, cfg, 32, CPU, "fp32", loss=loss_fn(OptimConfig()))
    for _ in range(2):
        assert dict(evaluator.run(model))["val/skipped_images"] == 2
    _named_once(logged, *files)
    logged.clear()
    vit, tally = zoo.build_model(resolve("pretrain", None, TINY).model, 0).eval(), bad_images.Skipped()
    for _ in range(2):  # the few-shot evaluator's: every evaluation extracts again
        features.extract(vit, ds, cfg, 32, 0, CPU, "fp32", skipped=tally)
    _named_once(logged, *files)
    logged.clear()
    fresh, again = bad_images.Skipped(), bad_images.Skipped()
    extract = lambda: features.extract(vit, ds, cfg, 32, 0, CPU, "fp32", skipped=fresh)
    features.cached(tmp_path, "key", extract, skipped=fresh)
    assert features.cached(tmp_path, "key", lambda: pytest.fail("recomputed"), True, again)[2]
    assert sorted(bad.image for bad in again.rows[sources.origin(ds)].values()) == files
    assert len([m for m in logged if files[0] in m]) == 2  # extracted, then read from the cache


def test_one_sharded_pass_serves_evaluation_and_extraction(source, monkeypatch):
    """Each rank runs its rows rank, rank + W, ... in eval mode, leaves corrupt images out and
    counts them; the held-out evaluator and the feature extraction both run through that pass."""
    ds, cfg = sources.load_source(source, "test"), DataConfig(num_workers=0, eval_batch_size=8)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, N)).train()
    modes, seen = [], []
    for rank in range(2):
        tally = bad_images.Skipped()
        ys = inference.sharded_pass(model, ds, cfg, 32, Dist(rank, 2, 0, torch.device("cpu")), "fp32",
                                    lambda m, i, x, y: modes.append(m.training) or y, tally)
        seen.append(torch.cat(ys).tolist())
        assert tally.total == len([r for r in BAD_TEST if r % 2 == rank])
    assert seen == [[i for i in range(r, N, 2) if i not in BAD_TEST] for r in range(2)]
    assert modes and not any(modes) and model.training  # eval inside, the mode restored after
    calls = []
    real = inference.sharded_pass
    monkeypatch.setattr(inference, "sharded_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(heldout, "sharded_pass", inference.sharded_pass)
    monkeypatch.setattr(features, "sharded_pass", inference.sharded_pass)
    dict(ClassificationEvaluator("test", ds, cfg, 32, CPU, "fp32", loss=loss_fn(OptimConfig())).run(model))
    features.extract(zoo.build_model(resolve("pretrain", None, TINY).model, 0), ds, cfg, 32, 0, CPU, "fp32")
    assert len(calls) == 2


def test_extraction_skips_corrupt_images_and_the_cache_keeps_the_count(source, tmp_path):
    model = zoo.build_model(resolve("pretrain", None, TINY).model, 0).eval()
    ds, cfg = sources.load_source(source, "test"), DataConfig(num_workers=0, eval_batch_size=8)
    tally = bad_images.Skipped()

    def compute():
        return features.extract(model, ds, cfg, 32, 0, CPU, "fp32", skipped=tally)

    feats, labels, hit = features.cached(tmp_path, "key", compute, skipped=tally)
    assert not hit and feats.shape == (N - 1, 32) and tally.total == 1
    assert labels.tolist() == [i for i in range(N) if i not in BAD_TEST]
    again = bad_images.Skipped()
    _, _, hit = features.cached(tmp_path, "key", lambda: pytest.fail("recomputed a good entry"), True, again)
    assert hit and again.as_dict() == {f"{source} split 'test'": list(BAD_TEST)}
    row = {"task": "t", "shots": 1, "seed": 0, "l2_reg": 1.0, "accuracy": 0.5, "classes": 2,
           "short_classes": 0, "empty_classes": 0, "examples": 2}  # as evaluate_task writes it
    report.write([row], tmp_path, resolve("pretrain", None, TINY), again)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["data/skipped_images"] == 1 and results["skipped_rows"] == again.as_dict()


# ---------------------------------------------------------------- one line, never a traceback


def test_a_split_where_nothing_decodes_is_one_line_naming_it(source):
    ds = sources.load_source(source, "broken")
    with pytest.raises(DataError) as error:
        list(batches.eval_batches(ds, DataConfig(num_workers=0), 32, 8))
    _one_line(error, f"no image of {source} split 'broken' decodes",
              f"; row 0 of {source} split 'broken': UnidentifiedImageError")
    with pytest.raises(DataError) as error:
        next(batches.train_batches(ds, DataConfig(num_workers=0), 32, 8, seed=0))
    _one_line(error, f"no image of {source} split 'broken' decodes", f"{N} rows tried; row ",
              f" of {source} split 'broken': UnidentifiedImageError")


@pytest.mark.parametrize("how", ["evaluation", "training"])
def test_where_nothing_decodes_the_one_line_names_a_file_by_its_path(folder, how):
    ds = sources.load_source(str(folder), "test")
    cfg = DataConfig(num_workers=0)
    with pytest.raises(DataError) as error:
        if how == "evaluation":
            list(batches.eval_batches(ds, cfg, 32, 2))
        else:
            next(batches.train_batches(ds, cfg, 32, 2, seed=0))
    msg = _one_line(error, f"{folder} split 'test' decodes (2")
    named = [name for name in ("test/a/00.jpg", "test/b/01.jpg") if f"; {folder / name}: " in msg]
    assert len(named) == 1 and "row " not in msg, msg


def test_evaluation_and_extraction_where_nothing_decodes_are_one_line(source):
    ds, cfg = sources.load_source(source, "broken"), DataConfig(num_workers=0, eval_batch_size=8)
    model = zoo.build_model(resolve("pretrain", None, TINY).model, N)
    evaluator = ClassificationEvaluator("test", ds, cfg, 32, CPU, "fp32", loss=loss_fn(OptimConfig()))
    extract = lambda: features.extract(model, ds, cfg, 32, 0, CPU, "fp32")
    for run in (lambda: dict(evaluator.run(model)), extract):
        with pytest.raises(DataError) as error:
            run()
        _one_line(error, f"no image of {source} split 'broken' decodes", "UnidentifiedImageError")


def test_a_rank_whose_rows_all_fail_goes_on_with_the_others_and_all_raise_together(source, tmp_path):
    """2 processes: rank 1 holds the odd rows, all corrupt. It returns nothing and meets rank 0 in
    the gather instead of raising alone (which hung rank 0 there); only a split where no rank
    decodes anything raises, on every rank, the same line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(HERE)])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "eval_ranks.py"), source, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    report = ranks[0]
    assert report["odd_broken/heldout"]["odd_broken/skipped_images"] == N // 2
    assert report["odd_broken/features"] == list(range(0, N, 2))
    for what in ("heldout", "features"):
        assert report[f"broken/{what}"].startswith(f"DataError: no image of {source} split 'broken' decodes")
        assert f"; row 0 of {source} split 'broken': " in report[f"broken/{what}"]  # rank 0's first


def test_errors_inside_loader_workers_arrive_as_one_line(source, monkeypatch):
    broken = sources.load_source(source, "broken")
    with pytest.raises(DataError) as error:  # the worker's own DataError, not torch's re-wrapped copy
        next(batches.train_batches(broken, DataConfig(num_workers=2), 32, 8, seed=0))
    _one_line(error, f"no image of {source} split 'broken' decodes")

    def bug(self, seed, rows):
        raise ValueError("augmentation exploded\nsecond line")

    monkeypatch.setattr(batches._Batches, "_batch", bug)  # workers fork after this, so they inherit it
    with pytest.raises(DataError) as error:
        next(batches.train_batches(sources.load_source(source, "train"), DataConfig(num_workers=2), 32, 8,
                                   seed=0))
    _one_line(error, "ValueError: augmentation exploded", "data.num_workers=0")


def test_the_cli_shows_a_worker_error_as_one_red_line(source, tmp_path, monkeypatch, capsys):
    args = TINY + [f"data.source={source}", "data.train_split=broken", "data.num_workers=2"]
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, *args)
    assert code == 2, err
    line = [ln for ln in err.splitlines() if "decodes" in ln]
    assert len(line) == 1 and "Traceback" not in err and "worker process" not in err, err


def test_a_damaged_feature_cache_file_is_recomputed_with_a_warning(tmp_path, logged):
    calls = []

    def compute():
        calls.append(1)
        return np.ones((4, 3), np.float32), np.arange(4)

    features.cached(tmp_path, "k", compute)
    path = tmp_path / "k.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut short
    feats, _, hit = features.cached(tmp_path, "k", compute)
    assert not hit and len(calls) == 2 and feats.shape == (4, 3)
    assert any(str(path) in m and "damaged" in m for m in logged), logged
    assert features.cached(tmp_path, "k", compute)[2] and len(calls) == 2  # rewritten whole: a hit again
