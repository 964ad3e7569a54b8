"""`vit prepare-data`: a pre-resized copy of a source that data.source reads like the original
(labels, names, row order; images at the new size, close to an exact resize), map-style and
streamed; as WebDataset tar shards (--shards tar) the same images, which HF's webdataset builder
reads and training streams; the manifest counts and digests what is on disk; training on it resumes
exactly; bad input is one line, exit 2, nothing written; an existing copy is kept unless
--overwrite, and then set aside."""

import hashlib
import io
import json
import shutil
import tarfile

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import functional as TF

from helpers import run_vit, stopped_at_call
from vitcli.checkpoints import manager
from vitcli.checkpoints.weights import load_weights
from vitcli.data.rows import prepare, sources
from vitcli.errors import DataError
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig, SyntheticConfig
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages import prepare as stage
from vitcli.stages.run import one_run

SIZES = ["data.synthetic.train_size=64", "data.synthetic.val_size=16", "data.synthetic.test_size=16",
         "data.synthetic.num_classes=4"]
SYNTHETIC = SyntheticConfig(train_size=64, val_size=16, test_size=16, num_classes=4)
MAX = 24  # the synthetic images are 32 px: every one is resized
SHARD_MB = 0.03  # the train split (~85 kB) in ~3 shards: read in order, they must give the source order


def prepare_data(source, out, overrides=(), **kwargs):
    """The stage on the recipe `vit prepare-data SOURCE OVERRIDES...` resolves (the splits are
    --splits' alone)."""
    flags = {"data.source": source, "data.train_split": "", "data.val_split": "",
             "data.test_split": ""}
    return stage.prepare_data(resolve("prepare-data", None, list(overrides), flags), out, **kwargs)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "synthetic-24"
    prepare_data("synthetic", out, overrides=SIZES, options=prepare.Options(max_size=MAX, shard_mb=SHARD_MB))
    assert len(_manifest(out)["splits"]["train"]["shards"]) > 1
    return out


@pytest.fixture(scope="module")
def prepared_tar(tmp_path_factory):
    """The same copy as WebDataset tar shards."""
    out = tmp_path_factory.mktemp("prepared") / "synthetic-24-tar"
    options = prepare.Options(max_size=MAX, shard_mb=SHARD_MB, shards="tar")
    prepare_data("synthetic", out, overrides=SIZES, options=options)
    assert len(_manifest(out)["splits"]["train"]["shards"]) > 1
    return out


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_the_copy_has_the_sources_labels_names_and_order_and_its_images_resized(prepared, split):
    """Images against torchvision's antialiased bicubic resize of the original. The tolerance is
    JPEG's loss: at quality 95 and 24 px, on the synthetic images' one-pixel edges and pixel noise
    (the hardest case for JPEG), ~3 grey levels mean per image; a mean over the split under 4 allows
    for the smaller splits."""
    original = sources.load_source("synthetic", split, synthetic=SYNTHETIC)
    copy = sources.load_source(str(prepared), split)
    assert copy.features["label"].names == original.features["label"].names
    assert copy["label"] == original["label"]
    errors = []
    for a, b in zip(original["image"], copy["image"]):
        assert b.size == (MAX, MAX)
        pixels = torch.from_numpy(np.array(a.convert("RGB"))).permute(2, 0, 1)
        exact = TF.resize(pixels, [MAX, MAX], antialias=True, interpolation=TF.InterpolationMode.BICUBIC)
        errors.append(np.abs(np.asarray(b.convert("RGB"), float) - exact.permute(1, 2, 0).numpy()).mean())
    assert np.mean(errors) < 4.0, np.mean(errors)


