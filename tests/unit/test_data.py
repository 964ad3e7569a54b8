"""The data layer: every source kind loads with HF split slicing, tar shards are named as the shell
names them and read with the default columns, errors are one line naming the culprit, the synthetic
set is deterministic and balanced, transforms match torchvision references, and the batch streams
are deterministic, resumable by index arithmetic and disjoint across ranks."""

from __future__ import annotations

import io
import itertools
import shutil
import subprocess
import tarfile

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from vitcli.data.augmentation import augmentations
from vitcli.data.augmentation.augment import finish, pack
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.batching import batches
from vitcli.data.decoding.decode import Encoded
from vitcli.data.rows import sources, tar_shards
from vitcli.data.rows.synthetic import class_names, make_synthetic, render
from vitcli.errors import DataError
from vitcli.recipe.data_checks import check_data
from vitcli.recipe.schema import DataConfig, Recipe, SyntheticConfig

SMALL = SyntheticConfig(num_classes=10, train_size=200, val_size=40, test_size=60, img_size=16, seed=3)


def _indexed(n: int, size: int = 8) -> datasets.Dataset:
    """Random images whose integer label is their row index, so a batch's labels say which rows it
    holds."""
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": images, "label": list(range(n))}, features=features)


def _pixels(ds: datasets.Dataset) -> np.ndarray:
    return np.stack([np.asarray(img) for img in ds["image"]])


