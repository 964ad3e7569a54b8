"""The folder index: a plain image tree gives exactly what HF's imagefolder builder gives for it
(splits, features, rows in order), anything else is left to HF, and the index is kept, reused while
the folder is unchanged and built again when a file is added or removed, its file damaged or its
cache unwritable."""

from __future__ import annotations

import ast
import fnmatch
import io
import os
import threading
import time

import datasets
import pytest
from datasets.data_files import (
    ALL_DEFAULT_PATTERNS,
    DEFAULT_PATTERNS_ALL,
    DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME,
    DEFAULT_PATTERNS_SPLIT_IN_FILENAME,
)
from PIL import Image

from vitcli.data.rows import folder_index, folder_listing, sources
from vitcli.errors import DataError
from vitcli.recipe.schema import DataConfig

_buf = io.BytesIO()
Image.new("RGB", (4, 3), (200, 30, 30)).save(_buf, "JPEG")
JPEG = _buf.getvalue()


def tree(root, files: list[str], settle: bool = False):
    """`files` (relative paths) under `root`, each a small JPEG (a name ending in / is an empty
    directory); `settle` dates every directory an hour back, so the index may be kept (see
    folder_index.SETTLE_NS)."""
    for name in files:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(JPEG)
    if settle:
        settle_dirs(root)
    return root


def settle_dirs(root) -> None:
    past = time.time() - 3600
    for folder, _, _ in os.walk(root):
        os.utime(folder, (past, past))


def rows(ds: datasets.Dataset) -> list[dict]:
    return ds.with_format("arrow")[:].to_pylist()


def hf_splits(root, tmp_path) -> dict[str, datasets.Dataset]:
    return dict(datasets.load_dataset(str(root), cache_dir=str(tmp_path / "hf-cache")))


def assert_same_as_hf(root, tmp_path) -> dict[str, datasets.Dataset]:
    ours, theirs = folder_index.splits(root), hf_splits(root, tmp_path)
    assert ours is not None, "a plain tree was left to HF"
    assert list(ours) == list(theirs)
    for name in theirs:
        assert ours[name].features == theirs[name].features, name
        assert ours[name].data.schema.equals(theirs[name].data.schema), name
        assert rows(ours[name]) == rows(theirs[name]), name
    return ours


PLAIN = {
    "one split": ["cat/0.jpg", "cat/1.png", "dog/0.jpg", "dog/10.jpg", "dog/9.jpg"],
    "train, val, test": ["train/a/0.jpg", "train/b/0.jpg", "val/a/1.jpg", "val/b/1.jpg", "test/c/2.jpg",
                         "test/a/2.jpg"],
    "HF's other split names": ["training/a/0.jpg", "training/b/0.jpg", "dev/a/1.jpg", "eval/b/2.jpg"],
    "names sorted as HF sorts paths": ["a/x.jpg", "a-b/y.jpg", "a_b/z.jpg", "B/w.jpg", "a/X.jpg",
                                       "St. Bernard/1 2.jpg", "éclair/ü.jpg", "a/x (1).jpg"],
    "upper-case suffixes": ["a/x.JPEG", "a/y.PNG", "b/z.JPG", "b/w.jpeg", "b/mixed.Jpg", "b/MiXeD.Png"],
    "other files and hidden ones": ["a/0.jpg", "a/notes.txt", "a/LICENSE", "a/.DS_Store", "a/.1.jpg",
                                    "a/.hidden/2.jpg", "a/__pycache__/3.jpg", "b/0.jpg", "b/labels.csv",
                                    ".git/a/4.jpg", "__MACOSX/a/5.jpg", "b/README.md", "LICENSE"],
    "a class without images, one only in val": ["train/a/0.jpg", "train/b/0.jpg", "train/empty/",
                                                "val/c/0.jpg", "train/c_txt/x.txt"],
}


@pytest.mark.parametrize("files", PLAIN.values(), ids=PLAIN.keys())
def test_a_plain_tree_gives_what_hf_imagefolder_gives(tmp_path, files):
    assert_same_as_hf(tree(tmp_path / "data", files), tmp_path)


