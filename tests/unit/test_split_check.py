"""The split keys checked at resolve time: what data_checks.source_splits says a source has, from a
file or a listing or two, is what loading it finds (sources.available_splits); where it cannot tell
cheaply it says nothing, and the load decides."""

from __future__ import annotations

import io
import json

import datasets
import datasets.data_files
import numpy as np
import pytest
from PIL import Image

from vitcli.data.rows import sources
from vitcli.errors import DataError
from vitcli.recipe import data_checks
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import SyntheticConfig

STEPS = ["schedule.steps=10", "schedule.warmup_steps=1", "data.batch_size=2"]


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), seed * 20, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _folder(root, splits=("train", "val"), classes=("cat", "dog")):
    for split in splits:
        for k, cls in enumerate(classes):
            (root / split / cls).mkdir(parents=True)
            (root / split / cls / f"{k}.png").write_bytes(_png(k))
    return root


def test_the_split_words_are_hfs():
    assert data_checks.SPLIT_DIRS == {str(k): tuple(v) for k, v in datasets.data_files.SPLIT_KEYWORDS.items()}
    assert data_checks._SEP == f"[{datasets.data_files.NON_WORDS_CHARS}]"


def _saved(root):
    rows = datasets.Dataset.from_dict({"image": [{"bytes": _png(0), "path": None}] * 2, "label": [0, 1]})
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(root / "saved"))
    rows.save_to_disk(str(root / "lone"))
    rows.to_parquet(str(root / "rows.parquet"))
    return {"saved": ["train", "test"], "lone": ["train"], "rows.parquet": ["train"]}


def test_what_it_says_is_what_loading_finds(tmp_path):
    expected = {"imagenet": ["train", "validation"], "three": ["train", "validation", "test"],
                **_saved(tmp_path)}
    _folder(tmp_path / "imagenet")
    _folder(tmp_path / "three", splits=("training", "dev", "test"))
    for name, splits in expected.items():
        source = str(tmp_path / name)
        loaded = sources.available_splits(source, SyntheticConfig())
        assert data_checks.source_splits(source) == splits == loaded
    assert data_checks.source_splits(str(tmp_path / "*.parquet")) == ["train"]


def test_where_it_cannot_tell_cheaply_it_says_nothing(tmp_path):
    _folder(tmp_path / "classes", splits=("",))  # one split of classes: a file may name another
    _folder(tmp_path / "odd", classes=("cat", "test_tube"))  # HF reads test_tube/ as a split of its own
    _folder(tmp_path / "carded")
    (tmp_path / "carded" / "README.md").write_text("---\nconfigs: []\n---\n")
    _folder(tmp_path / "mixed", splits=("train", "extra"))
    for name in ("classes", "odd", "carded", "mixed", "missing"):
        assert data_checks.source_splits(str(tmp_path / name)) is None, name
    assert data_checks.source_splits("someone/dataset") is None
    odd = sources.available_splits(str(tmp_path / "odd"), SyntheticConfig())
    assert odd == ["train", "validation", "test"]


def test_a_prepared_copy_answers_from_its_manifest(tmp_path):
    manifest = {"kind": data_checks.PREPARED_KIND, "splits": {"train": {}, "validation": {}}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert data_checks.source_splits(str(tmp_path)) == ["train", "validation"]
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "kind": "another tool"}))
    assert data_checks.source_splits(str(tmp_path)) is None


HAS = "{key}='test': {src} has no split 'test' (it has train, validation); name one of those"
SKIPS = {"data.val_split": ', or data.val_split="" skips the evaluations while training',
         "data.test_split": ', or data.test_split="" skips the final evaluation', "data.train_split": ""}


@pytest.mark.parametrize("key", SKIPS)
def test_a_training_recipe_naming_a_split_the_folder_lacks_is_refused_at_resolve_time(tmp_path, key):
    src = _folder(tmp_path / "imagenet")
    overrides = [*STEPS, f"data.source={src}", "data.test_split=", f"{key}=test"]
    with pytest.raises(DataError) as e:
        resolve("pretrain", None, overrides)
    assert str(e.value) == HAS.format(key=key, src=src) + SKIPS[key]
    resolve("pretrain", None, [*STEPS, f"data.source={src}", "data.test_split="])
    resolve("prepare-data", None, [f"data.source={src}"])  # a stage that trains reads them; this one not
