"""`make bench`'s loader half, IN-PROCESS: real-size JPEG photographs through each loader per core, no model.

The photographs are scikit-image's sample photos (the `bench` extra), cut into random crops and re-encoded as
JPEG (quality 90) at 375-640 px on the longer side, ImageNet's range; one class per photo, an imagefolder in
a temporary directory, made afresh by every run (no data is committed).

  loader_224       images/s per core (one thread, no workers, in this process) of decode + random-resized
                   crop to 224 + flip + normalise, batches of 64: our training stream
                   (data.batches.train_batches) against timm's PIL transform (`create_transform(224,
                   is_training=True)`, colour jitter off so both sides do the same work) and torchvision's
                   bare uint8 path (`decode_jpeg` + `v2.RandomResizedCrop`)
  loader_224_deit  ours and timm's with DeiT's per-image augmentation on both sides (RandAugment
                   rand-m9-mstd0.5-inc1, random erasing 0.25 pixel)
  multicrop        DINO's input, images/s per core: our multi-crop stream (train_batches with
                   views=MultiCrop(): 2 x 224 + 8 x 96 crops, BYOL's colour augmentation,
                   normalised) against dinov2's DataAugmentationDINO on each PIL image (decode,
                   the transform with its ToTensor and Normalize, the crops stacked as its collate
                   stacks them), as its DataLoader worker runs it; ratio_vs_reference = ours /
                   dinov2's (the goal: 2.5)

These are in-process figures of the loaders alone, timed in turns. What a user runs, `vit pretrain` as a
command against timm's own train.py on an ImageNet-shaped folder, is bench/rehearse.py's (make rehearse;
make bench runs a smaller one). Ours is read as a real dataset is: its decoded-image cache off
(data.cache_mb=0; a dataset of ImageNet's size is never cached), so every image is decoded each time it is
read, as timm decodes it. timm's increasing posterize asks Pillow for 0 bits at magnitude 10, which Pillow
13 refuses (its train.py stops there); on timm's side here `posterize` gives a black image for 0 bits, as
TF's posterize does and as ours does, so that the DeiT spec runs at all.

    python bench/input.py [--quick] [--out F]   # its JSON alone; bench/run.py includes it
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import timm.data.auto_augment as timm_aa
import torch
import torchvision.io as tio
from jpegs import write_jpegs  # bench/jpegs.py
from PIL import Image
from timm.data import create_transform
from torchvision.transforms import v2

from vitcli.data.augmentation.multicrop import MultiCrop
from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.recipe.resolve import resolve
from vitcli.runtime.allocator import keep_freed_memory

# glibc's allocator as `vit` sets it when it starts (cli/entry.py): every side measured in this process,
# the reference's included, runs with it
ALLOCATOR = keep_freed_memory()

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
MEAN = (0.5, 0.5, 0.5)  # the ViT paper's [-1, 1] scaling, on both sides
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # dinov2's normalisation
# DeiT's augmentation (deit/main.py defaults): ours as recipe keys, timm's as create_transform / Mixup args
DEIT_RANDAUGMENT, DEIT_ERASING = "rand-m9-mstd0.5-inc1", 0.25
DEIT_KEYS = [f"data.randaugment={DEIT_RANDAUGMENT}", f"data.erasing={DEIT_ERASING}",
             "data.erasing_mode=pixel"]
DEIT_TIMM = {"auto_augment": DEIT_RANDAUGMENT, "re_prob": DEIT_ERASING, "re_mode": "pixel"}


def _posterize_zero_bits_black(img, bits_to_keep, **__):
    """timm's posterize, with 0 bits giving black (TF's result; Pillow 13 refuses 0 bits): see the top."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return timm_aa.ImageOps.posterize(img, bits_to_keep)


timm_aa.NAME_TO_OP = {k: (_posterize_zero_bits_black if v is timm_aa.posterize else v)
                      for k, v in timm_aa.NAME_TO_OP.items()}


def progress(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rates(makers: list[tuple[str, object]], n_batches: int, batch: int) -> dict[str, float]:
    """Images/s of each named batch iterator over n_batches, after one warm-up batch each, taken in turns
    (one batch of each, then the next round): a slower spell of a shared machine then falls on every side
    alike, where timing one side after the other put it on whichever ran then."""
    spent = dict.fromkeys([name for name, _ in makers], 0.0)
    for _, it in makers:
        next(it)
    for _ in range(n_batches):
        for name, it in makers:
            t0 = time.perf_counter()
            next(it)
            spent[name] += time.perf_counter() - t0
    return {name: n_batches * batch / s for name, s in spent.items()}


def _files(root: Path) -> list[Path]:
    return sorted((root / "train").rglob("*.jpg"))


def _timm_pil(files: list[Path], batch: int, deit: bool = False):
    """timm's training transform on PIL images, what its train.py runs without the prefetcher."""
    tf = create_transform(224, is_training=True, color_jitter=0.0, interpolation="bilinear", mean=MEAN,
                          std=MEAN, **(DEIT_TIMM if deit else {}))
    while True:
        for i in range(0, len(files) - batch + 1, batch):
            yield torch.stack([tf(Image.open(f).convert("RGB")) for f in files[i : i + batch]])


def _torchvision_uint8(files: list[Path], batch: int):
    """The bare uint8 path the dependencies already offer: libjpeg-turbo decode, crop and resize on uint8."""
    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, MEAN)])
    encoded = [tio.read_file(str(f)) for f in files]
    while True:
        for i in range(0, len(files) - batch + 1, batch):
            yield torch.stack([tf(tio.decode_jpeg(e)) for e in encoded[i : i + batch]])


