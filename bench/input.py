"""`make bench`'s input half: real-size JPEG photographs into a model, ours against timm's own training path.

The photographs are scikit-image's sample photos (the `bench` extra), cut into random crops and re-encoded as
JPEG (quality 90) at 375-640 px on the longer side, ImageNet's range; one class per photo, an imagefolder in
a temporary directory, made afresh by every run (no data is committed).

  loader      images/s per core (one thread, no workers) of decode + random-resized crop to 224 + flip +
              normalise, batches of 64, no model: our training stream (data.batches.train_batches) against
              timm's PIL transform (`create_transform(224, is_training=True)`, colour jitter off so both sides
              do the same work) and torchvision's bare uint8 path (`decode_jpeg` + `v2.RandomResizedCrop`);
              `loader_224_deit`: ours and timm's with DeiT's per-image augmentation on both sides
              (RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25 pixel)
  train       `vit pretrain` (stages.run.one_run, img/s from its own metrics) against timm's training path
              as its train.py builds it (create_dataset + create_loader with its PIL transforms and its
              prefetcher, create_model, create_optimizer_v2("adamw"), a plain step loop) on the same folder,
              network, batch, precision (fp32), crop area range and workers: the quickstart network at 32 px
              (the input decides) and ViT-Ti/16 at 224 (the model decides); `quickstart_32_deit` with DeiT's
              augmentation on both sides (the above, and timm's Mixup with mixup 0.8 / CutMix 1.0 switched
              half the time, label smoothing 0.1, in the step loop as train.py runs it)

Every figure is taken where a real dataset would be: vit's decoded-image cache is off (a real dataset has
more encoded bytes than it takes), so every image is decoded every time it is read, as timm decodes it.
timm's increasing posterize asks Pillow for 0 bits at magnitude 10, which Pillow 13 refuses (its train.py
stops there); on timm's side here `posterize` gives a black image for 0 bits, as TF's posterize does and
as ours does, so that the DeiT spec runs at all.

    python bench/input.py [--quick] [--out F]   # its JSON alone; bench/run.py includes it
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import timm
import timm.data.auto_augment as timm_aa
import timm.loss
import timm.optim
import torch
import torchvision.io as tio
from jpegs import PHOTOS, write_jpegs  # bench/jpegs.py
from PIL import Image
from timm.data import Mixup, create_dataset, create_loader, create_transform
from torchvision.transforms import v2

from vitcli.data import batches, sources
from vitcli.recipe.resolve import resolve
from vitcli.runtime.allocator import keep_freed_memory
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run

# glibc's allocator as `vit` sets it when it starts (cli/entry.py): every side measured in this process,
# the reference's included, runs with it
ALLOCATOR = keep_freed_memory()

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
MEAN = (0.5, 0.5, 0.5)  # the ViT paper's [-1, 1] scaling, on both sides
# name -> (timm architecture and its kwargs, our recipe overrides, image size, batch, steps, log_every)
NETWORKS = {
    "quickstart_32": ("vit_tiny_patch16_224", {"img_size": 32, "patch_size": 4, "embed_dim": 64, "depth": 2,
                                               "num_heads": 4, "mlp_ratio": 2.0},
                      [], 32, 128, 40, 10),
    "vit_ti16_224": ("vit_tiny_patch16_224", {"img_size": 224}, [
        "model.name=custom", "model.patch_size=16", "model.embed_dim=192", "model.depth=12",
        "model.num_heads=3", "model.mlp_dim=768"], 224, 32, 16, 4),
}
# DeiT's augmentation (deit/main.py defaults): ours as recipe keys, timm's as create_transform / Mixup args
DEIT_RANDAUGMENT, DEIT_ERASING = "rand-m9-mstd0.5-inc1", 0.25
DEIT_KEYS = [f"data.randaugment={DEIT_RANDAUGMENT}", f"data.erasing={DEIT_ERASING}",
             "data.erasing_mode=pixel",
             "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "data.mix_switch_prob=0.5",
             "optim.label_smoothing=0.1"]
DEIT_TIMM = {"auto_augment": DEIT_RANDAUGMENT, "re_prob": DEIT_ERASING, "re_mode": "pixel"}
DEIT_MIXUP = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "switch_prob": 0.5, "label_smoothing": 0.1}


def _posterize_zero_bits_black(img, bits_to_keep, **__):
    """timm's posterize, with 0 bits giving black (TF's result; Pillow 13 refuses 0 bits): see the top."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return timm_aa.ImageOps.posterize(img, bits_to_keep)


timm_aa.NAME_TO_OP = {k: (_posterize_zero_bits_black if v is timm_aa.posterize else v)
                      for k, v in timm_aa.NAME_TO_OP.items()}