def test_links_to_files_count_and_broken_links_do_not_as_for_hf(tmp_path):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg", "elsewhere.jpg"])
    os.rename(root / "elsewhere.jpg", tmp_path / "elsewhere.jpg")
    (root / "a" / "link.jpg").symlink_to(tmp_path / "elsewhere.jpg")
    (root / "b" / "broken.jpg").symlink_to(tmp_path / "gone.jpg")
    ours = assert_same_as_hf(root, tmp_path)
    paths = [r["image"]["path"] for r in rows(ours["train"])]
    assert paths == [str(root / "a/0.jpg"), str(root / "a/link.jpg"), str(root / "b/0.jpg")]


@pytest.mark.parametrize("layout", ["", "train/"])
def test_a_class_directory_that_is_a_broken_link_is_refused_not_left_out(tmp_path, layout):
    """HF's glob sees nothing where the link is: class `b` would vanish and `c` take its label
    id."""
    files = [f"{layout}a/0.jpg", f"{layout}c/0.jpg", *(["val/a/0.jpg"] if layout else [])]
    root = tree(tmp_path / "data", files)
    link, target = root / layout / "b", tmp_path / "unmounted" / "b"
    link.symlink_to(target)
    assert hf_splits(root, tmp_path)["train"].features["label"].names == ["a", "c"]
    with pytest.raises(DataError) as e:
        folder_index.splits(root)
    assert str(e.value) == (f"{link} is a broken link (to {target}): its class would be left out and the "
                            "classes after it renumbered; restore its target, or remove the link")


NOT_PLAIN = {  # each read otherwise by HF: labels dropped, splits from names, metadata columns, ...
    "deeper": ["a/x/0.jpg", "a/x/1.jpg", "b/y/0.jpg"],
    "mixed depths": ["a/0.jpg", "b/0.jpg", "b/c/1.jpg"],
    "an image beside the classes": ["a/0.jpg", "b/0.jpg", "loose.jpg"],
    "one class": ["a/0.jpg", "a/1.jpg"],
    "metadata": ["a/0.jpg", "b/0.jpg", "metadata.csv"],
    "a dataset card": ["a/0.jpg", "b/0.jpg", "README.md"],
    "file names naming a split": ["a/ILSVRC2012_val_00000001.JPEG", "b/x.jpg"],
    "a class named like a split": ["a/0.jpg", "val_2/0.jpg"],
    "split dirs and others": ["train/a/0.jpg", "train/b/0.jpg", "extra/a/0.jpg"],
    "two dirs for one split": ["train/a/0.jpg", "train/b/0.jpg", "val/a/0.jpg", "validation/a/0.jpg"],
    "two suffixes": ["a/x.jpg.txt", "a/y.jpg", "b/z.jpg"],
    "an archive": ["a/0.jpg", "b/0.jpg", "b/more.zip"],
    "more text than images": ["a/0.jpg", "b/0.jpg", "a/1.txt", "a/2.txt", "b/3.txt"],
    "parquet shards": ["data/train-00000-of-00001.parquet"],
    "another layout's file": ["a/0.jpg", "b/0.jpg", "b/run.eval"],
}


@pytest.mark.parametrize("files", NOT_PLAIN.values(), ids=NOT_PLAIN.keys())
def test_anything_else_is_left_to_hf(tmp_path, files, logged):
    assert folder_index.splits(tree(tmp_path / "data", files)) is None
    assert any("not a plain image folder" in m for m in logged), logged


def test_a_link_to_a_directory_is_left_to_hf(tmp_path):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"])
    (root / "c").symlink_to(tree(tmp_path / "other", ["0.jpg"]))
    assert folder_index.splits(root) is None


def test_hf_finds_no_layout_we_do_not_know():
    """HF tries these pattern sets in order; a new one (a release adding a layout) must be handled
    here."""
    known = [DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME, DEFAULT_PATTERNS_SPLIT_IN_FILENAME, DEFAULT_PATTERNS_ALL]
    others = [p for d in ALL_DEFAULT_PATTERNS if d not in known for ps in d.values() for p in ps]
    assert sorted(others) == ["**/*.eval", "**/instruction.md", "**/task.toml"]


