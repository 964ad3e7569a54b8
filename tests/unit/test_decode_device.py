"""data.decode_device=model: training JPEGs leave the loader workers encoded (augment.Encodings) and are
decoded where the model runs, in one decode_jpeg call per micro-batch. On the CPU that call is the same
libjpeg-turbo as the workers' decode_image, so the batches are the worker path's own; these tests hold them
to it on JPEGs small enough (< 2 x the output side) that the workers never decode at reduced scale."""

import io

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.data import batches, streams
from vitcli.data.augment import Encodings, Pixels, finish
from vitcli.data.decode import Encoded, read
from vitcli.data.transforms import build_transform
from vitcli.errors import DataError
from vitcli.recipe.schema import DataConfig

SIZE = 32  # the images are 36..60 px: reduced-scale decoding needs a crop of >= 64 (2 x 32)
CPU = torch.device("cpu")


def _jpeg(i: int, rng: np.random.Generator, fmt: str = "JPEG") -> bytes:
    h, w = rng.integers(36, 61, 2)
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 255 // w, y * 255 // h, (x * y + i * 37) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def _folder(tmp_path, n: int, truncated=()) -> datasets.Dataset:
    """An image folder of n JPEGs as imagefolder loads it (each row only its path), the label its row;
    the files of `truncated` rows are cut in half: their header parses, their data does not decode."""
    rng, rows = np.random.default_rng(7), []
    for i in range(n):
        data = _jpeg(i, rng)
        path = tmp_path / f"{i:03d}.jpg"
        path.write_bytes(data[: len(data) // 2] if i in truncated else data)
        rows.append({"bytes": None, "path": str(path)})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": rows, "label": list(range(n))}, features=features)


def _take(stream, k: int) -> list:
    return [next(stream) for _ in range(k)]


def _cfg(device: str, workers: int = 0) -> DataConfig:
    return DataConfig(num_workers=workers, crop_min_area=0.3, decode_device=device)


def test_a_micro_batch_decoded_on_the_device_is_the_workers_crops_finished_there(tmp_path):
    """Bit for bit: the same boxes and flips, the same libjpeg-turbo, the same batched resize (levels)."""
    raws = _folder(tmp_path, 6).cast_column("image", datasets.Image(decode=False))["image"]
    images = [Encoded(read(r)) for r in raws]
    shipped = build_transform(_cfg("model"), SIZE, train=True)(images, 11)
    crops = build_transform(_cfg("worker"), SIZE, train=True)(images, 11)
    assert isinstance(shipped, Encodings) and isinstance(crops, Pixels)
    shipped.ids = list(range(6))
    x, y, bad = batches.decode_on_device(shipped, torch.arange(6), CPU, "folder")
    assert torch.equal(x, finish(crops, CPU)) and torch.equal(y, torch.arange(6)) and bad == {}


def test_a_batch_holding_any_png_is_decoded_in_the_worker(tmp_path):
    rng = np.random.default_rng(0)
    jpegs = [Encoded(_jpeg(i, rng)) for i in range(3)]
    png = Encoded(_jpeg(3, rng, "PNG"))
    transform = build_transform(_cfg("model"), SIZE, train=True)
    assert isinstance(transform(jpegs, 0), Encodings)
    assert isinstance(transform([*jpegs, png], 0), Pixels)


def test_model_decoding_gives_the_worker_stream_within_one_level(tmp_path):
    """A CPU stream's workers resize their crops with torch's uint8 kernel (augment.resize_each), which
    blends in fixed point; the device path resizes the batch in one float gather (augment.levels) and rounds:
    about a fifth of the pixels a level apart, none further (test_augment holds both to the exact resize)."""
    ds = _folder(tmp_path, 16)
    worker = _take(batches.train_batches(ds, _cfg("worker"), SIZE, 4, seed=3), 6)
    model = _take(batches.train_batches(ds, _cfg("model"), SIZE, 4, seed=3), 6)
    for (xa, ya), (xb, yb) in zip(worker, model, strict=True):
        diff = (xa - xb).abs() * 127.5
        assert torch.equal(ya, yb) and diff.max() <= 1 + 1e-4 and (diff > 0.5).float().mean() < 0.3


def test_model_decoding_is_the_same_with_workers_and_on_resume(tmp_path, monkeypatch):
    ds, decoded = _folder(tmp_path, 16), []
    on_device = batches.decode_on_device
    monkeypatch.setattr(batches, "decode_on_device", lambda b, *a: decoded.append(b) or on_device(b, *a))
    main = _take(batches.train_batches(ds, _cfg("model"), SIZE, 4, seed=5), 6)
    two = _take(batches.train_batches(ds, _cfg("model", workers=2), SIZE, 4, seed=5), 6)
    resumed = _take(batches.train_batches(ds, _cfg("model"), SIZE, 4, seed=5, start_step=4), 2)
    for (xa, ya), (xb, yb) in zip(main, two, strict=True):
        assert xa.shape == (4, 3, SIZE, SIZE) and torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, ya), (xb, yb) in zip(main[4:], resumed, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert len(decoded) == 14  # every batch came encoded, from this process and from the workers


def test_a_truncated_jpeg_is_stood_in_by_the_next_image_of_its_micro_batch(tmp_path):
    """Its header parses in the worker; its data fails on the device: the next image of the same
    micro-batch takes its place (not the next row of the split, as on the worker path), counted once."""
    ds, bad_row = _folder(tmp_path, 12, truncated={5}), 5
    stream = batches.train_batches(ds, _cfg("model"), SIZE, 4, seed=1)
    keys = batches._train_keys(12, 4, 1, 1, 0, 0, 1)
    met = 0
    for (x, y), (_, rows) in zip(_take(stream, 9), keys):
        assert x.shape == (4, 3, SIZE, SIZE) and bad_row not in y.tolist()
        if bad_row in rows:
            met += 1
            p = rows.index(bad_row)
            assert y.tolist() == [r if r != bad_row else rows[(p + 1) % 4] for r in rows]
        else:
            assert y.tolist() == rows
    assert met == 3  # 9 micro-batches of 4 over 12 rows: 3 epochs
    assert list(stream.skipped.as_dict()[stream.name]) == [bad_row]
    found = stream.skipped.rows[stream.name][bad_row]
    assert found.image == str(tmp_path / "005.jpg") and "truncated" in found.reason  # named by its file


def test_a_streamed_truncated_jpeg_gets_the_worker_paths_stand_in(tmp_path):
    """Streamed, both paths replace it within its micro-batch, and the device path draws the boxes again for
    the images now in the batch: the same labels, the same pixels within one level."""
    ds = _folder(tmp_path, 12, truncated={2})
    ids = ds.cast_column("image", datasets.Image(decode=False)).to_iterable_dataset(num_shards=2)
    out = {}
    for device in ("worker", "model"):
        cfg = DataConfig(num_workers=0, crop_min_area=0.3, decode_device=device, streaming=True,
                         shuffle_buffer=4)
        stream = streams.stream_train_batches(ids, cfg, SIZE, 4, seed=2)
        out[device] = _take(stream, 6), stream.skipped.as_dict()
    (worker, w_skipped), (model, m_skipped) = out["worker"], out["model"]
    assert w_skipped == m_skipped and len(next(iter(m_skipped.values()))) == 1
    for (xa, ya), (xb, yb) in zip(worker, model, strict=True):
        assert torch.equal(ya, yb) and 2 not in yb.tolist() and ((xa - xb).abs() * 127.5).max() <= 1 + 1e-4


def test_a_micro_batch_none_of_which_decodes_is_one_line(tmp_path):
    ds = _folder(tmp_path, 4, truncated=range(4))
    with pytest.raises(DataError) as error:
        next(batches.train_batches(ds, _cfg("model"), SIZE, 4, seed=0))
    msg = str(error.value)
    assert "\n" not in msg and "no image of a micro-batch of" in msg and "truncated" in msg, msg
    assert any(f"; {tmp_path / f'{i:03d}.jpg'}: " in msg for i in range(4)), msg  # a file, by its path
