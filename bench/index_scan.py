"""How long a start takes on an ImageNet-shaped image folder (issue 36): vitcli's folder index
(data/rows/folder_index.py: first build, reuse), `sources.load_split` and a whole one-step `vit pretrain` on
it,
beside timm's own scan of the same folder and HF's imagefolder builder (what `load_dataset` ran for every
plain folder before the index). Every figure is one fresh process, as a user's start is.

The folder is bench/rehearse.py's (its `build_tree`), built without the disk: `--classes` class directories
of `--per-class` hard links each under train/ (and `--val-per-class` under val/), each linking to one of
`--photos` small JPEGs kept in ROOT/.photos (hidden: no row of the folder's). One JSON object on stdout.

    PYTHONPATH=src python bench/index_scan.py --root /tmp/inet   # 1000 x 1281 (+ 1000 x 50): ~20 min
    PYTHONPATH=src python bench/index_scan.py --root /tmp/inet --hf-limit 0  # without HF: ~2 min
    PYTHONPATH=src python bench/index_scan.py --root /tmp/inet --classes 10 --per-class 20  # the script

HF's builder takes about 23 minutes at full size (fsspec's glob stats every file once for each of the split
patterns HF tries): `--hf-limit S` stops each of its loads after S seconds (600), and then it is timed again
on a folder of `--hf-classes` classes (100) for a rate in files/s. The folder is removed afterwards unless
`--keep`; one of the same shape already at --root is used as it is (building 1.33M links takes 30-60 s).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
from PIL import Image
from rehearse import build_tree  # bench/rehearse.py: the same ImageNet-shaped tree of hard links

from vitcli.data.rows.folder_index import SETTLE_NS

REPO = Path(__file__).resolve().parents[1]
PHOTOS = ".photos"  # the JPEGs linked to, inside the folder (hard links stay on one file system), hidden


def make_photos(folder: Path, n: int, seed: int = 0) -> list[Path]:
    """`n` small JPEGs (random pixels, 32-96 px) to link to: listing never opens them, reading rows does."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        h, w = (int(v) for v in rng.integers(32, 97, 2))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        paths.append(folder / f"photo{i:04d}.jpg")
        paths[-1].write_bytes(buf.getvalue())
    return paths


def has_tree(root: Path, classes: int, per_class: int, val_per_class: int) -> bool:
    """A tree of this shape is already at `root` (its class directories there, the last ones complete)."""
    shape = [(root / "train", per_class)] + ([(root / "val", val_per_class)] if val_per_class else [])
    for split, n in shape:
        names = sorted(os.listdir(split)) if split.is_dir() else []
        if len(names) != classes or len(os.listdir(split / names[-1])) != n:
            return False
    return True


