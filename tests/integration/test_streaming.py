"""data.streaming=true: the train split streams from parquet files, a save_to_disk directory or
WebDataset tar shards, split by rank, shuffled through a seeded buffer, and resumes at any
micro-batch to exactly the batches the uninterrupted stream gives, whatever the worker count;
corrupt images are replaced and counted; bad recipes are one line."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from helpers import stopped_at_call
from vitcli.checkpoints import manager
from vitcli.checkpoints.weights import load_weights
from vitcli.data.batching import batches, sampler, streams
from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources, tar_shards
from vitcli.errors import CheckpointError, DataError, RecipeError
from vitcli.recipe.data_checks import check_stream
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.run_files import MODEL_FILE, RECIPE_FILE
from vitcli.stages.run import one_run

N, FILES = 200, 4  # the label of an example is its row, so the labels of a batch say which rows it holds
B = 16  # 200 is no multiple of 16: micro-batch 12 spans epochs 0 and 1
BAD = (5, 17)


def _png(i: int) -> dict:
    pixels = np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return {"bytes": buf.getvalue(), "path": None}


def _rows(bad=()) -> datasets.Dataset:
    images = [{"bytes": b"not an image %d" % i, "path": None} if i in bad else _png(i) for i in range(N)]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=N)})
    return datasets.Dataset.from_dict({"image": images, "label": list(range(N))}, features=feats)


def _parquet(tmp, bad=()) -> str:
    ds = _rows(bad)
    for k in range(FILES):  # several files: several shards, so ranks get whole shards
        ds.shard(FILES, k, contiguous=True).to_parquet(str(tmp / f"part-{k}.parquet"))
    return str(tmp / "part-*.parquet")


def _tars(tmp) -> str:
    """The rows as a standard WebDataset (KEY.png + KEY.cls, no class names), 4 shards, named by a
    brace pattern as WebDataset users name them."""
    rows = _rows().cast_column("image", datasets.Image(decode=False))
    for k in range(FILES):
        shard = rows.shard(FILES, k, contiguous=True)
        examples = ((f"{row['label']:06d}", row["image"]["bytes"], row["label"]) for row in shard)
        tar_shards.write_shard(tmp / f"part-{k:02d}.tar", examples, "png")
    return str(tmp / "part-{00..03}.tar")


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("streaming")
    for sub in ("pq", "bad", "tar"):
        (root / sub).mkdir()
    saved = str(root / "saved")
    datasets.DatasetDict({"train": _rows(), "test": _rows().select(range(40))}).save_to_disk(saved)
    return {"parquet": _parquet(root / "pq"), "saved": saved, "bad": _parquet(root / "bad", BAD),
            "tar": _tars(root / "tar")}


def _cfg(source: str, **kw) -> DataConfig:
    return DataConfig(**{"source": source, "streaming": True, "shuffle_buffer": 64, "num_workers": 0,
                         "crop_min_area": 0.3, **kw})


def _stream(source: str, seed=0, start_step=0, rank=0, world_size=1, batch=B, state=None, **kw):
    """A fresh stream from a fresh load, as a restarted process builds it; given a saved `state`,
    placed there as the CheckpointManager places it."""
    cfg = _cfg(source, **kw)
    ids = sources.load_stream(cfg)
    stream = streams.stream_train_batches(ids, cfg, 32, batch, seed, start_step, rank, world_size)
    if state is not None:
        stream.load_state_dict(state)
    return stream


def _take(stream, k: int) -> tuple[list, list[dict]]:
    """k batches and the stream's state before each."""
    out, where = [], []
    for _ in range(k):
        where.append(stream.state_dict())
        out.append(next(stream))
    return out, where


def _same(a: list, b: list) -> bool:
    """Two runs of (x, y) batches are bit-identical."""
    same = [torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b)]
    return len(a) == len(b) and all(same)


@pytest.fixture(scope="module")
def straight(source_dirs) -> dict[str, tuple[list, list[dict]]]:
    """24 micro-batches (almost two epochs) of each source, uninterrupted, in the main process."""
    return {name: _take(_stream(source_dirs[name]), 24) for name in ("parquet", "saved", "tar")}


# ---------------------------------------------------------------- resuming


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("name", ["parquet", "saved", "tar"])
def test_a_resumed_stream_gives_the_uninterrupted_batches_across_epochs(source_dirs, straight, name, workers):
    ref, where = straight[name]
    assert [w["epoch"] for w in where[11:14]] == [0, 0, 1]  # batch 12 spans the boundary, 13 is in epoch 1
    for k in (10, 17):  # before the boundary, and in epoch 1 (the recount walks through epoch 0)
        recounted = _stream(source_dirs[name], start_step=k, num_workers=workers)
        assert recounted.state_dict() == where[k]
        assert _same(ref[k:], _take(recounted, 24 - k)[0]), f"recounted from micro-batch {k}"
        saved = json.loads(json.dumps(where[k]))  # as a checkpoint stores it
        assert _same(ref[k:], _take(_stream(source_dirs[name], state=saved, num_workers=workers),
                                    24 - k)[0]), f"resumed from state {saved}"


