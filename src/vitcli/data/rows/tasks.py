"""Few-shot task registry: the 19 VTAB-1k tasks and the ViT paper's standard few-shot sets, as data.

VTAB splits follow task_adaptation (`task_adaptation/data/*.py`): train800 is the first 800 of the
task's "train" split and val200 the first 200 of its "val" split, where val is TFDS `validation` if
the dataset has one, else a slice of TFDS `train` starting where the task's train ends (90% of TFDS
train for Caltech, CIFAR, SVHN, CLEVR; 80% for Pets; 60/20/20 train/val/test for EuroSAT, RESISC45;
80/10/10 for dSprites), or `test[:200]` for smallNORB. Those offsets assume TFDS example order, so
sources are TFDS mirrors. The standard sets use big_vision's `configs/common_fewshot.py` train/test
splits.

dSprites is stored as 0/1 pixels; task_adaptation (`data/dsprites.py`) multiplies them by 255, so
those two tasks say `binary_pixels` and the batch streams stretch such images to 0/255
(decode.stretch_binary). No other VTAB source is rescaled there (smallNORB is only tiled to 3
channels, as to_rgb does).

With a data root, a task reads a local copy (task_source): ROOT/<name less `vtab/`> (ROOT/svhn),
else ROOT/<the source's dataset name> (ROOT/clevr for both CLEVR tasks, ROOT/svhn_cropped), else
ROOT/vtab/<name>.

Hub ids were checked against their Hub pages (split names and sizes match TFDS) except those marked
UNVERIFIED, which follow the same owner's naming but were not seen. smallNORB's `label_azimuth` /
`label_elevation` columns assume the TFDS feature names in that mirror (UNVERIFIED).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

import numpy as np
from datasets import ClassLabel

from vitcli.errors import DataError

GROUPS = ("natural", "specialized", "structured")


@dataclass(frozen=True)
class Task:
    """One few-shot task: where its images and labels come from and which slices are train and
    test."""

    name: str  # vtab/cifar100, cifar10, imagenet, ...
    group: str  # natural | specialized | structured (VTAB) | standard | synthetic | custom
    num_classes: int
    source: str  # Hugging Face dataset id, or "synthetic"
    splits: dict[str, str] = field(default_factory=dict)  # role -> HF split string
    image_column: str = "image"
    label_column: str = "label"
    label_rule: str = ""  # name of a rule in LABEL_RULES deriving the label from raw columns
    binary_pixels: bool = False  # images stored as 0/1 (dSprites): stretched to 0/255 when decoded

    def __hash__(self) -> int:  # names are unique; the splits dict is not hashable
        return hash(self.name)

    @property
    def train_split(self) -> str:
        """The split the shots are drawn from: `train`, else VTAB-1k's 1000 examples."""
        return self.splits.get("train") or self.splits["train800val200"]

    @property
    def test_split(self) -> str:
        """The split accuracy is measured on."""
        return self.splits["test"]


def _vtab_splits(val: str, test: str = "test") -> dict[str, str]:
    return {"train800": "train[:800]", "val200": val, "train800val200": f"train[:800]+{val}", "test": test}


def _vtab(name, group, num_classes, source, val, test="test", **columns) -> Task:
    return Task(f"vtab/{name}", group, num_classes, source, _vtab_splits(val, test), **columns)


