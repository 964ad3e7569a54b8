"""The decoded-image cache: decided by the bytes the images take on disk (never the arrow table's
size), one copy shared by the loader workers, and never more than its capacity."""

import io
import multiprocessing
import pickle

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.data.batching import batches
from vitcli.data.decoding import image_cache
from vitcli.data.decoding.decode import encoded
from vitcli.data.decoding.image_cache import SharedImages, cache_for, encoded_bytes
from vitcli.data.rows import sources
from vitcli.recipe.schema import DataConfig


def _jpeg(seed: int, size=(48, 40)) -> bytes:
    noise = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)  # incompressible
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _folder(root, n: int, size=(48, 40)):
    """An image folder of `n` noise JPEGs in two classes; the files' paths."""
    paths = []
    for i in range(n):
        path = root / f"c{i % 2}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_jpeg(i, size))
        paths.append(path)
    return paths


def _images(source) -> datasets.Dataset:
    return encoded(sources.load_source(str(source), "train"), "image")


def test_a_folder_is_counted_by_its_files_not_its_paths(tmp_path):
    """An image folder's arrow table holds paths: the count is the files' sizes on disk."""
    paths = _folder(tmp_path, 12)
    images = _images(tmp_path)
    on_disk = sum(p.stat().st_size for p in paths)
    assert images.data.nbytes < on_disk / 4  # what the old decision read: the paths
    assert encoded_bytes(images, "image", 2**40) == on_disk


def test_rows_that_hold_their_bytes_are_counted_by_them():
    data = [_jpeg(i) for i in range(5)]
    ds = datasets.Dataset.from_dict({"image": [{"bytes": d, "path": None} for d in data]},
                                    features=datasets.Features({"image": datasets.Image()}))
    assert encoded_bytes(encoded(ds, "image"), "image", 2**40) == sum(map(len, data))


def test_counting_stops_past_the_limit(tmp_path, monkeypatch):
    """A million-file folder is decided after a few thousand stat calls, not a million."""
    _folder(tmp_path, 40)
    monkeypatch.setattr(image_cache, "_CHUNK", 8)
    seen = []
    monkeypatch.setattr(image_cache, "_file_size", lambda p: seen.append(p) or 10_000)
    assert encoded_bytes(_images(tmp_path), "image", 15_000) > 15_000
    assert len(seen) == 8  # one chunk


def test_a_folder_larger_than_the_limit_is_not_cached(tmp_path, monkeypatch):
    paths = _folder(tmp_path, 10)
    images = _images(tmp_path)
    on_disk = sum(p.stat().st_size for p in paths)
    monkeypatch.setattr(image_cache, "CACHE_ENCODED_BYTES", on_disk - 1)
    assert cache_for(images, "image", 2**30)[0] is None
    monkeypatch.setattr(image_cache, "CACHE_ENCODED_BYTES", on_disk)
    cache, counted = cache_for(images, "image", 2**30)
    assert isinstance(cache, SharedImages) and counted == on_disk
    assert cache_for(images, "image", 0)[0] is None  # data.cache_mb=0


def _image(h: int, w: int, fill: int) -> torch.Tensor:
    return torch.full((3, h, w), fill, dtype=torch.uint8)


def test_the_cache_never_holds_more_than_its_capacity():
    cache = SharedImages(rows=10, capacity=3 * 10 * 10 * 3)  # room for three 10 x 10 images
    cache.put({i: _image(10, 10, i) for i in range(5)})
    assert cache.held() == (900, 3) and cache.full
    got = cache.get(list(range(5)))
    assert sorted(got) == [0, 1, 2] and all(torch.equal(got[i], _image(10, 10, i)) for i in got)
    cache.put({0: _image(10, 10, 99)})  # a row already kept is not written again
    assert torch.equal(cache.get([0])[0], _image(10, 10, 0))


def _fill(cache: SharedImages, rows: list[int]) -> None:
    cache.put({i: _image(4, 6, i) for i in rows})


def test_forked_workers_fill_and_read_one_copy():
    """What one worker process keeps, the parent and every other worker read: one copy in all."""
    cache = SharedImages(rows=8, capacity=2**20)
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_fill, args=(cache, rows)) for rows in ([0, 1, 2], [2, 3])]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
        assert w.exitcode == 0
    got = cache.get(list(range(8)))
    assert sorted(got) == [0, 1, 2, 3] and cache.held() == (4 * 72, 4)  # row 2 kept once
    assert all(torch.equal(got[i], _image(4, 6, i)) for i in got)


def test_a_copy_sent_to_a_spawned_process_is_off_rather_than_its_own():
    cache = SharedImages(rows=4, capacity=2**20)
    _fill(cache, [0])
    copy = pickle.loads(pickle.dumps(cache))
    assert copy.get([0]) == {} and copy.full and copy.held() == (0, 0)
    copy.put({1: _image(4, 6, 1)})  # a no-op, not an error


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cached_stream_equals_itself_in_workers_and_keeps_each_image_once(tmp_path, workers):
    """Two epochs of 12 images: with the cache the batches are the same whatever the workers, and
    each image is held once, its whole decoded size."""
    _folder(tmp_path, 12)
    ds = sources.load_source(str(tmp_path), "train")
    cfg = DataConfig(source=str(tmp_path), num_workers=workers, crop_min_area=0.3)
    stream = batches.train_batches(ds, cfg, 16, 4, seed=3)
    taken = [next(stream) for _ in range(6)]
    reference = batches.train_batches(ds, DataConfig(source=str(tmp_path), num_workers=0, crop_min_area=0.3),
                                      16, 4, seed=3)
    for x, y in taken:
        xr, yr = next(reference)
        assert torch.equal(x, xr) and torch.equal(y, yr)
    assert stream.cache.held() == (12 * 48 * 40 * 3, 12)
