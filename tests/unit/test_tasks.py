"""The task registry: VTAB-1k's 19 tasks and their split slices, spec parsing, and derived-label
rules."""

import math

import numpy as np
import pytest
from datasets import ClassLabel, Dataset
from datasets.arrow_reader import ReadInstruction

from vitcli.data.rows import tasks
from vitcli.errors import DataError

# TFDS train-split sizes and task_adaptation's train percentages: val200 starts where its "train"
# ends.
TFDS_TRAIN = {"caltech101": (3060, 90), "cifar100": (50000, 90), "pets": (3680, 80), "svhn": (73257, 90),
              "eurosat": (27000, 60), "resisc45": (31500, 60), "clevr_count": (70000, 90),
              "clevr_dist": (70000, 90), "dsprites_loc": (737280, 80), "dsprites_ori": (737280, 80)}


def test_vtab_has_19_tasks_in_groups_of_7_4_8():
    assert len(tasks.VTAB) == 19
    counts = {g: sum(t.group == g for t in tasks.VTAB) for g in tasks.GROUPS}
    assert counts == {"natural": 7, "specialized": 4, "structured": 8}


def test_vtab_splits_are_vtab_1k_slices():
    for task in tasks.VTAB:
        s = task.splits
        assert s["train800"] == "train[:800]"
        assert s["train800val200"] == f"{s['train800']}+{s['val200']}"
        assert task.train_split == s["train800val200"]
        for spec in s.values():
            ReadInstruction.from_spec(spec)  # valid HF split syntax


@pytest.mark.parametrize("name", sorted(TFDS_TRAIN))
def test_val200_starts_where_task_adaptation_train_ends(name):
    total, percent = TFDS_TRAIN[name]
    start = percent * total // 100
    assert tasks.REGISTRY[f"vtab/{name}"].splits["val200"] == f"train[{start}:{start + 200}]"


def test_held_out_test_slices_of_train_only_datasets():
    for name, (total, percent) in TFDS_TRAIN.items():
        if name in ("eurosat", "resisc45", "dsprites_loc", "dsprites_ori"):  # test = after train + val
            val_percent = 20 if name in ("eurosat", "resisc45") else 10
            start = percent * total // 100 + val_percent * total // 100
            assert tasks.REGISTRY[f"vtab/{name}"].test_split == f"train[{start}:]"


def test_every_named_rule_exists_and_standard_sets_match_big_vision():
    assert all(t.label_rule in tasks.LABEL_RULES for t in tasks.REGISTRY.values() if t.label_rule)
    assert [t.name for t in tasks.STANDARD] == [
        "imagenet", "cifar10", "cifar100", "pets", "flowers102", "caltech101", "dtd", "cars196", "uc_merced"]
    assert tasks.REGISTRY["imagenet"].splits == {"train": "train[:65000]", "test": "validation"}
    assert tasks.REGISTRY["uc_merced"].splits == {"train": "train[:1000]", "test": "train[1000:]"}


def test_get_tasks_parses_groups_lists_and_dedupes():
    assert len(tasks.get_tasks("vtab")) == 19
    assert [t.group for t in tasks.get_tasks("vtab/structured")] == ["structured"] * 8
    assert [t.name for t in tasks.get_tasks("vtab/dtd, vtab/cifar100")] == ["vtab/dtd", "vtab/cifar100"]
    natural = tasks.get_tasks("vtab/dtd,vtab/natural")
    assert len(natural) == 7 and natural[0].name == "vtab/dtd"
    assert len(tasks.get_tasks("standard,cifar10")) == 9
    mine = tasks.Task("mine", "custom", 3, "some/dataset", {"train": "train", "test": "test"})
    assert tasks.get_tasks("mine,cifar10", custom={"mine": mine}) == [mine, tasks.REGISTRY["cifar10"]]


def test_unknown_task_suggests_the_closest_name():
    with pytest.raises(DataError, match="unknown task 'vtab/cifar10O'; did you mean 'vtab/cifar100'"):
        tasks.get_tasks("vtab/cifar10O")
    with pytest.raises(DataError, match="no few-shot tasks"):
        tasks.get_tasks(" , ")


def test_task_source_is_the_hub_id_without_a_data_root_and_synthetic_stays_built_in(tmp_path):
    task = tasks.REGISTRY["vtab/clevr_count"]
    assert tasks.task_source(task, "") == "dpdl-benchmark/clevr"
    synth = tasks.synthetic_task(num_classes=4)
    assert tasks.task_source(synth, str(tmp_path)) == "synthetic"
    assert (synth.num_classes, synth.train_split, synth.test_split) == (4, "train", "test")