def _one_line_error(fn, *needles: str) -> str:
    with pytest.raises(DataError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_per_seed_and_split():
    a, b = make_synthetic(SMALL, "train"), make_synthetic(SMALL, "train")
    assert np.array_equal(_pixels(a), _pixels(b)) and a["label"][:] == b["label"][:]
    other_seed = make_synthetic(SyntheticConfig(**{**SMALL.__dict__, "seed": 4}), "train")
    assert not np.array_equal(_pixels(a), _pixels(other_seed))
    val = make_synthetic(SMALL, "validation")
    assert not np.array_equal(_pixels(a)[: len(val)], _pixels(val))


def test_synthetic_sizes_features_and_label_balance():
    for split, n in (("train", 200), ("validation", 40), ("test", 60)):
        ds = make_synthetic(SMALL, split)
        assert len(ds) == n
        counts = np.bincount(ds["label"][:], minlength=SMALL.num_classes)
        assert counts.max() - counts.min() <= 1 and counts.sum() == n
    assert isinstance(ds.features["image"], datasets.Image)
    assert ds.features["label"].names == class_names(10) and len(set(class_names(30))) == 30
    assert ds[0]["image"].size == (16, 16) and ds[0]["image"].mode == "RGB"


def test_synthetic_draws_the_same_scene_at_any_resolution():
    labels = np.arange(30)
    small = render(labels, 24, np.random.default_rng(7)).astype(np.float32)
    big = render(labels, 96, np.random.default_rng(7)).astype(np.float32)
    pooled = big.reshape(30, 24, 4, 24, 4, 3).mean(axis=(2, 4))  # box-downsample 96 -> 24
    # same parameters, different pixel noise: the pooled big image tracks the small one up to
    # noise/edges
    assert np.abs(pooled - small).mean() < 15
    assert np.abs(pooled - small[::-1]).mean() > 40  # and is far from another scene


def test_synthetic_colour_statistics_do_not_reveal_the_class():
    cfg = SyntheticConfig(num_classes=10, train_size=2000, test_size=1000, img_size=16, seed=0)

    def stats(split):
        ds = make_synthetic(cfg, split)
        x = _pixels(ds).reshape(len(ds), -1, 3).astype(np.float64) / 255
        feats = np.concatenate([x.mean(1), x.std(1), np.ones((len(ds), 1))], axis=1)  # (N, 7)
        return feats, np.asarray(ds["label"][:])

    (f_tr, y_tr), (f_te, y_te) = stats("train"), stats("test")
    w = np.linalg.lstsq(f_tr, np.eye(10)[y_tr], rcond=None)[0]  # least-squares linear classifier
    accuracy = np.mean((f_te @ w).argmax(1) == y_te)
    assert accuracy < 0.25  # chance is 0.10; a class-revealing colour would push this towards 1


def test_synthetic_rejects_bad_sizes():
    num_classes = Recipe(data=DataConfig(synthetic=SyntheticConfig(num_classes=31)))  # checked when resolved
    _one_line_error(lambda: check_data(num_classes), "num_classes=31", "30")
    _one_line_error(lambda: make_synthetic(SMALL, "val"), "'val'", "validation")


# ---------------------------------------------------------------- sources


def test_synthetic_source_slices_like_hf():
    full = make_synthetic(SMALL, "train")
    head = sources.load_source("synthetic", "train[:10%]", synthetic=SMALL)
    tail = sources.load_source("synthetic", "train[-5:]", synthetic=SMALL)
    assert head["label"][:] == full["label"][:20] and tail["label"][:] == full["label"][195:]
    both = sources.load_source("synthetic", "train[:3]+test[:2]", synthetic=SMALL)
    assert both["label"][:] == full["label"][:3] + make_synthetic(SMALL, "test")["label"][:2]


def test_save_to_disk_dict_and_single_dataset(tmp_path):
    ds = _indexed(50)
    datasets.DatasetDict({"train": ds, "test": ds.select(range(10))}).save_to_disk(tmp_path / "dict")
    ds.save_to_disk(tmp_path / "single")
    assert sources.load_source(str(tmp_path / "dict"), "train[:98%]")["label"][:] == list(range(49))
    assert sources.load_source(str(tmp_path / "dict"), "test[2:4]")["label"][:] == [2, 3]
    assert sources.load_source(str(tmp_path / "single"), "train[90%:]")["label"][:] == list(range(45, 50))


def test_parquet_arrow_and_glob(tmp_path):
    ds = _indexed(30)
    ds.select(range(20)).to_parquet(tmp_path / "a.parquet")
    ds.select(range(20, 30)).to_parquet(tmp_path / "b.parquet")
    assert sources.load_source(str(tmp_path / "a.parquet"), "train[:5]")["label"][:] == list(range(5))
    globbed = sources.load_source(str(tmp_path / "*.parquet"), "train[18:22]")
    assert globbed["label"][:] == [18, 19, 20, 21]
    assert isinstance(globbed.features["image"], datasets.Image)
    ds.save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    assert sources.load_source(str(arrow), "train[-2:]")["label"][:] == [28, 29]


def test_imagefolder(tmp_path):
    for name, value in (("cat", 40), ("dog", 200)):
        (tmp_path / name).mkdir()
        for i in range(5):
            Image.fromarray(np.full((6, 6), value, np.uint8), mode="L").save(tmp_path / name / f"{i}.png")
    ds = sources.load_source(str(tmp_path), "train")
    assert ds.features["label"].names == ["cat", "dog"] and len(ds) == 10
    for row in ds:  # grayscale files keep their class: the folder name decides the label
        assert np.asarray(row["image"]).mean() == (40 if row["label"] == 0 else 200)
    assert len(sources.load_source(str(tmp_path), "train[:40%]")) == 4


def test_errors_are_one_line_and_name_the_culprit(tmp_path, monkeypatch):
    ds = _indexed(10)
    ds.save_to_disk(tmp_path / "saved")
    saved = str(tmp_path / "saved")
    missing = str(tmp_path / "nope")
    _one_line_error(lambda: sources.load_source(missing, "train"), "dataset path not found", missing)
    (tmp_path / "empty").mkdir()
    _one_line_error(lambda: sources.load_source(str(tmp_path / "empty"), "train"), "no image files found",
                    "the folder is empty")
    _one_line_error(lambda: sources.load_source(saved, "validation"), "'validation'", "available: train")
    _one_line_error(lambda: sources.load_source(saved, "train", image_column="img"), "'img'", "image, label")
    _one_line_error(lambda: sources.load_source(saved, "train", label_column="y"), "'y'", "image, label")
    _one_line_error(lambda: sources.load_source(saved, "train[:0]"), "train[:0]", "empty")
    _one_line_error(lambda: sources.load_source("synthetic", "tset", synthetic=SMALL), "'tset'", "train")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    hub_id = "someone/some-dataset"
    _one_line_error(lambda: sources.load_source(hub_id, "train"), hub_id, "offline")


def test_one_dispatch_says_what_a_source_is_for_loading_and_streaming(tmp_path):
    ds = _indexed(10)
    ds.to_parquet(tmp_path / "a.parquet")
    ds.save_to_disk(tmp_path / "saved")
    (tmp_path / "folder").mkdir()
    kinds = {"synthetic": "synthetic", "owner/name": "hub", str(tmp_path / "a.parquet"): "files",
             str(tmp_path / "*.parquet"): "files", str(tmp_path / "saved"): "saved",
             str(tmp_path / "folder"): "folder"}
    assert {source: sources.source_kind(source)[0] for source in kinds} == kinds
    # the same rows either way
    for source in (str(tmp_path / "a.parquet"), str(tmp_path / "saved"), "synthetic"):
        cfg = DataConfig(source=source, synthetic=SMALL)
        loaded = sources.load_split(cfg, "train")
        streamed = sources.load_stream(cfg)
        assert sorted(ex["label"] for ex in streamed) == sorted(loaded["label"])
    missing = str(tmp_path / "nope")
    for load in (lambda: sources.load_split(DataConfig(source=missing), "train"),
                 lambda: sources.load_stream(DataConfig(source=missing))):
        assert _one_line_error(load, missing) == f"dataset path not found: {missing}"


BRACES = {
    "/d/train-{000000..000002}.tar": ["/d/train-000000.tar", "/d/train-000001.tar", "/d/train-000002.tar"],
    "{8..010}": ["008", "009", "010"],  # a bound written with a leading zero pads to the wider one
    "{9..11}": ["9", "10", "11"],
    "{3..1}": ["3", "2", "1"],
    "{a,b}-{1..2}.tar": ["a-1.tar", "a-2.tar", "b-1.tar", "b-2.tar"],
    "{a,b{1..2}}": ["a", "b1", "b2"],
    "{x}{1,2}": ["{x}1", "{x}2"],  # a group of one is text
    "x{a,b": ["x{a,b"],  # unbalanced: text
    "plain.tar": ["plain.tar"],
}


@pytest.mark.parametrize("pattern", BRACES)
def test_brace_patterns_expand_as_the_shell_expands_them(pattern):
    assert tar_shards.expand_braces(pattern) == BRACES[pattern]
    if shutil.which("bash"):  # the reference: bash's own brace expansion
        shell = subprocess.run(["bash", "-c", f"printf '%s\\n' {pattern}"], capture_output=True, text=True,
                               check=True)
        assert shell.stdout.split() == BRACES[pattern]


def _tar(path, examples: list[dict[str, bytes]]) -> str:
    """A tar of `examples`, each {member extension: bytes}, keyed 0, 1, 2, ..."""
    with tarfile.open(path, "w") as tar:
        for key, members in enumerate(examples):
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _png_bytes(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_tar_shards_are_a_file_a_pattern_or_a_folder_split_by_file_names(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("imagenet-train-0.tar", "imagenet-train-1.tar", "imagenet-validation-0.tar"):
        _tar(shards / name, [{"jpg": _png_bytes(1), "cls": b"1"}])
    (shards / "README.md").write_text("a dataset card: not a split")
    train = [str(shards / f"imagenet-train-{k}.tar") for k in (0, 1)]
    kinds = {train[0]: ("shards", train[:1]), str(shards / "imagenet-train-{0..1}.tar"): ("shards", train),
             str(shards / "*-train-*.tar"): ("shards", train), str(shards): ("shards", shards)}
    assert {source: sources.source_kind(source) for source in kinds} == kinds
    assert sources.available_splits(str(shards), SMALL) == ["train", "validation"]
    assert sources.available_splits(train[0], SMALL) == ["train"]
    _one_line_error(lambda: sources.source_kind(str(shards / "imagenet-train-{0..2}.tar")),
                    "imagenet-train-2.tar is not a file")
    _tar(shards / "extra-0.tar", [{"jpg": _png_bytes(1), "cls": b"1"}])
    _one_line_error(lambda: sources.available_splits(str(shards), SMALL), "extra-0.tar names no split")


def test_a_standard_webdataset_reads_with_the_default_columns_an_ambiguous_one_names_its_columns(tmp_path):
    """KEY.jpg + KEY.cls (timm's layout; a mask beside it is no rival) reads as image and label,
    streamed or loaded; images no name decides between, or no label, are one line listing the
    columns there are."""
    standard = _tar(tmp_path / "std.tar", [{"jpg": _png_bytes(i), "seg.png": _png_bytes(0), "cls": b"%d" % i}
                                           for i in range(3)])
    assert sources.load_source(standard, "train")["label"] == [0, 1, 2]
    streamed = sources.load_stream(DataConfig(source=standard, streaming=True))
    assert [row["label"] for row in streamed] == [0, 1, 2]
    pair = _tar(tmp_path / "pair.tar", [{"left.png": _png_bytes(i), "right.png": _png_bytes(i)}
                                        for i in range(3)])
    _one_line_error(lambda: sources.load_source(pair, "train"), "no image column 'image' (data.image_column)",
                    "columns: left.png, right.png, __key__, __url__")
    assert len(sources.load_source(pair, "train", image_column="left.png", label_column="")) == 3
    unlabelled = _tar(tmp_path / "json.tar", [{"jpg": _png_bytes(i), "json": b'{"y": 1}'} for i in range(3)])
    _one_line_error(lambda: sources.load_stream(DataConfig(source=unlabelled, streaming=True)),
                    "no label column 'label' (data.label_column)", "columns: image, json, __key__, __url__")


def test_a_slice_past_the_end_of_a_local_split_is_an_error_not_clamped(tmp_path):
    datasets.DatasetDict({"train": _indexed(10), "test": _indexed(10)}).save_to_disk(tmp_path / "d")
    source = str(tmp_path / "d")
    clamped = datasets.ReadInstruction.from_spec("train[8:12]").to_absolute({"train": 10})[0]
    assert (clamped.from_, clamped.to) == (8, 10), "HF clamps silently: the reason for our check"
    rows = list(range(10))  # each row's label is its index
    for spec, expected in [("train[:10]", rows), ("train[3:7]", rows[3:7]), ("train[7:]", rows[7:]),
                           ("test[50%:]", rows[5:]), ("train[-3:]", rows[-3:]),
                           ("train[:8]+test[8:10]", rows[:8] + rows[8:10])]:
        assert sources.load_source(source, spec)["label"] == expected, spec
    for spec, part in [("train[:800]", "train[:800]"), ("train[8:12]", "train[8:12]"),
                       ("train[12:]", "train[12:]"), ("train[-11:]", "train[-11:]"),
                       ("train[:8]+test[9:11]", "test[9:11]")]:
        _one_line_error(lambda spec=spec: sources.load_source(source, spec), source, f"'{part}'",
                        "past the end", "(10 rows)")
    _one_line_error(lambda: sources.load_source(source, "train[:8]+test[10:]"), "'test[10:]' is empty")


def test_label_column_may_be_skipped_for_derived_labels(tmp_path):
    ds = _indexed(4).rename_column("label", "raw")
    ds.save_to_disk(tmp_path / "d")
    assert sources.load_source(str(tmp_path / "d"), "train", label_column="").column_names == ["image", "raw"]


def test_num_classes():
    ds = make_synthetic(SMALL, "validation")
    assert sources.num_classes(DataConfig(), ds) == 10
    assert sources.num_classes(DataConfig(num_classes=7), _indexed(3)) == 7
    _one_line_error(lambda: sources.num_classes(DataConfig(), _indexed(3)), "data.num_classes")


# ---------------------------------------------------------------- transforms


def _encoded(img: Image.Image, fmt: str = "PNG") -> Encoded:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return Encoded(buf.getvalue())


def test_finish_matches_totensor_normalize():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 5, 3), dtype=np.uint8))
    reference = T.Normalize((0.5,) * 3, (0.5,) * 3)(T.ToTensor()(img))
    x = finish(pack([_encoded(img).full()], np.zeros(1, bool), 5), torch.device("cpu"))[0]
    assert torch.allclose(x, reference, atol=1e-6)