def test_the_suffix_tables_are_hfs_own():
    """The index reads no private name of datasets; its tables are HF's private ones, rebuilt from
    the public builders (a release adding a builder or a suffix fails here, not in a silent
    mismatch)."""
    from datasets.packaged_modules import _ALL_ALLOWED_EXTENSIONS, _MODULE_TO_EXTENSIONS

    assert folder_listing._DATA_SUFFIXES == frozenset(_ALL_ALLOWED_EXTENSIONS)
    assert sorted(folder_listing._IMAGEFOLDER_SUFFIXES) == sorted(_MODULE_TO_EXTENSIONS["imagefolder"])
    for module in (folder_listing, folder_index):
        with open(module.__file__) as f:
            tree_ = ast.parse(f.read())
        imported = [(node.module or "").split(".") + [a.name for a in node.names]
                    for node in ast.walk(tree_) if isinstance(node, ast.ImportFrom)]
        imported = [names for names in imported if names[0] != "__future__"]
        assert not [names for names in imported if any(n.startswith("_") for n in names)], module
        attributes = [node.attr for node in ast.walk(tree_) if isinstance(node, ast.Attribute)]
        assert not [a for a in attributes if a.startswith("_") and not a.startswith("__")], module


NAMES = ["train", "Train", "train_1", "train-x", "my_train", "my_train_2", "trainee", "retrain", "x_val",
         "val", "valid", "validation", "x.val.y", "dev", "devices", "a dev b", "test", "testing", "tests",
         "eval", "evaluation", "n01440764", "ILSVRC2012_val_00000001", "1val", "val1", "x-eval-", "training0"]


@pytest.mark.parametrize("name", NAMES)
def test_split_names_are_recognised_as_hf_patterns_match_them(name):
    dir_patterns = [p.removeprefix("**/").removesuffix("/**")
                    for ps in DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME.values() for p in ps]
    file_patterns = [p.removeprefix("**/") for ps in DEFAULT_PATTERNS_SPLIT_IN_FILENAME.values() for p in ps]
    as_dir = any(fnmatch.fnmatchcase(name, p) for p in dir_patterns)
    assert bool(folder_listing._SPLIT_IN_DIR_NAME.search(name)) == as_dir
    as_file = any(fnmatch.fnmatchcase(name, p) for p in file_patterns)
    assert any(folder_listing._keyword_at(f"/{name}/", w) for w in folder_listing._SPLIT_WORDS) == as_file


# ---------------------------------------------------------------- the cache