def test_an_augmented_stream_is_the_same_with_workers_and_resumed(source_dirs):
    """DeiT's per-image augmentation (RandAugment, erasing) drawn per micro-batch: 2 workers give
    the main process's batches, and a stream placed at its saved state goes on with them, bit for
    bit."""
    deit = {"randaugment": "rand-m9-mstd0.5-inc1", "erasing": 0.25}
    ref, where = _take(_stream(source_dirs["saved"], **deit), 8)
    assert _same(ref, _take(_stream(source_dirs["saved"], num_workers=2, **deit), 8)[0])
    resumed = _stream(source_dirs["saved"], state=json.loads(json.dumps(where[5])), num_workers=2, **deit)
    assert _same(ref[5:], _take(resumed, 3)[0])
    plain = _take(_stream(source_dirs["saved"]), 1)[0][0][0]
    assert not torch.equal(plain, ref[0][0])  # the augmentation was applied


def test_the_state_counts_examples_into_the_epoch(straight):
    _, where = straight["parquet"]
    expected = [{"kind": "streamed", "world_size": 1, "micro_batches": k, "epoch": k * B // N,
                 "examples": k * B % N} for k in range(24)]
    assert where == expected


def test_a_state_of_another_world_size_or_kind_is_refused(source_dirs, straight):
    _, where = straight["parquet"]
    with pytest.raises(CheckpointError, match="written by 1 process"):
        _stream(source_dirs["parquet"], rank=1, world_size=2, state=where[5])
    with pytest.raises(CheckpointError, match="not a streamed stream's"):
        _stream(source_dirs["parquet"], state={"kind": "mapped", "world_size": 1, "micro_batches": 5})


# ---------------------------------------------------------------- ranks and seeds


def _epoch_labels(source: str, rank: int, world_size: int, epoch: int = 0) -> list[int]:
    """The labels this rank sees in `epoch`, in order: micro-batches of one, each tagged by its
    position."""
    stream, seen = _stream(source, rank=rank, world_size=world_size, batch=1, hflip=False), []
    while (at := stream.state_dict())["epoch"] <= epoch:
        y = next(stream)[1]
        if at["epoch"] == epoch:
            seen += y.tolist()
    return seen


@pytest.mark.parametrize(("name", "world_size"), [("parquet", 2), ("parquet", 3), ("saved", 2), ("tar", 2)])
def test_ranks_see_disjoint_shares_whose_union_is_the_epoch(source_dirs, name, world_size):
    # parquet over 2: whole files per rank; over 3 (4 files): every 3rd example; saved: 64 shards
    # over 2; tar: whole tars per rank
    for epoch in (0, 1):
        shares = [_epoch_labels(source_dirs[name], r, world_size, epoch) for r in range(world_size)]
        everything = [y for share in shares for y in share]
        assert sorted(everything) == list(range(N)), f"epoch {epoch}: shares overlap or miss rows"
        assert all(abs(len(s) - N / world_size) < N / 4 for s in shares), [len(s) for s in shares]


def test_the_seed_decides_the_order(source_dirs):
    def first(seed: int) -> torch.Tensor:  # the labels of 13 micro-batches: epoch 0 and a little more
        return torch.cat([y for _, y in _take(_stream(source_dirs["parquet"], seed=seed), 13)[0]])

    a, again, other = first(0), first(0), first(1)
    assert torch.equal(a[:N], again[:N]) and sorted(a[:N].tolist()) == list(range(N))
    assert not torch.equal(a[:N], other[:N])
    epoch_1 = _epoch_labels(source_dirs["parquet"], 0, 1, epoch=1)
    assert epoch_1 != a[:N].tolist() and sorted(epoch_1) == list(range(N))  # a new order every epoch


def test_streamed_augmentation_is_seeded_as_map_style_batches():
    """Rank 1's micro-batches 5, 6, 7 with 2 per step: seeds of (seed, step, global micro-batch),
    the family map-style batches and the trainer's mixup, dropout and masking draw from."""
    examples = (({"image": {"bytes": b"", "path": f"{i}.png"}}, (0, i + 1)) for i in itertools.count())
    cfg = DataConfig(image_column="image", label_column="")
    streamed = [seed for _, seed, _
                in itertools.islice(streams._keys(examples, cfg, 2, 7, (5, 2, 1), deque()), 3)]
    expected = [sampler.micro_seed(7, step, j) for step, j in ((2, 3), (3, 2), (3, 3))]
    mapped = [seed for seed, _ in itertools.islice(sampler.train_keys(64, 2, 2, 7, 5, 1, 2), 3)]
    assert streamed == expected == mapped