def test_train_transform_shape_and_range_for_rgb_and_grayscale():
    cfg = DataConfig(crop_min_area=0.3, randaugment="rand-m9-mstd0.5")
    images = [_encoded(Image.new("RGB", (40, 30), (255, 0, 0))), _encoded(Image.new("L", (13, 17), 0))]
    for c in (cfg, DataConfig(crop_min_area=0.3)):
        pixels = build_transform(c, 24, train=True)(images, 0)
        assert pixels.pixels.dtype == torch.uint8
        x = finish(pixels, torch.device("cpu"), augmentations.of(c, 24))
        assert x.shape == (2, 3, 24, 24) and x.dtype == torch.float32
        assert x.min() >= -1 and x.max() <= 1
    assert (x[0, 0] == 1).all() and (x[0, 1:] == -1).all() and (x[1] == -1).all()  # no RandAugment: colours
    _one_line_error(lambda: build_transform(DataConfig(randaugment="rand-x9"), 24, train=True), "rand-x9")


@pytest.mark.parametrize("shape", [(30, 40), (97, 61)])
def test_eval_transform_matches_timm_pil_within_two_levels(shape):
    """Resize short side to floor(S / crop_pct) antialiased, centre crop: torchvision's uint8 tensor
    resize is PIL's filter, so it agrees with timm's PIL pipeline to within rounding (2 levels of
    255)."""
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8))
    finishing = [T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)]
    bilinear = T.InterpolationMode.BILINEAR
    cpu = torch.device("cpu")
    eval_pp = build_transform(DataConfig(eval_crop_pct=0.875), 16, train=False)
    got = finish(eval_pp([_encoded(img)], None), cpu)
    want = T.Compose([T.Resize(int(16 / 0.875), bilinear), T.CenterCrop(16), *finishing])(img)  # short 18
    assert (got[0] - want).abs().max() <= 2 / 127.5 + 1e-6
    gray = finish(build_transform(DataConfig(), 16, train=False)([_encoded(img.convert("L"))], None), cpu)
    assert gray.shape == (1, 3, 16, 16) and torch.equal(gray[0, 0], gray[0, 2])