batches.DECODED_CACHE_BYTES = 0  # every figure as on a real dataset: no image decoded once and kept


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
        "model.img_size=224", "data.crop_min_area=0.08", *(DEIT_KEYS[:3] if deit else [])])
    ds = sources.load_split(r.data, r.data.train_split)
    return iter(batches.train_batches(ds, r.data, 224, batch, seed=0))


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
            "batch": batch, "threads": 1, "images": len(files), "decoded_cache": "off",
            "augmentation": f"{DEIT_RANDAUGMENT}, erasing {DEIT_ERASING}" if deit else "crop + flip"}


def timm_train(root: Path, net: tuple, workers: int, deit: bool = False) -> float:
    """Images/s of timm's training path (train.py's pieces, a plain step loop), the first steps dropped;
    with `deit`, DeiT's augmentation and timm's Mixup in the loop (train.py's soft-target loss)."""
    arch, kwargs, _, img, batch, steps, log_every = net
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=len(PHOTOS), **kwargs).train()
    opt = timm.optim.create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ds = create_dataset("", root=str(root), split="train", is_training=True)
    loader = create_loader(ds, input_size=(3, img, img), batch_size=batch, is_training=True,
                           scale=(0.08, 1.0), color_jitter=0.0, interpolation="bilinear", mean=MEAN, std=MEAN,
                           num_workers=workers, device=torch.device("cpu"), use_prefetcher=True,
                           **(DEIT_TIMM if deit else {}))
    mixup = Mixup(**DEIT_MIXUP, num_classes=len(PHOTOS)) if deit else None
    loss_fn = timm.loss.SoftTargetCrossEntropy() if deit else torch.nn.CrossEntropyLoss()
    done, t0 = 0, None
    while done < steps:
        for x, y in loader:
            if done == log_every:  # the same warm-up our side drops: its first logging window
                t0 = time.perf_counter()
            if mixup is not None:
                x, y = mixup(x, y)
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == steps:
                break
    return (steps - log_every) * batch / (time.perf_counter() - t0)


def ours_train(root: Path, net: tuple, workers: int, deit: bool = False) -> float:
    """Images/s of `vit pretrain` on the folder, from its metrics rows, the first logging window dropped;
    with `deit`, DeiT's augmentation (DEIT_KEYS)."""
    _, _, overrides, img, batch, steps, log_every = net
    r = resolve("pretrain", QUICKSTART, [
        *overrides, f"data.source={root}", "data.val_split=", "data.test_split=", f"model.img_size={img}",
        f"data.batch_size={batch}", "data.micro_batch_size=0", f"data.num_workers={workers}",
        "data.crop_min_area=0.08", "fewshot.every=0", f"schedule.steps={steps}", "schedule.epochs=0",
        "schedule.warmup_steps=1", f"run.log_every={log_every}", f"run.ckpt_every={steps}",
        "run.precision=fp32", "optim.clip_grad_norm=0", "run.compile=false",
        f"model.num_classes={len(PHOTOS)}", *(DEIT_KEYS if deit else [])])
    with tempfile.TemporaryDirectory() as d:
        one_run(r, Path(d))
        rows = [m["train/img_per_s"] for m in read_metrics(Path(d) / "metrics.jsonl")
                if "train/img_per_s" in m]
    return float(np.mean(rows[1:]))


def measure(quick: bool, workers: int = 1) -> dict:
    """Every input number of this file, on one freshly written folder."""
    with tempfile.TemporaryDirectory() as d:
        root = write_jpegs(Path(d), 16 if quick else 130)
        progress("input: loaders per core on JPEG photographs")
        n, batch = (1, 16) if quick else (12, 64)
        out = {"allocator": ALLOCATOR, "loader_224": loader_rates(root, n, batch), "train": {}}
        progress("input: loaders per core with DeiT's augmentation")
        out["loader_224_deit"] = loader_rates(root, n, batch, deit=True)
        runs = [(name, net, False) for name, net in NETWORKS.items()]
        runs.append(("quickstart_32_deit", NETWORKS["quickstart_32"], True))
        for name, net, deit in runs:
            if quick:
                net = (*net[:4], 16, 4, 2)
            progress(f"input: {name}, timm's training path")
            timm_rate = timm_train(root, net, workers, deit)
            progress(f"input: {name}, vit pretrain")
            ours_rate = ours_train(root, net, workers, deit)
            out["train"][name] = {"img_size": net[3], "batch": net[4], "num_workers": workers,
                                  "ours_img_s": ours_rate, "timm_img_s": timm_rate,
                                  "ratio": ours_rate / timm_rate, "decoded_cache": "off"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the machine")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", help="write the JSON here (the runs print their tables on stdout)")
    a = p.parse_args()
    text = json.dumps(measure(a.quick, a.workers), indent=2) + "\n"
    Path(a.out).write_text(text) if a.out else sys.stdout.write(text)


if __name__ == "__main__":
    main()