def test_one_stand_in_rule_for_a_corrupt_training_image():
    good = {0, 3}
    assert [bad_images.stand_in(i, 5, good.__contains__) for i in (1, 2, 4)] == [3, 3, 0]  # next, cyclically
    assert bad_images.stand_in(2, 5, lambda j: False) is None


# ---------------------------------------------------------------- corrupt images, evaluation,
# sources


def test_corrupt_images_are_replaced_counted_once_and_never_decoded_when_skipped(source_dirs):
    ref = _stream(source_dirs["bad"])
    got, counts = [], []
    for _ in range(26):  # two epochs: each bad image met twice
        got.append(next(ref))
        counts.append(ref.skipped.total)
    where = f"{source_dirs['bad']} split 'train'"
    assert counts[-1] == len(BAD) and set(ref.skipped.as_dict()) == {where}
    # no path and, streamed, no row number: the split and a digest of the bytes name each
    assert all(name.startswith(f"an image in {where} (sha1 ") for name in ref.skipped.rows[where])
    assert all(len(y) == B for _, y in got)
    # the same rows with good images come in the same order (shuffling never looks at the bytes), so
    # they say where each bad image was: the next good image of its micro-batch (cyclically) must
    # stand in for it
    truths = [truth for _, truth in _take(_stream(source_dirs["parquet"]), 26)[0]]
    for (_, y), truth in zip(got, truths):
        good = [i for i, t in enumerate(truth.tolist()) if t not in BAD]
        stand_in = [i if i in good else next((j for j in good if j > i), good[0]) for i in range(B)]
        assert y.tolist() == truth[stand_in].tolist()
    with_bad = [b for b, truth in enumerate(truths) if set(truth.tolist()) & set(BAD)]
    k = max(b for b in with_bad if b < N // B) + 1  # past the bad images of epoch 0 ...
    end = min(b for b in with_bad if b >= k)  # ... and before they come again in epoch 1
    assert end > k, with_bad
    resumed = _stream(source_dirs["bad"], start_step=k, num_workers=2)
    assert _same(got[k:end], _take(resumed, end - k)[0]) and resumed.skipped.total == 0  # skipped undecoded


def test_evaluation_splits_load_whole_when_training_streams(source_dirs):
    cfg = _cfg(source_dirs["saved"])
    test = sources.load_split(cfg, "test")
    assert isinstance(test, datasets.Dataset) and len(test) == 40
    ys = torch.cat([y for _, y in batches.eval_batches(test, cfg, 32, 16)])
    assert ys.tolist() == list(range(40))


def test_synthetic_streams_too():
    cfg = DataConfig(source="synthetic", streaming=True, num_workers=0, shuffle_buffer=32)
    cfg.synthetic.train_size = 48
    ids = sources.load_stream(cfg)
    x, y = next(streams.stream_train_batches(ids, cfg, 32, 8, seed=0))
    assert x.shape == (8, 3, 32, 32) and y.dtype == torch.int64 and -1 <= x.min() <= x.max() <= 1


def _one_line(error: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(error.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_a_sliced_train_split_is_one_line_naming_the_key(source_dirs):
    with pytest.raises(DataError) as error:  # at resolve time, before any file is read
        check_stream(_cfg(source_dirs["parquet"], train_split="train[:50%]"))
    _one_line(error, "data.train_split", "train[:50%]", "data.streaming")


def test_a_missing_file_is_one_line_naming_it(tmp_path):
    missing = str(tmp_path / "nowhere" / "train.parquet")
    with pytest.raises(DataError) as error:
        sources.load_stream(_cfg(missing))
    _one_line(error, missing)
    with pytest.raises(DataError) as error:
        sources.load_stream(_cfg(str(tmp_path / "*.parquet")))
    _one_line(error, "*.parquet", "matches no file")


def test_a_missing_split_of_a_saved_dataset_is_one_line(source_dirs):
    with pytest.raises(DataError) as error:
        sources.load_stream(_cfg(source_dirs["saved"], train_split="training"))
    _one_line(error, "no split 'training'", "train, test")


DEIT = ("data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.mixup_alpha=0.8",
        "data.cutmix_alpha=1.0")  # DeiT's augmentation, every part of it drawn per micro-batch
# the streamed sources a run is resumed on: a tar source streams unasked, and its .cls labels have
# no names
STREAMED = {"saved": ["data.streaming=true"], "tar": ["data.num_classes=200"]}


@pytest.mark.parametrize("name", STREAMED)
def test_a_streamed_pretrain_interrupted_and_resumed_ends_bit_identical(source_dirs, tmp_path, monkeypatch,
                                                                        name):
    """`vit pretrain` with data.streaming=true (2 loader workers prefetching ahead) and DeiT's
    augmentation: stopped after step 4 of 9 (its checkpoint holds the stream's state), then run
    again, it resumes from its position and ends with the weights of the run never stopped
    (torch.equal); the epoch of 200 rows ends inside step 7."""
    r = resolve("pretrain", None, [
        f"data.source={source_dirs[name]}", *STREAMED[name], "data.shuffle_buffer=64",
        "data.num_workers=2", "data.val_split=", "data.test_split=", "data.batch_size=32",
        "data.micro_batch_size=16",
        "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "model.dropout=0.1", "schedule.steps=9", "schedule.warmup_steps=1",
        "run.ckpt_every=4", "run.log_every=1", "run.precision=fp32", *DEIT])
    one_run(r, tmp_path / "straight")
    stopped_at_call(monkeypatch, r, tmp_path / "resumed", 6)
    saved = manager.latest_good_state(tmp_path / "resumed")[1]
    # 4 steps x 2 micro-batches of 16 read: the next starts at example 128 of epoch 0
    assert saved["step"] == 4
    assert saved["data"]["streams"] == [{"kind": "streamed", "world_size": 1, "micro_batches": 8, "epoch": 0,
                                         "examples": 128}]
    one_run(r, tmp_path / "resumed")
    a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", STREAMED)
def test_a_streamed_pretrain_killed_mid_run_resumes_to_the_uninterrupted_weights(source_dirs, tmp_path, name):
    """The same, as a pre-empted node dies: `vit pretrain` SIGKILLed (process group, loader workers
    too: no handler runs, no checkpoint is written on the way out) once its step-8 checkpoint is
    whole, then the same command again: it resumes from the last good checkpoint and its stream's
    saved position and ends with the weights of the uninterrupted run (torch.equal)."""
    overrides = [
        f"data.source={source_dirs[name]}", *STREAMED[name], "data.shuffle_buffer=64",
        "data.num_workers=2", "data.val_split=", "data.test_split=", "data.batch_size=32",
        "data.micro_batch_size=16", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32",
        "model.depth=1", "model.num_heads=2", "model.mlp_dim=64", "model.dropout=0.1", "schedule.steps=20",
        "schedule.warmup_steps=1", "run.ckpt_every=4", "run.log_every=1", "run.precision=fp32", *DEIT]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # both runs as commands with one thread each: a thread count of its own would sum the same
    # matmuls in another order, and the weights would differ by that alone
    straight = [sys.executable, "-m", "vitcli.cli", "pretrain", "--workdir", str(tmp_path / "straight")]
    assert subprocess.run([*straight, *overrides], check=False, env=env, capture_output=True).returncode == 0
    cmd = [sys.executable, "-m", "vitcli.cli", "pretrain", "--workdir", str(tmp_path / "killed"), *overrides]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    whole = tmp_path / "killed" / "state-8.pt.sha256"  # written after its checkpoint: that one is whole
    deadline = time.monotonic() + 240
    while not whole.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "killed" / MODEL_FILE).exists()
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming from" in " ".join(done.stderr.split())
    a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("straight", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "streaming: true" in (tmp_path / "killed" / RECIPE_FILE).read_text()  # as the run read it


@pytest.mark.parametrize("streaming", [True, False])
def test_a_label_beyond_the_head_is_the_same_one_line_streamed_or_not(source_dirs, tmp_path, streaming):
    """A map-style split is scanned before training; a streamed one cannot be, so each batch's
    labels are checked as it arrives: the same line either way, instead of a failure deep in the
    loss."""
    r = resolve("pretrain", None, [
        f"data.source={source_dirs['saved']}", f"data.streaming={streaming}", "data.shuffle_buffer=64",
        "data.num_workers=0", "data.val_split=", "data.test_split=", "data.batch_size=16",
        "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "model.num_classes=8", "schedule.steps=2", "schedule.warmup_steps=1",
        "run.precision=fp32"])
    with pytest.raises(RecipeError) as error:
        one_run(r, tmp_path / str(streaming))
    _one_line(error, "model.num_classes=8, but the train split 'train' of", source_dirs["saved"],
              "has label", "set model.num_classes=")