def in_process(code: str, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run `code` (which prints one JSON object last) in a fresh interpreter: each start is a new process, as
    a user's is. {"timed_out": limit} where it runs past `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), **(env or {})}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"timed_out": timeout}
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{code!r} failed:\n{e.stderr[-3000:]}") from None
    return json.loads(done.stdout.strip().splitlines()[-1])


TIMM = """
import json, time
from timm.data import create_dataset
t0 = time.perf_counter()
ds = create_dataset("", root={root!r}, split="train")
print(json.dumps({{"seconds": round(time.perf_counter() - t0, 3), "rows": len(ds)}}))
"""

INDEX = """
import json, time
from vitcli.data.rows import folder_index
t0 = time.perf_counter()
splits = folder_index.splits({root!r})
seconds = round(time.perf_counter() - t0, 3)
print(json.dumps({{"seconds": seconds, "rows": {{k: len(v) for k, v in splits.items()}}}}))
"""

LOAD_SPLIT = """
import json, random, time
t0 = time.perf_counter()
from vitcli.data.rows import sources
from vitcli.recipe.schema import DataConfig
t1 = time.perf_counter()
ds = sources.load_split(DataConfig(source={root!r}), "train")
n = len(ds)
t2 = time.perf_counter()
sizes = [ds[i]["image"].size for i in random.Random(0).sample(range(n), 10)]
t3 = time.perf_counter()
print(json.dumps({{"import_s": round(t1 - t0, 2), "load_split_and_len_s": round(t2 - t1, 2),
                  "ten_random_rows_s": round(t3 - t2, 3), "rows": n}}))
"""

HF = """
import json, time
import datasets
t0 = time.perf_counter()
splits = datasets.load_dataset({root!r}, cache_dir={cache!r})
seconds = round(time.perf_counter() - t0, 1)
print(json.dumps({{"seconds": seconds, "rows": {{k: len(v) for k, v in splits.items()}}}}))
"""


def pretrain_start(root: Path, cache: Path, workdir: Path) -> dict:
    """Seconds of a whole `vit pretrain` of one step on the folder (the quickstart's tiny ViT at 32 px, no
    evaluation): the second start's figure, index reused."""
    vit = Path(sys.executable).parent / "vit"
    args = [str(vit) if vit.is_file() else sys.executable, *([] if vit.is_file() else ["-m", "vitcli.cli"]),
            "pretrain", "-r", str(REPO / "recipes/quickstart/pretrain.yaml"), "--workdir", str(workdir),
            "--overwrite", f"data.source={root}", "schedule.steps=1", "schedule.warmup_steps=0",
            "data.val_split=", "data.test_split=", "run.ckpt_every_minutes=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "VITCLI_CACHE": str(cache)}
    t0 = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"vit pretrain failed:\n{done.stderr[-3000:]}")
    return {"seconds": round(time.perf_counter() - t0, 1)}


def machine() -> str:
    """The CPU's model name (as lscpu gives it) and its cores."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} cores"


def measure(root: Path, hf_limit: float) -> dict:
    """Every figure on the folder at `root`, each start in a fresh process, the index's cache fresh."""
    cache = Path(tempfile.mkdtemp(prefix="index-scan-cache-"))
    try:
        return figures(root, cache, hf_limit)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def figures(root: Path, cache: Path, hf_limit: float) -> dict:
    """measure's figures, the index kept in `cache`."""
    env = {"VITCLI_CACHE": str(cache)}
    out = {"machine": machine(), "timm_scan": in_process(TIMM.format(root=str(root)))}
    out["index_first"] = in_process(INDEX.format(root=str(root)), env)
    out["index_reused"] = in_process(INDEX.format(root=str(root)), env)
    out["load_split_reused"] = in_process(LOAD_SPLIT.format(root=str(root)), env)
    out["pretrain_one_step_reused"] = pretrain_start(root, cache, cache / "run")
    out["first_over_timm"] = round(out["index_first"]["seconds"] / max(out["timm_scan"]["seconds"], 1e-3), 2)
    if hf_limit:
        out["hf_imagefolder"] = hf_loads(root, cache / "hf", hf_limit)
    return out


def hf_loads(root: Path, cache: Path, limit: float) -> dict:
    """`load_dataset(root)` twice (the second finds HF's cache), each stopped after `limit` seconds."""
    code = HF.format(root=str(root), cache=str(cache))
    first = in_process(code, timeout=limit)
    return {"first": first, "second": first if "timed_out" in first else in_process(code, timeout=limit)}


def hf_rate(root: Path, classes: int, per_class: int, val_per_class: int, limit: float) -> dict:
    """HF's loads on a folder of the first `classes` classes only (linked beside `root`), as files/s: its
    time grows with the files (fsspec stats every file once per split pattern it tries, 57 of them here)."""
    sub = root.parent / f"{root.name}-hf{classes}"
    shutil.rmtree(sub, ignore_errors=True)
    build_tree(sub, sorted((root / PHOTOS).glob("*.jpg")), classes, per_class, val_per_class)
    try:
        loads = hf_loads(sub, sub.parent / f"{sub.name}-cache", limit)
    finally:
        shutil.rmtree(sub, ignore_errors=True)
        shutil.rmtree(sub.parent / f"{sub.name}-cache", ignore_errors=True)
    files = classes * (per_class + val_per_class)
    rates = {k: round(files / v["seconds"]) for k, v in loads.items() if "seconds" in v}
    return {"files": files, **loads, "files_per_s": rates}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, required=True, help="where the folder is built (or found)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--photos", type=int, default=300, help="distinct JPEGs the links point to")
    p.add_argument("--keep", action="store_true", help="leave the folder in place")
    p.add_argument("--hf-limit", type=float, default=600,
                   help="seconds before HF's builder is stopped (0: HF is not run)")
    p.add_argument("--hf-classes", type=int, default=100,
                   help="where HF is stopped, it is timed again on a folder of this many classes")
    args = p.parse_args()
    root = args.root.resolve()
    shape = (args.classes, args.per_class, args.val_per_class)
    built = None
    if not has_tree(root, *shape):
        shutil.rmtree(root, ignore_errors=True)
        photos = make_photos(root / PHOTOS, args.photos)  # hidden: no image of the folder's
        built = build_tree(root, photos, *shape)
        time.sleep(SETTLE_NS / 1e9)  # the index keeps no listing of a directory younger than this
    try:
        out = {"tree": {"root": str(root), "built": built}, **measure(root, args.hf_limit)}
        if "timed_out" in out.get("hf_imagefolder", {}).get("first", {}):
            out["hf_imagefolder_smaller"] = hf_rate(root, args.hf_classes, *shape[1:], args.hf_limit)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
