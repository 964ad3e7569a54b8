"""Data a user points `vit pretrain` at that cannot give what the recipe asks: each is one line,
exit 2, and nothing written, before the run starts (at resolve time, in --dry-run too, where the
recipe and a look at the data's directories tell)."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from helpers import REPO, run_vit
from vitcli.data.rows import tar_shards

QUICK = REPO / "recipes/quickstart/pretrain.yaml"
SHORT = ["schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1", "data.batch_size=4",
         "model.embed_dim=32", "model.depth=1", "model.num_heads=2", "model.mlp_dim=64"]


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), seed * 10 % 256, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _pretrain(monkeypatch, capsys, tmp_path, *args, dry_run=False):
    """`vit pretrain` on the quickstart recipe, shortened; (code, stderr). Asserts nothing was
    written."""
    work = tmp_path / "work"
    flags = ["--dry-run"] if dry_run else ["--workdir", work]
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "-r", QUICK, *flags, *SHORT, *args)
    assert not work.exists(), list(work.iterdir())
    return code, err


def _one_line(code: int, err: str, *needles: str) -> None:
    """Exit 2 and one error line holding every needle (what the load logged before it may precede
    it)."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and err.strip().endswith(errors[0]), err
    for needle in needles:
        assert needle in errors[0], err


def _folder(root, splits=("train", "val")):
    for split in splits:
        for k, cls in enumerate(("cat", "dog")):
            (root / split / cls).mkdir(parents=True)
            for i in range(4):
                (root / split / cls / f"{i}.png").write_bytes(_png(k * 4 + i))
    return root


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_test_split_the_image_folder_lacks_is_refused_before_start_up(tmp_path, monkeypatch, capsys,
                                                                         dry_run):
    src = _folder(tmp_path / "imagenet")
    code, err = _pretrain(monkeypatch, capsys, tmp_path, f"data.source={src}", dry_run=dry_run)
    _one_line(code, err, "data.test_split='test'", "has no split 'test' (it has train, validation)",
              'data.test_split=""')


def test_a_split_a_prepared_tar_copy_lacks_is_refused_from_its_manifest(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "train-00000-of-00001.tar").write_bytes(b"")  # never opened: the manifest tells
    manifest = {"kind": "vitcli prepare-data", "shards": "tar", "splits": {"train": {}, "validation": {}}}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, err = _pretrain(monkeypatch, capsys, tmp_path, f"data.source={copy}", dry_run=True)
    _one_line(code, err, "data.test_split='test'", "no split 'test' (it has train, validation)")


def test_a_tar_shard_cut_short_is_named_with_what_it_holds_and_nothing_trains(tmp_path, monkeypatch, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        examples = ((f"{k}{i:05d}", _png(i), i % 2) for i in range(16))
        tar_shards.write_shard(shards / f"shard-{k:05d}.tar", examples, "png")
    cut = shards / "shard-00001.tar"
    with tarfile.open(cut) as tar:
        image = tar.getmembers()[2 * 9]  # example 9's image: 9 whole examples before it
    cut.write_bytes(cut.read_bytes()[:image.offset_data + image.size // 2])
    code, err = _pretrain(monkeypatch, capsys, tmp_path, f"data.source={shards}/shard-{{00000..00001}}.tar",
                          "data.val_split=", "data.test_split=")
    _one_line(code, err, f"shard-00001.tar is cut short: 9 examples readable, then it ends inside member "
                         f"{image.name} at byte {image.size // 2}")


def test_an_image_folder_without_images_says_so_not_what_hf_made_of_a_csv(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "photos"
    for name in ("cat/a.heic", "dog/b.heic"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"not a format HF reads")
    (folder / "notes.csv").write_text("a,b\n1,2\n")
    code, err = _pretrain(monkeypatch, capsys, tmp_path, f"data.source={folder}", "data.val_split=",
                          "data.test_split=")
    _one_line(code, err, f"no image files found under {folder}", "looked for .jpg, .jpeg, .png",
              "found instead: 2 .heic, 1 .csv")
    assert "columns: a, b" not in err


def test_a_class_directory_that_is_a_broken_link_is_named(tmp_path, monkeypatch, capsys):
    src = _folder(tmp_path / "imagenet")
    (src / "train" / "bird").symlink_to(tmp_path / "unmounted")
    code, err = _pretrain(monkeypatch, capsys, tmp_path, f"data.source={src}", "data.test_split=")
    _one_line(code, err, f"{src / 'train' / 'bird'} is a broken link")