@pytest.mark.parametrize("layout", ["clevr_count", "clevr", "vtab/clevr_count"])
def test_data_root_reads_the_task_dir_then_its_dataset_then_the_older_layout(tmp_path, layout):
    task = tasks.REGISTRY["vtab/clevr_count"]
    (tmp_path / layout).mkdir(parents=True)
    assert tasks.task_source(task, str(tmp_path)) == str(tmp_path / layout)
    (tmp_path / "clevr_count").mkdir(exist_ok=True)
    assert tasks.task_source(task, str(tmp_path)) == str(tmp_path / "clevr_count"), "the task's own dir first"


def test_a_task_missing_from_the_data_root_names_every_path_tried(tmp_path):
    tried = [tmp_path / "dsprites_ori", tmp_path / "dsprites", tmp_path / "vtab" / "dsprites_ori"]
    assert tasks.task_dirs(tasks.REGISTRY["vtab/dsprites_ori"], str(tmp_path)) == [str(p) for p in tried]
    with pytest.raises(DataError) as info:
        tasks.task_source(tasks.REGISTRY["vtab/dsprites_ori"], str(tmp_path))
    assert "vtab/dsprites_ori" in str(info.value) and all(str(p) in str(info.value) for p in tried)
    assert tasks.task_dirs(tasks.REGISTRY["cifar10"], "/d") == ["/d/cifar10"]  # standard sets: DIR/<name>


def _bucket_reference(value, thresholds):
    """task_adaptation's max(where(thrs < value)), via searchsorted on the sorted thresholds."""
    return int(np.searchsorted(thresholds, value, side="left")) - 1


def test_clevr_rules():
    for n in (3, 6, 10):
        assert tasks.clevr_count({"objects": {"size": [1] * n}}) == n - 3
    thresholds = [0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0]
    for depth in (0.5, 8.0, 8.01, 9.2, 9.5, 10.0, 42.0):
        coords = [[1.0, 2.0, depth + 3.0], [4.0, 5.0, depth]]  # the closer object decides
        expected = _bucket_reference(depth, thresholds)
        assert tasks.clevr_distance({"objects": {"pixel_coords": coords}}) == expected
        as_list = {"objects": [{"pixel_coords": c} for c in coords]}  # list-of-dicts layout
        assert tasks.clevr_distance(as_list) == expected


def test_kitti_closest_vehicle_rule():
    thresholds = [-100.0, 8.0, 20.0, 999.0]
    def example(types, depths):
        return {"objects": {"type": types, "location": [[0.0, 1.0, z] for z in depths]}}
    assert tasks.kitti_closest_vehicle(example([3, 5], [2.0, 4.0])) == 3  # pedestrians only: "no vehicle"
    for depth in (5.0, 8.0, 12.0, 20.0, 60.0):
        expected = _bucket_reference(depth, thresholds)
        assert tasks.kitti_closest_vehicle(example([3, 2, 0], [1.0, depth, depth + 5])) == expected
        assert tasks.kitti_closest_vehicle(example(["Pedestrian", "Van"], [1.0, depth])) == expected


def test_dsprites_rules_group_into_16_bins():
    for value in range(32):
        assert tasks.dsprites_location({"label_x_position": value}) == math.floor(value / (32 / 16))
    for value in range(40):
        assert tasks.dsprites_orientation({"label_orientation": value}) == math.floor(value / (40 / 16))


def test_apply_label_rule_derives_renames_and_checks_range():
    ds = Dataset.from_dict({"objects": [{"size": [0] * 3}, {"size": [0] * 10}], "label": [9, 9]})
    out = tasks.apply_label_rule(tasks.REGISTRY["vtab/clevr_count"], ds)
    assert out["label"][:] == [0, 7] and out.features["label"] == ClassLabel(num_classes=8)
    norb = Dataset.from_dict({"label_azimuth": [0, 17], "label_elevation": [8, 1]})
    out = tasks.apply_label_rule(tasks.REGISTRY["vtab/smallnorb_ele"], norb)
    assert out["label"][:] == [8, 1] and out.features["label"].num_classes == 9
    with pytest.raises(DataError, match="labels span 0..17, outside the task's 9 classes"):
        tasks.apply_label_rule(tasks.REGISTRY["vtab/smallnorb_ele"],
                               Dataset.from_dict({"label_elevation": [0, 17]}))
    with pytest.raises(DataError, match="needs column"):
        tasks.apply_label_rule(tasks.REGISTRY["vtab/dsprites_loc"], norb)