_VAL = "validation[:200]"
VTAB = [
    # UNVERIFIED
    _vtab("caltech101", "natural", 102, "dpdl-benchmark/caltech101", "train[2754:2954]"),
    _vtab("cifar100", "natural", 100, "uoft-cs/cifar100", "train[45000:45200]",
          image_column="img", label_column="fine_label"),
    _vtab("dtd", "natural", 47, "dpdl-benchmark/dtd", _VAL),  # UNVERIFIED
    _vtab("flowers102", "natural", 102, "dpdl-benchmark/oxford_flowers102", _VAL),
    _vtab("pets", "natural", 37, "dpdl-benchmark/oxford_iiit_pet", "train[2944:3144]"),
    _vtab("sun397", "natural", 397, "dpdl-benchmark/sun397", _VAL),
    _vtab("svhn", "natural", 10, "dpdl-benchmark/svhn_cropped", "train[65931:66131]"),
    _vtab("camelyon", "specialized", 2, "dpdl-benchmark/patch_camelyon", _VAL),
    _vtab("eurosat", "specialized", 10, "dpdl-benchmark/eurosat", "train[16200:16400]",
          "train[21600:]"),  # UNVERIFIED
    _vtab("resisc45", "specialized", 45, "dpdl-benchmark/resisc45", "train[18900:19100]", "train[25200:]"),
    _vtab("retinopathy", "specialized", 5, "dpdl-benchmark/diabetic_retinopathy_detection",
          _VAL),  # UNVERIFIED
    # CLEVR: task_adaptation tests on TFDS `validation` (TFDS `test` has no scenes); this mirror
    # ships only the 15k labelled held-out images, as `test`.
    _vtab("clevr_count", "structured", 8, "dpdl-benchmark/clevr", "train[63000:63200]",
          label_rule="clevr_count"),
    _vtab("clevr_dist", "structured", 6, "dpdl-benchmark/clevr", "train[63000:63200]",
          label_rule="clevr_distance"),
    _vtab("dmlab", "structured", 6, "dpdl-benchmark/dmlab", _VAL),
    _vtab("dsprites_loc", "structured", 16, "dpdl-benchmark/dsprites", "train[589824:590024]",
          "train[663552:]", label_rule="dsprites_location", binary_pixels=True),
    _vtab("dsprites_ori", "structured", 16, "dpdl-benchmark/dsprites", "train[589824:590024]",
          "train[663552:]", label_rule="dsprites_orientation", binary_pixels=True),
    _vtab("kitti_dist", "structured", 4, "dpdl-benchmark/kitti", _VAL, label_rule="kitti_closest_vehicle"),
    _vtab("smallnorb_azi", "structured", 18, "dpdl-benchmark/smallnorb", "test[:200]", "test[50%:]",
          label_column="label_azimuth"),
    _vtab("smallnorb_ele", "structured", 9, "dpdl-benchmark/smallnorb", "test[:200]", "test[50%:]",
          label_column="label_elevation"),
]


def _standard(name, num_classes, source, train="train", test="test", **columns) -> Task:
    return Task(name, "standard", num_classes, source, {"train": train, "test": test}, **columns)


STANDARD = [
    # "The first 65000 ImageNet samples have at least 30 shots per any class" holds for TFDS order;
    # the Hub copy (gated) may be ordered differently: the results then mark the short classes.
    _standard("imagenet", 1000, "ILSVRC/imagenet-1k", "train[:65000]", "validation"),
    _standard("cifar10", 10, "uoft-cs/cifar10", image_column="img"),
    _standard("cifar100", 100, "uoft-cs/cifar100", image_column="img", label_column="fine_label"),
    _standard("pets", 37, "dpdl-benchmark/oxford_iiit_pet"),
    # 10 per class in train: <= 10 shots
    _standard("flowers102", 102, "dpdl-benchmark/oxford_flowers102"),
    _standard("caltech101", 102, "dpdl-benchmark/caltech101"),  # UNVERIFIED
    _standard("dtd", 47, "dpdl-benchmark/dtd"),  # UNVERIFIED
    _standard("cars196", 196, "tanganke/stanford_cars"),
    _standard("uc_merced", 21, "dpdl-benchmark/uc_merced", "train[:1000]", "train[1000:]"),
]

REGISTRY: dict[str, Task] = {t.name: t for t in VTAB + STANDARD}


# ---------------------------------------------------------------- derived labels (task_adaptation
# rules)


def _objects(example: dict, key: str) -> list:
    """One field of every object: HF stores a sequence of dicts as a dict of lists, plain JSON as a
    list."""
    objects = example["objects"]
    return list(objects[key]) if isinstance(objects, dict) else [o[key] for o in objects]


def _bucket(value: float, thresholds: tuple[float, ...]) -> int:
    """Index of the last threshold strictly below `value` (task_adaptation's max(where(thrs <
    value)))."""
    return sum(t < value for t in thresholds) - 1


def clevr_count(example: dict) -> int:
    """CLEVR scenes hold 3..10 objects: label = object count - 3 (8 classes)."""
    return len(_objects(example, "size")) - 3


def clevr_distance(example: dict) -> int:
    """Depth (pixel_coords z) of the closest object, bucketed at 8, 8.5, 9, 9.5, 10 (6 classes)."""
    depth = min(coords[2] for coords in _objects(example, "pixel_coords"))
    return _bucket(depth, (0.0, 8.0, 8.5, 9.0, 9.5, 10.0, 100.0))


_VEHICLES = {0, 1, 2, "Car", "Van", "Truck"}  # TFDS type ClassLabel ids, or KITTI's own names


def kitti_closest_vehicle(example: dict) -> int:
    """Distance (z, metres) of the closest car/van/truck: <= 8, <= 20, further, or none (4
    classes)."""
    depths = [loc[2] for kind, loc in zip(_objects(example, "type"), _objects(example, "location"))
              if kind in _VEHICLES]
    return _bucket(min(depths + [1000.0]), (-100.0, 8.0, 20.0, 999.0))


def dsprites_location(example: dict) -> int:
    """The 32 x positions grouped into 16 classes of 2."""
    return example["label_x_position"] * 16 // 32