def _ours(root: Path, batch: int, deit: bool = False):
    """Our training stream over the same folder, as a run reads it."""
    r = resolve("pretrain", QUICKSTART, [
        f"data.source={root}", "data.val_split=", "data.test_split=", "data.num_workers=0",
        "model.img_size=224", "data.crop_min_area=0.08", "data.cache_mb=0", *(DEIT_KEYS if deit else [])])
    ds = sources.load_split(r.data, r.data.train_split)
    return iter(batches.train_batches(ds, r.data, 224, batch, seed=0))


def _ours_multicrop(root: Path, batch: int):
    """Our multi-crop stream over the folder (DINO's defaults), as a DINO run reads it."""
    r = resolve("pretrain", QUICKSTART, [
        f"data.source={root}", "data.val_split=", "data.test_split=", "data.num_workers=0",
        "model.img_size=224", "data.cache_mb=0", f"data.mean={list(IMAGENET_MEAN)}",
        f"data.std={list(IMAGENET_STD)}"])
    ds = sources.load_split(r.data, r.data.train_split)
    return iter(batches.train_batches(ds, r.data, 224, batch, seed=0, views=MultiCrop()))


def _dinov2(files: list[Path], batch: int):
    """dinov2's DataAugmentationDINO (DINO's scales and crop counts) on each PIL image, the crops
    stacked as its collate_data_and_masks stacks them: what one of its DataLoader workers does."""
    logging.getLogger("dinov2").setLevel(logging.WARNING)  # it logs its parameters at INFO
    from dinov2.data.augmentations import DataAugmentationDINO

    tf = DataAugmentationDINO((0.4, 1.0), (0.05, 0.4), 8, 224, 96)
    while True:
        for i in range(0, len(files) - batch + 1, batch):
            out = [tf(Image.open(f).convert("RGB")) for f in files[i : i + batch]]
            yield (torch.stack([c for v in range(2) for c in (o["global_crops"][v] for o in out)]),
                   torch.stack([c for v in range(8) for c in (o["local_crops"][v] for o in out)]))


def multicrop_rates(root: Path, n_batches: int, batch: int = 32) -> dict:
    """Images/s per core (one thread, no workers) of DINO's multi-crop input: ours against
    dinov2's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        makers = [("ours", _ours_multicrop(root, batch)), ("dinov2", _dinov2(_files(root), batch))]
        out = _rates(makers, n_batches, batch)
    finally:
        torch.set_num_threads(threads)
    return {"ours_img_s": out["ours"], "reference_img_s": out["dinov2"],
            "ratio_vs_reference": out["ours"] / out["dinov2"], "batch": batch, "threads": 1,
            "crops": "2 x 224 + 8 x 96", "decoded_cache": "off (data.cache_mb=0)",
            "reference": "dinov2.data.augmentations.DataAugmentationDINO, PIL"}


def loader_rates(root: Path, n_batches: int, batch: int = 64, deit: bool = False) -> dict:
    """Images/s per core of the pipelines on the same photographs (one thread, no workers): with `deit`,
    ours and timm's with DeiT's per-image augmentation, else the three plain ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        files = _files(root)
        makers = [("ours", _ours(root, batch, deit)), ("timm_pil", _timm_pil(files, batch, deit))]
        if not deit:
            makers.append(("torchvision_uint8", _torchvision_uint8(files, batch)))
        out = _rates(makers, n_batches, batch)
    finally:
        torch.set_num_threads(threads)
    return {**{f"{k}_img_s": v for k, v in out.items()}, "ours_vs_timm": out["ours"] / out["timm_pil"],
            **({"ours_vs_torchvision": out["ours"] / out["torchvision_uint8"]} if not deit else {}),
            "batch": batch, "threads": 1, "images": len(files), "decoded_cache": "off (data.cache_mb=0)",
            "augmentation": f"{DEIT_RANDAUGMENT}, erasing {DEIT_ERASING}" if deit else "crop + flip"}


def measure(quick: bool) -> dict:
    """Every figure of this file, on one freshly written folder."""
    with tempfile.TemporaryDirectory() as d:
        root = write_jpegs(Path(d), 16 if quick else 130)
        progress("input: loaders per core on JPEG photographs (in-process)")
        n, batch = (1, 16) if quick else (12, 64)
        out = {"in_process": True, "allocator": ALLOCATOR, "loader_224": loader_rates(root, n, batch)}
        progress("input: loaders per core with DeiT's augmentation (in-process)")
        out["loader_224_deit"] = loader_rates(root, n, batch, deit=True)
        progress("input: DINO's multi-crop per core, ours against dinov2's (in-process)")
        out["multicrop"] = multicrop_rates(root, *((1, 8) if quick else (8, 32)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the machine")
    p.add_argument("--out", help="write the JSON here (the runs print their tables on stdout)")
    a = p.parse_args()
    text = json.dumps(measure(a.quick), indent=2) + "\n"
    Path(a.out).write_text(text) if a.out else sys.stdout.write(text)


if __name__ == "__main__":
    main()