def test_decode_reads_grey_palette_rgba_and_formats_torchvision_lacks():
    rgb = np.random.default_rng(2).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    img = Image.fromarray(rgb)
    for mode in ("L", "P", "RGBA"):
        want = np.asarray(img.convert(mode).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(_encoded(img.convert(mode)).full().numpy(), want), mode
    for fmt in ("BMP", "TIFF"):
        assert np.array_equal(_encoded(img, fmt).full().numpy(), rgb.transpose(2, 0, 1)), fmt


def test_a_jpeg_crop_is_decoded_at_reduced_scale_only_when_the_output_allows():
    y, x = np.mgrid[0:480, 0:640]
    smooth = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 255 // 1120], -1).astype(np.uint8)
    img = _encoded(Image.fromarray(smooth), "JPEG")
    box = (40, 80, 400, 480)
    full = img.pixels(box, 0)  # no output size: full resolution
    assert full.shape == (3, 400, 480)
    quarter = img.pixels(box, 96)  # 400 / 4 = 100 >= 96 > 400 / 8
    assert quarter.shape == (3, 100, 120)
    # the reduced decode shows the same picture: a quarter-size average of the full crop
    pooled = torch.nn.functional.avg_pool2d(full[None].float(), 4)[0]
    assert (pooled - quarter.float()).abs().mean() < 2
    assert img.pixels(box, 224).shape == (3, 400, 480)  # 400 / 2 < 224: no reduction


# ---------------------------------------------------------------- batch streams


def _take(stream, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(itertools.islice(stream, k))


def test_train_batches_deterministic_and_seed_dependent():
    ds, cfg = _indexed(40), DataConfig(num_workers=0, crop_min_area=0.5)
    a = _take(batches.train_batches(ds, cfg, 8, 8, seed=1), 3)
    b = _take(batches.train_batches(ds, cfg, 8, 8, seed=1), 3)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.shape == (8, 3, 8, 8) and xa.dtype == torch.float32 and ya.dtype == torch.int64
    c = _take(batches.train_batches(ds, cfg, 8, 8, seed=2), 1)
    assert not torch.equal(a[0][1], c[0][1])


def test_each_epoch_is_a_fresh_permutation_with_drop_last():
    ds, cfg = _indexed(44), DataConfig(num_workers=0)
    labels = [y for _, y in _take(batches.train_batches(ds, cfg, 8, 8, seed=0), 10)]  # 5 batches per epoch
    epoch0, epoch1 = torch.cat(labels[:5]), torch.cat(labels[5:])
    assert len(set(epoch0.tolist())) == 40 and len(set(epoch1.tolist())) == 40  # 4 rows dropped each epoch
    assert not torch.equal(epoch0, epoch1)


def _count_decodes(monkeypatch) -> list:
    """Counts the images opened (an image is opened before any of its pixels are decoded)."""
    decoded, original = [], Encoded.__init__

    def counting(self, *args, **kw):
        decoded.append(1)
        original(self, *args, **kw)

    monkeypatch.setattr(Encoded, "__init__", counting)
    return decoded


def test_resume_skip_equals_continuation_and_decodes_nothing_skipped(monkeypatch):
    ds, cfg = _indexed(40), DataConfig(num_workers=0, crop_min_area=0.3)
    straight = _take(batches.train_batches(ds, cfg, 8, 8, seed=5), 12)  # crosses two epoch boundaries
    decoded = _count_decodes(monkeypatch)
    resumed = _take(batches.train_batches(ds, cfg, 8, 8, seed=5, start_step=7), 1)
    assert len(decoded) == 8  # only the one batch that was asked for
    resumed += _take(batches.train_batches(ds, cfg, 8, 8, seed=5, start_step=8), 4)
    for (xs, ys), (xr, yr) in zip(straight[7:], resumed):
        assert torch.equal(xs, xr) and torch.equal(ys, yr)


def test_training_decodes_each_small_dataset_image_once(monkeypatch):
    decoded = _count_decodes(monkeypatch)
    _take(batches.train_batches(_indexed(40), DataConfig(num_workers=0), 8, 8, seed=0), 15)  # three epochs
    assert len(decoded) == 40


def test_main_process_batches_leave_global_rngs_alone():
    ds, cfg = _indexed(16), DataConfig(num_workers=0, randaugment="rand-m9-mstd0.5")
    torch.manual_seed(0)
    expected = torch.rand(3), np.random.get_state()[1][:4].copy()
    torch.manual_seed(0)
    _take(batches.train_batches(ds, cfg, 8, 8, seed=0), 2)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.get_state()[1][:4], expected[1])


def test_worker_processes_give_the_same_stream():
    ds = _indexed(32)
    main = _take(batches.train_batches(ds, DataConfig(num_workers=0), 8, 8, seed=0), 5)
    workers = _take(batches.train_batches(ds, DataConfig(num_workers=2), 8, 8, seed=0), 5)
    for (xa, ya), (xb, yb) in zip(main, workers):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def _jpegs(n: int, truncated: int) -> datasets.Dataset:
    """n smooth JPEGs of 60..120 px (reduced-scale decoding applies to their larger crops), the
    label their row; row `truncated` opens (its header is whole) but its pixels do not decode."""
    rng = np.random.default_rng(4)
    rows = []
    for i in range(n):
        h, w = rng.integers(60, 120, 2)
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, i * 9)], -1).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        data = buf.getvalue()
        rows.append({"bytes": data[: len(data) // 2] if i == truncated else data, "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": rows, "label": list(range(n))}, features=features)


AUGMENTATIONS = {  # the plain route, DeiT's per-image augmentation, DeiT III's
    "plain": {},
    "deit": {"randaugment": "rand-m9-mstd0.5-inc1", "erasing": 0.25},
    "3-augment": {"three_augment": True, "color_jitter": 0.3, "erasing": 0.25, "erasing_mode": "rand"},
}


@pytest.mark.parametrize("augmentation", AUGMENTATIONS)
def test_undecoded_jpegs_give_the_same_stream_in_workers_and_on_resume(augmentation):
    """Past the cache (large datasets) images are read as bytes and only their crops decoded, some
    at 1/2 or 1/4 scale; the batches stay a function of (seed, step), and a file that opens but does
    not decode gets the next row in its place in every process alike."""
    ds, size = _jpegs(12, truncated=3), 16
    cfg = DataConfig(num_workers=0, crop_min_area=0.3, cache_mb=0, **AUGMENTATIONS[augmentation])
    main = _take(batches.train_batches(ds, cfg, size, 4, seed=2), 6)
    two = DataConfig(num_workers=2, crop_min_area=0.3, cache_mb=0, **AUGMENTATIONS[augmentation])
    workers = _take(batches.train_batches(ds, two, size, 4, seed=2), 6)
    resumed = _take(batches.train_batches(ds, cfg, size, 4, seed=2, start_step=4), 2)
    for (xa, ya), (xb, yb) in zip(main, workers, strict=True):
        assert xa.shape == (4, 3, size, size) and torch.equal(xa, xb) and torch.equal(ya, yb)
    for (xa, ya), (xb, yb) in zip(main[4:], resumed):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    labels = torch.cat([y for _, y in main]).tolist()
    assert len(set(labels)) == 11 and 3 not in labels  # 2 epochs of 12 rows: all but the truncated one


def test_crops_resized_on_the_device_equal_crops_resized_in_the_worker():
    """A stream for a GPU ships crops and augment.finish resizes them there in one batched gather;
    one for the CPU resizes its crops in its workers with torch's uint8 kernel: the same resize
    within one level."""
    raws = _jpegs(6, truncated=-1).cast_column("image", datasets.Image(decode=False))["image"]
    images, size = [Encoded(raw["bytes"]) for raw in raws], 16
    cfg = DataConfig(crop_min_area=0.3)
    shipped = build_transform(cfg, size, train=True)(images, 5)
    assert shipped.pixels.shape[-1] > size  # crops, not yet resized
    here = build_transform(cfg, size, train=True, resize_here=True)(images, 5)
    assert here.pixels.shape == (6, 3, size, size)
    cpu = torch.device("cpu")
    diff = (finish(shipped, cpu) - finish(here, cpu)).abs() * 127.5
    # the worker's uint8 kernel blends in fixed point: ~19% of pixels a level from the gather's
    # rounding
    assert diff.max() <= 1 + 1e-4 and (diff > 0.5).float().mean() < 0.3


def test_rank_shards_are_disjoint():
    ds, cfg = _indexed(40), DataConfig(num_workers=0)
    shards = [torch.cat([y for _, y in
                         _take(batches.train_batches(ds, cfg, 8, 4, 0, rank=r, world_size=2), 5)])
              for r in (0, 1)]
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())
    assert len(set(shards[0].tolist()) | set(shards[1].tolist())) == 40


def test_too_small_for_one_micro_batch():
    _one_line_error(lambda: batches.train_batches(_indexed(6), DataConfig(), 8, 8, seed=0), "6 images", "8")


def test_eval_batches_in_order_sharded_without_drop():
    ds, cfg = _indexed(23), DataConfig(num_workers=0)
    ys = [y for _, y in batches.eval_batches(ds, cfg, 8, 5)]
    assert torch.cat(ys).tolist() == list(range(23)) and len(ys[-1]) == 3
    ranks = [torch.cat([y for _, y in batches.eval_batches(ds, cfg, 8, 4, r, 3)]).tolist() for r in range(3)]
    assert ranks[1] == list(range(1, 23, 3)) and sorted(itertools.chain(*ranks)) == list(range(23))
    x0 = next(iter(batches.eval_batches(ds, cfg, 8, 5)))[0]
    assert torch.equal(x0, next(iter(batches.eval_batches(ds, cfg, 8, 5)))[0])


def test_one_process_accumulating_sees_what_two_processes_see():
    """Global batch 16 of micro-batches of 4: one process with 4 per step, or two with 2 each, get
    the same micro-batches (rows and augmentation), global micro-batch j on rank j // 2."""
    ds, cfg = _indexed(40), DataConfig(num_workers=0, crop_min_area=0.3)
    one = _take(batches.train_batches(ds, cfg, 8, 4, seed=3, accum=4), 12)  # 3 steps: 2 per epoch of 40
    two = [_take(batches.train_batches(ds, cfg, 8, 4, 3, rank=r, world_size=2, accum=2), 6) for r in (0, 1)]
    for step in range(3):
        interleaved = two[0][2 * step : 2 * step + 2] + two[1][2 * step : 2 * step + 2]
        for (xa, ya), (xb, yb) in zip(one[4 * step : 4 * step + 4], interleaved, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