def test_the_manifest_counts_the_rows_and_digests_every_shard(prepared):
    manifest = _manifest(prepared)
    for split, entry in manifest["splits"].items():
        n = len(entry["shards"])
        names = [f"{split}-{k:05d}-of-{n:05d}.parquet" for k in range(n)]
        assert [s["file"] for s in entry["shards"]] == names
    assert manifest["max_size"] == MAX and manifest["format"] == "jpeg" and manifest["quality"] == 95
    assert manifest["label_names"] == sources.load_source("synthetic", "test", synthetic=SYNTHETIC).features[
        "label"].names
    listed = set()
    for split, entry in manifest["splits"].items():
        assert entry["rows"] == len(sources.load_source("synthetic", split, synthetic=SYNTHETIC))
        assert entry["undecodable"] == 0 and sum(s["rows"] for s in entry["shards"]) == entry["rows"]
        for shard in entry["shards"]:
            assert hashlib.sha256((prepared / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
            listed.add(shard["file"])
    assert {p.name for p in prepared.iterdir()} == listed | {"manifest.json", "SHA256SUMS"}
    assert [p.name for p in prepared.parent.iterdir()] == [prepared.name], "no temporary left beside it"


def test_two_resizing_processes_write_the_same_bytes(prepared, tmp_path):
    two = prepare.Options(max_size=MAX, workers=2, shard_mb=SHARD_MB)
    prepare_data("synthetic", tmp_path / "w2", overrides=SIZES, options=two)
    digests = [[s["sha256"] for s in e["shards"]] for e in _manifest(tmp_path / "w2")["splits"].values()]
    assert digests == [[s["sha256"] for s in e["shards"]] for e in _manifest(prepared)["splits"].values()]


def test_a_stream_of_the_copy_gives_the_rows_in_source_order(prepared):
    ids = sources.load_stream(DataConfig(source=str(prepared), streaming=True))
    assert [row["label"] for row in ids] == sources.load_source(str(prepared), "train")["label"]


def test_a_shard_cut_short_is_named(prepared, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in prepared.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    manifest = _manifest(copy)
    manifest["splits"]["test"]["rows"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="split 'test' has 16 rows in its shards but 17"):
        sources.load_source(str(copy), "test")


@pytest.mark.parametrize("split", ["train", "test"])
def test_hf_webdataset_builder_reads_the_tar_shards_as_the_parquet_copy_holds_them(prepared, prepared_tar,
                                                                                   split):
    """The real client reads the tars: each key's image and label are the parquet copy's row of that
    number (the same JPEG bytes), the rows in the manifest's seeded order, members `KEY.jpg` then
    `KEY.cls`, adjacent; and data.source reads them as it reads the copy (default columns, class
    names from the manifest), loaded or streamed."""
    written = _manifest(prepared_tar)
    entry = written["splits"][split]
    files = [str(prepared_tar / shard["file"]) for shard in entry["shards"]]
    assert [f.rsplit("/", 1)[1] for f in files] == [f"{split}-{k:05d}-of-{len(files):05d}.tar"
                                                    for k in range(len(files))]
    read = datasets.load_dataset("webdataset", data_files={split: files}, split=split)
    read = read.cast_column("jpg", datasets.Image(decode=False))
    parquet = sources.load_source(str(prepared), split).cast_column("image", datasets.Image(decode=False))
    order = np.random.default_rng(written["shuffle_seed"]).permutation(len(parquet)).tolist()
    assert read["__key__"] == [f"{row:08d}" for row in order] and order != sorted(order)
    labels = [parquet["label"][row] for row in order]
    assert read["cls"] == labels
    assert [img["bytes"] for img in read["jpg"]] == [parquet["image"][row]["bytes"] for row in order]
    with tarfile.open(files[0]) as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:4]] == [f"{order[0]:08d}.jpg", f"{order[0]:08d}.cls",
                                             f"{order[1]:08d}.jpg", f"{order[1]:08d}.cls"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in members} == {(0, 0, 0, "", "", 0o644)}
    copy = sources.load_source(str(prepared_tar), split)
    assert copy["label"] == labels
    assert copy.features["label"].names == parquet.features["label"].names
    streamed = list(sources.load_stream(DataConfig(source=str(prepared_tar), streaming=True,
                                                   train_split=split)))
    assert [row["label"] for row in streamed] == labels
    # the stored bytes themselves: never decoded and encoded again on the way
    assert [row["image"]["bytes"] for row in streamed] == [parquet["image"][row]["bytes"] for row in order]


def test_the_tar_copy_is_written_through_the_command_the_same_bytes_every_time(tmp_path, monkeypatch, capsys):
    args = ["prepare-data", "synthetic", "--max-size", MAX, "--shards", "tar", "--workers", 2, "--json",
            *SIZES]
    digests = []
    for out in ("a", "b"):
        code, stdout, err = run_vit(monkeypatch, capsys, *args, "--out", tmp_path / out)
        assert code == 0, err
        written = json.loads(stdout)
        assert written["shards"] == "tar" and written["splits"]["test"]["rows"] == 16
        digests.append([s["sha256"] for e in written["splits"].values() for s in e["shards"]])
        for entry in written["splits"].values():
            for shard in entry["shards"]:
                file = tmp_path / out / shard["file"]
                assert file.stat().st_size == shard["bytes"]
                assert hashlib.sha256(file.read_bytes()).hexdigest() == shard["sha256"]
    assert digests[0] == digests[1]


def test_a_tar_shard_missing_cut_short_or_miscounted_is_named(prepared_tar, tmp_path):
    """Rows of a tar are vouched for by its size (the manifest's `bytes`), not by reading every
    header."""
    def damaged(name, damage):
        copy = tmp_path / name
        shutil.copytree(prepared_tar, copy)
        damage(copy, _manifest(copy))
        return str(copy)

    def drop(copy, manifest):
        (copy / manifest["splits"]["test"]["shards"][0]["file"]).unlink()

    def cut(copy, manifest):  # inside example 5's image: 5 whole examples before it
        shard = copy / manifest["splits"]["test"]["shards"][0]["file"]
        with tarfile.open(shard) as tar:
            image = tar.getmembers()[2 * 5]
        shard.write_bytes(shard.read_bytes()[:image.offset_data + 100])

    def grow(copy, manifest):
        shard = copy / manifest["splits"]["test"]["shards"][0]["file"]
        shard.write_bytes(shard.read_bytes() + bytes(tarfile.BLOCKSIZE))

    def miscount(copy, manifest):
        manifest["splits"]["test"]["rows"] += 1
        (copy / "manifest.json").write_text(json.dumps(manifest))

    shard = "test-00000-of-00001.tar"
    with pytest.raises(DataError, match=rf"shard .*{shard} listed in manifest.json is missing"):
        sources.load_source(damaged("dropped", drop), "test")
    with pytest.raises(DataError, match=rf"shard {shard} is cut short: 5 examples readable, manifest.json "
                                        r"says 16 \(it ends inside member \d+\.jpg at byte 100\); prepare"):
        sources.load_stream(DataConfig(source=damaged("cut", cut), streaming=True, train_split="test"))
    with pytest.raises(DataError, match=rf"{shard} is \d+ bytes but \d+ in manifest.json; prepare"):
        sources.load_stream(DataConfig(source=damaged("grown", grow), streaming=True, train_split="test"))
    with pytest.raises(DataError, match="split 'test' has 16 rows in its shards but 17"):
        sources.load_source(damaged("miscounted", miscount), "test")


def _png(w, h, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def test_an_image_folder_keeps_aspects_and_names_and_keeps_a_broken_image_as_it_was(tmp_path, monkeypatch,
                                                                                    capsys):
    folder = tmp_path / "folder"
    images = {"cat/a.png": _png(40, 30, 0), "cat/b.png": _png(20, 20, 1), "dog/c.png": _png(30, 50, 2),
              "dog/d.png": b"\x89PNG\r\n\x1a\n not really"}
    for name, data in images.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    out = tmp_path / "out"
    code, stdout, err = run_vit(monkeypatch, capsys, "prepare-data", folder, "--out", out, "--max-size", MAX,
                                "--json")
    assert code == 0, err
    entry = json.loads(stdout)["splits"]["train"]
    assert entry["undecodable"] == 1 and entry["undecodable_images"] == [str(folder / "dog/d.png")]
    code, stdout, err = run_vit(monkeypatch, capsys, "prepare-data", folder, "--out", tmp_path / "out2")
    assert code == 0 and stdout.count(str(folder / "dog/d.png")) == 1, stdout  # the table names it, once
    copy = sources.load_source(str(out), "train").cast_column("image", datasets.Image(decode=False))
    assert copy.features["label"].names == ["cat", "dog"] and copy["label"] == [0, 0, 1, 1]
    sizes = [Image.open(io.BytesIO(img["bytes"])).size for img in copy["image"][:3]]
    assert sizes == [(32, 24), (20, 20), (24, 40)]  # shorter side min(orig, 24), aspect kept; never upscaled
    assert copy["image"][1]["bytes"] == _png(20, 20, 1), "a small image is copied byte for byte"
    assert copy["image"][3]["bytes"] == (folder / "dog/d.png").read_bytes()


def _shard_labels(out):
    """Each shard's labels, in the order its .cls members come."""
    labels = []
    for shard in _manifest(out)["splits"]["train"]["shards"]:
        with tarfile.open(out / shard["file"]) as tar:
            labels.append([int(tar.extractfile(m).read()) for m in tar if m.name.endswith(".cls")])
    return labels


def test_tar_shards_of_a_class_sorted_folder_mix_the_classes_in_a_seeded_order(tmp_path, capsys):
    """An image folder lists its rows class by class; the parquet copy keeps that order (one class a
    shard), the tar copy writes them in the order its seed draws (both classes in every shard), the
    same bytes for the same seed, another order for another."""
    folder = tmp_path / "folder"
    for cls in ("cat", "dog"):
        (folder / cls).mkdir(parents=True)
        for i in range(8):
            (folder / cls / f"{i}.png").write_bytes(_png(8, 8, i + (8 if cls == "dog" else 0)))
    flags = {"data.source": str(folder), "data.train_split": "", "data.val_split": "",
             "data.test_split": ""}
    recipe = resolve("prepare-data", None, [], flags)
    written = {}
    for name, shards, seed in (("parquet", "parquet", 0), ("a", "tar", 0), ("b", "tar", 0), ("c", "tar", 1)):
        options = prepare.Options(max_size=MAX, shard_mb=0.0025, shards=shards, seed=seed)
        written[name] = stage.prepare_data(recipe, tmp_path / name, options=options)
    parquet = [pq_labels(tmp_path / "parquet" / shard["file"])
               for shard in written["parquet"]["splits"]["train"]["shards"]]
    assert len(parquet) > 1 and all(len(set(labels)) == 1 for labels in parquet)
    assert written["a"]["shuffle_seed"] == 0 and written["c"]["shuffle_seed"] == 1
    assert written["parquet"]["shuffle_seed"] is None
    tars = _shard_labels(tmp_path / "a")
    assert len(tars) == len(parquet) and all(set(labels) == {0, 1} for labels in tars)
    assert sorted(x for labels in tars for x in labels) == sorted(x for labels in parquet for x in labels)
    digests = {name: [shard["sha256"] for shard in written[name]["splits"]["train"]["shards"]]
               for name in "abc"}
    assert digests["a"] == digests["b"] and digests["a"] != digests["c"]
    assert _shard_labels(tmp_path / "c") != tars
    assert "(rows shuffled, seed 1)" in " ".join(capsys.readouterr().out.split())


def pq_labels(file):
    return list(datasets.Dataset.from_parquet(str(file))["label"])


def test_a_source_without_file_paths_names_its_undecodable_rows_by_row_and_split(tmp_path):
    images = [{"bytes": b"not an image" if i == 1 else _png(20, 20, i), "path": None} for i in range(3)]
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    train = datasets.Dataset.from_dict({"image": images, "label": [0, 1, 0]}, feats)
    datasets.DatasetDict({"train": train}).save_to_disk(str(tmp_path / "ds"))
    written = prepare_data(str(tmp_path / "ds"), tmp_path / "out", options=prepare.Options(max_size=MAX))
    named = written["splits"]["train"]["undecodable_images"]
    assert named == [f"row 1 of {tmp_path / 'ds'} split 'train'"]


BAD = {
    "missing source": (["./no/such/dir"], "dataset path not found"),
    "unknown split": (["synthetic", "--splits", "train,training"], "no split 'training'"),
    "max-size too small": (["synthetic", "--max-size", "8"], "--max-size 8"),
    "max-size not an int": (["synthetic", "--max-size", "big"], "--max-size"),
    "unknown format": (["synthetic", "--format", "tiff"], "--format tiff"),
    "unknown shards": (["synthetic", "--shards", "zip"], "--shards zip"),
    "not a data key": (["synthetic", "model.depth=2"], "model.depth=2"),
    "a file as --out": (["synthetic"], "is a file"),
    "a Hub id, offline": (["someone/images"], "the Hub is offline"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tmp_path, monkeypatch, capsys):
    args, culprit = BAD[case]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "afile" if case == "a file as --out" else tmp_path / "out"
    if case == "a file as --out":
        out.write_text("mine")
    code, _, err = run_vit(monkeypatch, capsys, "prepare-data", *args, "--out", out, *SIZES)
    assert code == 2 and culprit in err and len(err.strip().splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == (["afile"] if out.name == "afile" else [])


def test_an_existing_copy_is_refused_then_set_aside_by_overwrite(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    args = ["prepare-data", "synthetic", "--out", out, "--max-size", MAX, *SIZES]
    code, stdout, _ = run_vit(monkeypatch, capsys, *args, "--dry-run", "--json")
    assert code == 0 and json.loads(stdout)["splits"]["train"] == {"rows": 64} and not out.exists()
    assert run_vit(monkeypatch, capsys, *args)[0] == 0
    first = _manifest(out)
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 2 and "is not empty" in err and "--overwrite" in err
    assert run_vit(monkeypatch, capsys, *args, "--overwrite", "--format", "png")[0] == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("out.previous-")]
    assert len(aside) == 1 and _manifest(aside[0]) == first
    assert _manifest(out)["format"] == "png" and _manifest(out)["quality"] is None


def test_every_split_by_default_and_the_recipes_split_keys_play_no_part(tmp_path):
    """The built-in data with no validation images: its splits are train and test, and the recipe's
    data.val_split=validation (pretrain's default) is not refused as it would be for training."""
    sizes = ["data.synthetic.train_size=8", "data.synthetic.val_size=0", "data.synthetic.test_size=4"]
    plan = prepare_data("synthetic", tmp_path / "out", overrides=sizes, dry_run=True)
    assert plan["splits"] == {"train": {"rows": 8}, "test": {"rows": 4}} and not (tmp_path / "out").exists()


def test_an_interrupted_copy_leaves_nothing_behind(tmp_path, monkeypatch):
    """Ctrl-C while the second split is written: no DIR, no temporary beside it."""
    real, calls = prepare._write_split, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare, "_write_split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data("synthetic", tmp_path / "out", overrides=SIZES, options=prepare.Options(max_size=MAX))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("copy", "streaming"), [("prepared", ["data.streaming=false"]),
                                               ("prepared", ["data.streaming=true"]),
                                               ("prepared_tar", [])],  # a tar copy streams unasked
                         ids=["parquet-mapped", "parquet-streamed", "tar"])
def test_training_on_the_copy_interrupted_and_resumed_ends_bit_identical(request, tmp_path, monkeypatch,
                                                                         copy, streaming):
    r = resolve("pretrain", None, [
        f"data.source={request.getfixturevalue(copy)}", *streaming, "data.shuffle_buffer=32",
        "data.num_workers=0", "data.val_split=", "data.test_split=", "data.batch_size=16",
        "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "model.dropout=0.1", "schedule.steps=6", "schedule.warmup_steps=1",
        "run.ckpt_every=3", "run.log_every=1", "run.precision=fp32"])
    assert r.data.streaming == (streaming != ["data.streaming=false"])
    one_run(r, tmp_path / "straight")
    stopped_at_call(monkeypatch, r, tmp_path / "resumed", 5)
    assert manager.latest_good_state(tmp_path / "resumed")[1]["step"] == 3
    one_run(r, tmp_path / "resumed")
    a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