def test_the_index_lives_in_the_cache_not_in_the_folder(tmp_path, monkeypatch):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"], settle=True)
    monkeypatch.setenv("VITCLI_CACHE", str(tmp_path / "mine"))
    assert folder_index.index_file(root).parent == tmp_path / "mine" / "folder-index"
    monkeypatch.delenv("VITCLI_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert folder_index.cache_dir() == tmp_path / "xdg" / "vitcli"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert folder_index.cache_dir() == tmp_path / "home" / ".cache" / "vitcli"
    monkeypatch.setenv("VITCLI_CACHE", str(tmp_path / "mine"))
    before = sorted(p.name for p in root.rglob("*"))
    folder_index.splits(root)
    assert folder_index.index_file(root).is_file() and sorted(p.name for p in root.rglob("*")) == before
    other = tree(tmp_path / "other", ["a/0.jpg", "b/0.jpg"], settle=True)
    assert folder_index.index_file(other) != folder_index.index_file(root)
    assert folder_index.splits(other)["train"][0]["image"].size == (4, 3)
    assert folder_index.index_file(other).is_file()


def scans(monkeypatch) -> list:
    """Every folder_index.scan call, recorded (the scan itself still runs)."""
    calls, scan = [], folder_index.scan
    monkeypatch.setattr(folder_index, "scan", lambda root: calls.append(root) or scan(root))
    return calls


def test_a_second_start_reuses_the_index_without_listing_the_folder(tmp_path, monkeypatch, logged):
    root = tree(tmp_path / "data", ["train/a/0.jpg", "train/b/0.jpg", "val/a/1.jpg"], settle=True)
    calls = scans(monkeypatch)
    first = folder_index.splits(root)
    assert len(calls) == 1 and any("built in" in m and "kept in" in m for m in logged), logged
    again = folder_index.splits(root)
    assert len(calls) == 1, "the folder was listed again"
    assert {k: rows(v) for k, v in again.items()} == {k: rows(v) for k, v in first.items()}
    assert again["train"].cache_files, "the index is read memory-mapped from its file"
    assert again["train"]._fingerprint == first["train"]._fingerprint


@pytest.mark.parametrize("change", ["add", "remove", "add a class", "rename"])
def test_adding_or_removing_a_file_builds_it_again(tmp_path, monkeypatch, change, logged):
    root = tree(tmp_path / "data", ["a/0.jpg", "a/1.jpg", "b/0.jpg"], settle=True)
    folder_index.splits(root)
    calls = scans(monkeypatch)
    if change == "add":
        tree(root, ["b/new.jpg"])
    elif change == "remove":
        (root / "a" / "1.jpg").unlink()
    elif change == "add a class":
        tree(root, ["c/0.jpg"])
    else:
        (root / "a" / "1.jpg").rename(root / "a" / "2.jpg")
    assert_same_as_hf(root, tmp_path)
    assert len(calls) == 1 and any("changed since" in m for m in logged), logged


def test_a_start_beside_one_building_the_index_waits_for_it_and_reuses_it(tmp_path, monkeypatch):
    """Ranks (or runs) starting together: the one holding the index's lock builds it, the others
    wait."""
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"], settle=True)
    calls, path = scans(monkeypatch), folder_index.index_file(root)
    holding, built = threading.Event(), []

    def other_rank():
        with folder_index.exclusive(path.with_suffix(".lock")):
            holding.set()
            time.sleep(0.5)  # without the lock, the start below would find no index and list the folder too
            built.append(folder_index.build(root, path))

    thread = threading.Thread(target=other_rank)
    thread.start()
    holding.wait()
    ours = folder_index.splits(root)
    thread.join()
    assert len(calls) == 1 and built[0] and rows(ours["train"]) == rows(built[0]["train"])


def test_an_index_of_a_folder_changed_just_now_is_used_but_not_kept(tmp_path, logged):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"])  # mtimes: now
    assert len(folder_index.splits(root)["train"]) == 2
    assert not folder_index.index_file(root).exists()
    assert any("not kept" in m for m in logged), logged


def test_a_damaged_index_is_built_again(tmp_path, monkeypatch, logged):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"], settle=True)
    folder_index.splits(root)
    path = folder_index.index_file(root)
    for damage in (path.read_bytes()[: path.stat().st_size // 2], b"not arrow at all"):
        path.write_bytes(damage)
        calls = scans(monkeypatch)
        assert [r["label"] for r in rows(folder_index.splits(root)["train"])] == [0, 1]
        assert len(calls) == 1 and any("damaged" in m for m in logged), logged
        assert folder_index.splits(root) and len(calls) == 1, "the rebuilt index is kept"


def test_an_unwritable_cache_keeps_the_index_in_memory_with_a_warning(tmp_path, monkeypatch, logged):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"], settle=True)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("VITCLI_CACHE", str(blocked))
    assert len(folder_index.splits(root)["train"]) == 2
    assert any(m.startswith("[yellow]warning: cannot write the folder index") for m in logged), logged


def test_another_datasets_release_builds_it_again(tmp_path, monkeypatch):
    root = tree(tmp_path / "data", ["a/0.jpg", "b/0.jpg"], settle=True)
    folder_index.splits(root)
    calls = scans(monkeypatch)
    monkeypatch.setattr(datasets, "__version__", "0.0.1")
    folder_index.splits(root)
    assert len(calls) == 1


# ---------------------------------------------------------------- through sources


def test_sources_read_a_plain_folder_through_its_index_sliced_and_streamed(tmp_path, monkeypatch):
    files = [f"train/{c}/{i}.jpg" for c in "abc" for i in range(10)] + ["val/a/0.jpg", "val/b/0.jpg"]
    root = tree(tmp_path / "data", files, settle=True)
    calls = scans(monkeypatch)
    cfg = DataConfig(source=str(root))
    theirs = hf_splits(root, tmp_path)
    assert rows(sources.load_split(cfg, "train[:10%]")) == rows(theirs["train"])[:3]
    assert rows(sources.load_split(cfg, "train[-5:]+validation")) == rows(theirs["train"])[-5:] + rows(
        theirs["validation"])
    assert sources.available_splits(str(root), cfg.synthetic) == ["train", "validation"]
    streamed = sources.load_stream(cfg)
    assert streamed.num_shards == min(sources.STREAM_SHARDS, 30)
    assert sorted(r["image"]["path"] for r in streamed) == [r["image"]["path"] for r in rows(theirs["train"])]
    assert len(calls) == 1, "every call after the first reused the index"
