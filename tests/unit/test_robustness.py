"""ImageNet's label spaces and robustness sets: the A/R subsets and names are timm's files (read
here independently, as plain text), folder names map to the head's classes (V2's '10' is class 10,
not the label its alphabetical place gives), logits cut to a subset arg-max as masked ones do, and a
set is recognised, refused or left alone as the docs say."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import timm.data
import torch

from vitcli.data.rows import imagenet
from vitcli.errors import DataError
from vitcli.evaluators import robustness

INFO = Path(timm.data.__file__).parent / "_info"


def lines(name: str) -> list[str]:
    return (INFO / name).read_text().split()


SYNSETS = lines("imagenet_synsets.txt")


@pytest.mark.parametrize("name", ["imagenet-a", "imagenet-r"])
def test_the_200_class_subsets_are_timms_indices_and_synsets(name):
    letter = name[-1]
    classes = imagenet.subset_classes(name)
    assert classes.tolist() == [int(i) for i in lines(f"imagenet_{letter}_indices.txt")]
    assert len(classes) == 200 and np.all(np.diff(classes) > 0)
    assert [SYNSETS[i] for i in classes] == lines(f"imagenet_{letter}_synsets.txt")
    assert robustness.subset(name).tolist() == classes.tolist()


def test_sets_scored_over_all_classes_keep_all_1000():
    for name in ("imagenet", "imagenet-v2", "imagenet-sketch"):
        assert robustness.subset(name).tolist() == list(range(1000))


def test_head_names_are_timms_lemmas_for_imagenet_widths_only():
    with open(INFO / "imagenet_synset_to_lemma.txt") as f:
        lemma = dict(csv.reader(f, delimiter="\t"))
    names, space = imagenet.head_names(1000)
    assert space == "imagenet-1k" and names == [lemma[s] for s in SYNSETS]
    assert names[281] == "tabby, tabby cat"
    goog, space = imagenet.head_names(21843)  # Google's ImageNet-21k heads
    assert space == "imagenet-21k-goog" and goog == [lemma[s] for s in lines("imagenet21k_goog_synsets.txt")]
    assert imagenet.head_names(10) is None and imagenet.head_names(999) is None


def test_real_file_is_timms_copy():
    real = json.loads(imagenet.REAL_FILE.read_text())
    assert len(real) == 50000 and real[1] == [970, 795]


def test_index_folders_map_by_number_not_by_their_alphabetical_place():
    names = sorted(["2", "10", "1", "999", "0"])  # as an image folder numbers them: 0, 1, 10, 2, 999
    classes, how = robustness.folder_classes(names)
    assert classes.tolist() == [0, 1, 10, 2, 999] and how == "class-index folder names"
    assert robustness.folder_classes(["1000"]) is None  # past the head
    assert robustness.folder_classes(["01"]) is None  # not how V2 writes an index
    assert robustness.folder_classes(["cat", "dog"]) is None


def test_synset_folders_map_through_timms_order():
    names = [SYNSETS[5], SYNSETS[281], SYNSETS[0]]
    classes, how = robustness.folder_classes(names)
    assert classes.tolist() == [5, 281, 0] and how == "synset folder names"
    assert robustness.folder_classes(["n00004475"]) is None  # a 21k synset, not one of the 1000


def test_a_set_is_recognised_by_exactly_its_200_synsets():
    for name in ("imagenet-a", "imagenet-r"):
        listed = lines(f"imagenet_{name[-1]}_synsets.txt")
        assert robustness.recognise(listed) == name
        assert robustness.recognise(listed[:5]) == "imagenet"  # a few of its folders: any ImageNet folder
    assert robustness.recognise([str(i) for i in range(1000)]) == "imagenet"
    assert robustness.recognise(["cat", "dog"]) is None and robustness.recognise(None) is None


def r_names(k: int) -> list[str]:
    return [SYNSETS[int(i)] for i in lines("imagenet_r_indices.txt")[:k]]


def test_detect_refuses_a_head_of_another_width_and_leaves_other_data_alone():
    full_r = r_names(200)
    with pytest.raises(DataError, match="ImageNet-R .its 200 class folders are ImageNet-R's.*has 10 classes"):
        robustness.detect(full_r, 199, 10, None, None, "c.safetensors")
    with pytest.raises(DataError, match="split is ImageNet-A, scored with an ImageNet-1k head.*has 3 "):
        robustness.detect(r_names(3), 2, 3, None, "imagenet-a", "c")
    assert robustness.detect(r_names(10), 9, 10, None, None, "c") is None  # Imagenette-like: its own head
    assert robustness.detect(full_r, 199, 200, full_r, None, "c") is None  # trained on these very folders
    assert robustness.detect(["cat", "dog"], 1, 1000, None, None, "c") is None
    with pytest.raises(DataError, match="class folder 'n01440764' is not one of ImageNet-R's 200 classes"):
        robustness.detect([SYNSETS[0]], 0, 1000, None, "imagenet-r", "c")  # tench is not in R


def test_scoring_an_r_folder_targets_its_classes_among_the_200():
    names = r_names(200)[3:7]
    s = robustness.detect(names, 3, 1000, None, "imagenet-r", "c")
    assert s.name == "imagenet-r" and s.labels_by == "synset folder names"
    assert s.columns[s.targets].tolist() == [SYNSETS.index(n) for n in names]
    order = robustness.scoring("imagenet-r", None, 199)  # plain labels 0..199: the i-th of R's classes
    assert order.labels_by == "label order" and order.targets.tolist() == list(range(200))
    with pytest.raises(DataError, match="neither WordNet synset folders"):
        robustness.scoring("imagenet-r", ["cat", "dog"], 1)


def test_restricted_logits_arg_max_as_masked_logits_do():
    """The kept columns' top-k, mapped back, are the top-k of the logits with every other class at
    -inf."""
    rng = np.random.default_rng(0)
    names = r_names(200)
    s = robustness.detect(names, 199, 1000, None, None, "c")
    logits = rng.normal(size=(16, 1000)).astype(np.float32)
    logits[:, 0] = 100  # the unmasked arg-max, outside R
    y = rng.integers(0, 200, 16)
    cut, targets = s.restrict(torch.from_numpy(logits), torch.from_numpy(y))
    masked = np.full_like(logits, -np.inf)
    masked[:, s.columns] = logits[:, s.columns]
    top = s.columns[cut.topk(5, dim=-1).indices.numpy()]
    assert top.tolist() == np.argsort(-masked, axis=1)[:, :5].tolist()
    assert s.columns[targets.numpy()].tolist() == [SYNSETS.index(names[i]) for i in y]


def test_find_sets_lists_the_known_folders_and_refuses_a_root_without_any(tmp_path):
    for folder in ("imagenet-r", "sketch", "imagenetv2-top-images-format-val", "other"):
        (tmp_path / "root" / folder).mkdir(parents=True)
    found = robustness.find_sets(tmp_path / "root")
    assert [(name, path.name) for name, path in found] == [
        ("imagenet-v2", "imagenetv2-top-images-format-val"), ("imagenet-r", "imagenet-r"),
        ("imagenet-sketch", "sketch")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="none of the folders imagenet, imagenet-val, val, imagenet-v2"):
        robustness.find_sets(tmp_path / "empty")
    with pytest.raises(DataError, match="not a directory"):
        robustness.find_sets(tmp_path / "nope")