def dsprites_orientation(example: dict) -> int:
    """The 40 orientations grouped into 16 classes (floor(value / 2.5))."""
    return example["label_orientation"] * 16 // 40


LABEL_RULES = {  # rule name -> (function, raw columns it reads)
    "clevr_count": (clevr_count, ("objects",)),
    "clevr_distance": (clevr_distance, ("objects",)),
    "kitti_closest_vehicle": (kitti_closest_vehicle, ("objects",)),
    "dsprites_location": (dsprites_location, ("label_x_position",)),
    "dsprites_orientation": (dsprites_orientation, ("label_orientation",)),
}


def apply_label_rule(task: Task, ds):
    """`ds` with a `label` ClassLabel column: derived by the task's rule, or renamed from its
    label_column."""
    if task.label_rule:
        rule, columns = LABEL_RULES[task.label_rule]
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise DataError(f"task {task.name}: rule {task.label_rule} needs column(s) {missing}; "
                            f"the data has {ds.column_names}")
        labels = [rule(ex) for ex in ds.select_columns(list(columns))]  # reads no image bytes
        ds = ds.remove_columns([c for c in ("label",) if c in ds.column_names]).add_column("label", labels)
    elif task.label_column != "label":
        if task.label_column not in ds.column_names:
            raise DataError(f"task {task.name}: label column '{task.label_column}' not in {ds.column_names}")
        ds = ds.remove_columns([c for c in ("label",) if c in ds.column_names])
        ds = ds.rename_column(task.label_column, "label")
    labels = np.asarray(ds.select_columns(["label"]).with_format("numpy")["label"])
    # ClassLabel does not check
    if len(labels) and (labels.min() < 0 or labels.max() >= task.num_classes):
        raise DataError(f"task {task.name}: labels span {labels.min()}..{labels.max()}, "
                        f"outside the task's {task.num_classes} classes")
    feature = ds.features["label"]
    if isinstance(feature, ClassLabel) and feature.num_classes == task.num_classes:
        return ds  # keeps the class names
    return ds.cast_column("label", ClassLabel(num_classes=task.num_classes))


# ---------------------------------------------------------------- lookup


def _expand(item: str, custom: dict[str, Task]) -> list[Task]:
    if item in custom:
        return [custom[item]]
    if item in REGISTRY:
        return [REGISTRY[item]]
    if item == "vtab":
        return list(VTAB)
    if item.startswith("vtab/") and item[5:] in GROUPS:
        return [t for t in VTAB if t.group == item[5:]]
    if item == "standard":
        return list(STANDARD)
    known = ["vtab", "standard", *(f"vtab/{g}" for g in GROUPS), *REGISTRY, *custom]
    close = difflib.get_close_matches(item, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else "use vtab, vtab/<group>, standard or a task name"
    raise DataError(f"unknown task '{item}'; {hint}")


def get_tasks(spec: str, custom: dict[str, Task] | None = None) -> list[Task]:
    """Tasks named by a comma-separated spec (`vtab`, `vtab/natural`, `standard`, names),
    first mention first."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise DataError("no few-shot tasks given; use vtab, vtab/<group>, standard or task names")
    chosen: dict[str, Task] = {}
    for item in items:
        for task in _expand(item, custom or {}):
            chosen.setdefault(task.name, task)
    return list(chosen.values())


def task_dirs(task: Task, data_root: str) -> list[str]:
    """Where under `data_root` a task's local copy may be, in the order tried: the task's own name
    less `vtab/` (ROOT/svhn, ROOT/clevr_count), the source's dataset name (ROOT/svhn_cropped,
    ROOT/clevr: one copy serves the tasks sharing it), then ROOT/vtab/<name>, the layout read
    before."""
    names = [task.name.removeprefix("vtab/"), task.source.rsplit("/", 1)[-1], task.name]
    return list(dict.fromkeys(os.path.join(data_root, *name.split("/")) for name in names))


def task_source(task: Task, data_root: str = "") -> str:
    """Where to read a task: the first of task_dirs that exists when data_root is set, else its Hub
    id."""
    if not data_root or task.source == "synthetic":
        return task.source
    tried = task_dirs(task, data_root)
    found = [path for path in tried if os.path.exists(path)]
    if not found:
        raise DataError(f"task {task.name}: no local copy under --data-root {data_root}; tried "
                        f"{', '.join(tried)} (save it with datasets' save_to_disk as one of them)")
    return found[0]


def synthetic_task(num_classes: int = 10, name: str = "synthetic") -> Task:
    """A task on the built-in procedural `synthetic` source, so few-shot runs offline (tests,
    quickstart)."""
    return Task(name, "synthetic", num_classes, "synthetic", {"train": "train", "test": "test"})
