"""Microseconds per training crop, one core: decode + crop of a JPEG as decode.Encoded.pixels runs it, with
the crop-only decoder (data.jpeg_region's C extension) and without it (what a build without a C compiler or
jpeglib.h runs: PIL's draft at 1/2..1/8 where the crop allows, else torchvision's whole decode), against
torchvision's decode_jpeg of the whole image then sliced, the decoder most loaders use, and the crop-only
decoder held at full scale (what cropping alone saves).

The JPEGs are bench/jpegs.py's (scikit-image's photographs re-encoded at quality 90, 375-640 px on the longer
side: ImageNet's sizes); the boxes are the training stream's own Inception crops (augment.draws, 8-100% of
the area), for outputs of 224 px (ImageNet) and 32 px (the quickstart), which decide the DCT scale. Each
variant decodes the same (image, box) list; the figure is the best of `--repeats` passes, in microseconds
of CPU per crop. `--eighths` adds libjpeg's M/8 scalings (issue 36's question: is a region decoded at the
smallest M/8 that keeps `out` px a side faster than at full scale?) with the resized result's distance from
the full-scale crop resized the same way (augment.resize_each, antialiased bilinear).

    python bench/decode_crop.py [--images 200] [--repeats 9] [--eighths]   # JSON on stdout, ~1 min
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.io import decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jpegs import write_jpegs  # bench/jpegs.py

from vitcli.data.augmentation.augment import draws, resize_each
from vitcli.data.decoding import jpeg_region
from vitcli.data.decoding.decode import Encoded

OUTS = (224, 32)
AREA = (0.08, 1.0)  # RandomResizedCrop's default scale, the recipes' data.crop_min_area..1


def crops(images: int, seed: int = 0) -> list[tuple[bytes, tuple[int, int], tuple[int, int, int, int]]]:
    """(bytes, (height, width), box) for `images` JPEGs, each with one Inception box."""
    with tempfile.TemporaryDirectory() as tmp:
        root = write_jpegs(Path(tmp), per_class=-(-images // 10))
        datas = [p.read_bytes() for p in sorted(root.rglob("*.jpg"))][:images]
    sizes = np.array([Encoded(d).size for d in datas])
    boxes, _ = draws(sizes, seed, AREA, hflip=False)
    return [(d, tuple(s), tuple(int(v) for v in b)) for d, s, b in zip(datas, sizes, boxes, strict=True)]


def torchvision_sliced(data: bytes, size, box, out: int) -> torch.Tensor:
    top, left, h, w = box
    whole = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return whole[:, top : top + h, left : left + w]


def encoded(data: bytes, size, box, out: int) -> torch.Tensor:
    return Encoded(data).pixels(box, out)


def without_extension(data: bytes, size, box, out: int) -> torch.Tensor:
    saved, jpeg_region._jpeg_region = jpeg_region._jpeg_region, None
    try:
        return Encoded(data).pixels(box, out)
    finally:
        jpeg_region._jpeg_region = saved


def region_full_scale(data: bytes, size, box, out: int) -> torch.Tensor:
    return jpeg_region.crop(data, size, box, 1)


def per_crop_us(variants: dict, cases, out: int, repeats: int) -> dict[str, float]:
    """Each variant's best of `repeats` passes over all cases, per crop, in microseconds of this process's
    CPU time (one thread): on a shared machine the wall clock also counts the neighbours' turns, and the best
    pass is the one they disturbed least. The variants take turns pass by pass."""
    passes: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, decode in variants.items():
            start = time.process_time()
            for data, size, box in cases:
                decode(data, size, box, out)
            passes[name].append((time.process_time() - start) / len(cases) * 1e6)
    return {name: round(min(times), 1) for name, times in passes.items()}


def eighths_study(cases, out: int, repeats: int) -> dict:
    """For boxes (snapped to multiples of 8 px, so that only the filter differs) whose smallest M/8 scale
    keeping `out` px a side is 3/8..7/8 (a short side under 8/7 * out takes 8/8, one of 2 * out takes 1/2):
    the region decoded at full scale against at that M/8; time per crop and, after resize_each to out x out,
    the mean and max absolute level difference of the M/8 result from the full-scale one."""
    snapped = [(d, s, tuple(v // 8 * 8 for v in b)) for d, s, b in cases]  # corners exact at every M/8
    rows = [(d, s, (b, m)) for d, s, b in snapped
            if (m := smallest_eighths(b, out)) < 8 and min(b[2:]) < 2 * out]
    if not rows:
        return {"crops": 0}
    timing = per_crop_us({"full_scale": _full_scale, "m_eighths": _m_eighths}, rows, out, repeats)
    none = np.zeros(1, dtype=bool)
    diffs = torch.stack([(resize_each([_m_eighths(d, s, bm, out)], none, out).int()
                          - resize_each([_full_scale(d, s, bm, out)], none, out).int()).abs()[0]
                         for d, s, bm in rows])
    return {"crops": len(rows), "eighths_used": sorted({m for *_, (b, m) in rows}), "us_per_crop": timing,
            "levels_mean": round(float(diffs.float().mean()), 3), "levels_max": int(diffs.max())}


def smallest_eighths(box, out: int) -> int:
    """The smallest M in 3..8 at which the box keeps `out` px on each side (ceil(side * M / 8))."""
    return next((m for m in range(3, 8) if min(-(-v * m // 8) for v in box[2:]) >= out), 8)


def _full_scale(data: bytes, size, box_m, out: int) -> torch.Tensor:
    return _at_eighths(data, size, box_m[0], 8)


def _m_eighths(data: bytes, size, box_m, out: int) -> torch.Tensor:
    return _at_eighths(data, size, *box_m)


def _at_eighths(data: bytes, size, box, m: int) -> torch.Tensor:
    """The box decoded at m/8 scale: its corners scaled (floor / ceil), the image ceil(H * m / 8) tall."""
    top, left, h, w = box
    sh, sw = (-(-v * m // 8) for v in size)
    y0, x0 = top * m // 8, left * m // 8
    y1, x1 = min(sh, -(-(top + h) * m // 8)), min(sw, -(-(left + w) * m // 8))
    out = np.empty((y1 - y0, x1 - x0, 3), dtype=np.uint8)
    jpeg_region._jpeg_region.decode(data, out, y0, x0, y1 - y0, x1 - x0, m)
    return torch.from_numpy(out).permute(2, 0, 1)


def cpu() -> str:
    """lscpu's model name (/proc/cpuinfo), else the platform's machine."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--eighths", action="store_true", help="also time libjpeg's M/8 scalings")
    args = parser.parse_args()
    if jpeg_region._jpeg_region is None:
        sys.exit("the C extension vitcli.data.decoding._jpeg_region is not built: pip install -e . where gcc "
                 "and jpeglib.h are")
    torch.set_num_threads(1)
    cases = crops(args.images)
    variants = {"encoded_with_extension": encoded, "encoded_without_extension": without_extension,
                "torchvision_whole_then_sliced": torchvision_sliced, "region_full_scale": region_full_scale}
    result = {"machine": cpu(), "images": len(cases),
              "us_per_crop": {out: per_crop_us(variants, cases, out, args.repeats) for out in OUTS}}
    if args.eighths:
        result["eighths"] = {out: eighths_study(cases, out, args.repeats) for out in OUTS}
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
