"""`make rehearse`: ImageNet met before a user meets it. An ImageNet-shaped folder that costs no disk, and
`vit pretrain` on it as a user types it, beside timm's own `train.py` on the same folder; one JSON object.

The tree: ROOT/train/<wnid>/<wnid>_<i>.JPEG for `--classes` folders of `--per-class` entries (ImageNet-1k:
1,000 x 1,281) and ROOT/val/<wnid>/ with `--val-per-class` (50), every entry a hard link to one of a few
hundred real photographs at ImageNet's sizes (bench/jpegs.py: scikit-image's photographs, 375-640 px on the
longer side, quality 90). 1.28M names, ~140 GB as any tool sees it (so no decoded-image cache takes it),
~30 MB of distinct bytes on disk.

Each side runs as a command in its own process, with its own defaults, from a cold start:
  vit    `vit pretrain --recipe recipes/quickstart/pretrain.yaml data.source=ROOT ...`: the quickstart network
         at 32 px, batch 128, fp32, crops over 8-100% of the area (timm's default), AdamW
  timm   timm's own `train.py` (give its path: --timm-train; from timm's repository at the installed
         version) with the same network (`vit_tiny_patch16_224` with the quickstart's sizes as
         --model-kwargs), image size, batch, crop range, optimiser, interpolation and [-1, 1] scaling, colour
         jitter off (vit has none), on the CPU; launched through bench/timm_train_pillow13.py, which makes its
         RandAugment's 0-bit posterize black where Pillow 13 refuses it (DeiT's spec draws it)
For each: the seconds from the command to its first training step (`start`, twice: the first builds what
the tool builds, the second reuses what it kept), images/s over the steps after a warm-up, read from the
outside on both sides (the times at which each step's log line appears: metrics.jsonl rows for vit,
train.py's `Train:` lines, both logging every step), and the peak resident memory of the main process and of
each loader worker (VmHWM, `*_peak_mb`; and the most RssAnon seen, `*_anon_mb`: the process's own memory
without the pages of files it maps), sampled from /proc every 0.2 s. With and without one loader worker,
plain and with DeiT's augmentation on both sides (RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25
pixel, Mixup 0.8 / CutMix 1.0, label smoothing 0.1); `--networks` adds ViT-Ti/16 at 224 (the model decides).
`baseline_mb` is what a process that only imports torch and timm peaks at (the CUDA build of torch maps
most of it). `shards`: the same for vit on WebDataset tar shards that `vit prepare-data --shards tar` writes
from a smaller tree (its time and memory too); timm's train.py reads tars only through the `webdataset`
package, not installed here.

    python bench/rehearse.py [--timm-train PATH] [--classes 1000 --per-class 1281 --val-per-class 50]
                             [--steps 60] [--networks quickstart_32,vit_ti16_224] [--only NAMES]
                             [--shard-per-class 32] [--keep DIR] [--out F]
    python bench/rehearse.py --quick     # 1,000 classes x 8 entries, a few steps: checks the script
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from jpegs import write_jpegs  # bench/jpegs.py

from vitcli.runtime.memory import children, peak_rss_mb, status_mb

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
VIT = Path(sys.executable).with_name("vit")
PHOTOS_PER_PICTURE = 30  # x 10 pictures: 300 distinct photographs behind the links

@dataclass(frozen=True)
class Network:
    """A network as each side builds it, with its image size and batch."""

    img: int
    batch: int
    vit: tuple[str, ...]  # overrides of recipes/quickstart/pretrain.yaml
    timm: tuple[str, ...]  # train.py's model arguments


NETWORKS = {
    # the input decides: the quickstart network (recipes/quickstart/pretrain.yaml), built by timm the same
    "quickstart_32": Network(32, 128, (), (
        "--model", "vit_tiny_patch16_224", "--model-kwargs", "img_size=32", "patch_size=4", "embed_dim=64",
        "depth=2", "num_heads=4", "mlp_ratio=2.0")),
    # the model decides: ViT-Ti/16 at 224
    "vit_ti16_224": Network(224, 32, (
        "model.name=custom", "model.img_size=224", "model.patch_size=16", "model.embed_dim=192",
        "model.depth=12", "model.num_heads=3", "model.mlp_dim=768"), ("--model", "vit_tiny_patch16_224")),
}
DEIT_VIT = ["data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.erasing_mode=pixel",
            "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0", "data.mix_switch_prob=0.5",
            "optim.label_smoothing=0.1"]
DEIT_TIMM = ["--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--remode", "pixel", "--mixup", "0.8",
             "--cutmix", "1.0", "--mixup-switch-prob", "0.5", "--smoothing", "0.1"]
SAMPLE_S = 0.2
# a child process below this peak is not a loader worker (a worker imports torch: ~500 MB) but a short helper
# a library starts (a shell, a compiler probe): counted as other_children
WORKER_MB = 100
PILLOW13 = Path(__file__).with_name("timm_train_pillow13.py")  # train.py, its posterize runnable on Pillow 13


def progress(msg: str) -> None:
    print(f"[rehearse {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- the tree ----------------------------------------------------------------------------------------------


def photographs(where: Path) -> list[Path]:
    """A few hundred real photographs at ImageNet's sizes (bench/jpegs.py), written once into `where`."""
    write_jpegs(where, PHOTOS_PER_PICTURE, processes=os.cpu_count() or 1)
    return sorted((where / "train").rglob("*.jpg"))


def build_tree(root: Path, photos: list[Path], classes: int, per_class: int, val_per_class: int) -> dict:
    """ROOT/{train,val}/<wnid>/<wnid>_<i>.JPEG, each a hard link to a photograph (entry k of the tree to
    photo k mod len(photos), so every class holds a mix); returns the counts and the seconds it took."""
    t0, made = time.perf_counter(), 0
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c in range(classes if n else 0):
            wnid = f"n{c:08d}"
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                os.link(photos[made % len(photos)], folder / f"{wnid}_{i}.JPEG")
                made += 1
    return {"classes": classes, "train_per_class": per_class, "val_per_class": val_per_class,
            "entries": made, "distinct_photographs": len(photos),
            "apparent_gb": sum(p.stat().st_size for p in photos) / len(photos) * made / 1e9,
            "build_s": time.perf_counter() - t0}


# --- a command watched from the outside ---------------------------------------------------------------------


@dataclass
class Watched:
    """What was seen of one command: when each training step was first seen, and each process's peak."""

    t0: float
    steps: dict[int, float] = field(default_factory=dict)  # step -> seconds after the command started
    peaks: dict[int, float] = field(default_factory=dict)  # pid -> MiB (VmHWM)
    # pid -> the most RssAnon seen: the process's own memory, without the pages of files it maps (an arrow
    # index, shards being written), which VmHWM counts and the kernel can drop
    anon: dict[int, float] = field(default_factory=dict)
    main_pid: int = 0
    returncode: int | None = None
    tail: list[str] = field(default_factory=list)  # the last lines it printed

    def result(self, batch: int, warmup: int) -> dict:
        """first_step_s; img_s over the steps after `warmup`; the main process's and each worker's peak."""
        seen = sorted(self.steps.items())
        timed = [(s, t) for s, t in seen if s >= warmup]
        img_s = None
        if len(timed) >= 2:
            (s0, t0), (s1, t1) = timed[0], timed[-1]
            img_s = (s1 - s0) * batch / (t1 - t0)
        children = {pid: mb for pid, mb in self.peaks.items() if pid != self.main_pid}
        workers = [pid for pid, mb in children.items() if mb >= WORKER_MB]
        return {"first_step_s": seen[0][1] if seen else None, "img_s": img_s,
                "steps_timed": (timed[-1][0] - timed[0][0]) if len(timed) >= 2 else 0,
                "main_peak_mb": self.peaks.get(self.main_pid), "main_anon_mb": self.anon.get(self.main_pid),
                "worker_peak_mb": sorted((children[p] for p in workers), reverse=True),
                "worker_anon_mb": sorted((self.anon.get(p, 0.0) for p in workers), reverse=True),
                "other_children": len(children) - len(workers), "returncode": self.returncode}


def _tree(pid: int) -> list[int]:
    """A process and all its descendants."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children(p)
    return found


def watch(cmd: list[str], env: dict, steps_seen, until_step: int, timeout: float, log: Path,
          lines: bool = False) -> Watched:
    """Run `cmd` in its own session until `steps_seen(watched)` has seen `until_step` (then kill the whole
    session) or it exits; sample every process's peak memory all along. With `lines`, its output is read
    line by line (timestamped) for `steps_seen` to parse; else it goes to `log`."""
    w = Watched(time.perf_counter())
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE if lines else out,
                                stderr=subprocess.STDOUT, start_new_session=True, text=True, cwd=REPO)
        w.main_pid = proc.pid
        reader = None
        if lines:
            reader = threading.Thread(target=_read_lines, args=(proc, w, steps_seen, out), daemon=True)
            reader.start()
        try:
            while proc.poll() is None and time.perf_counter() - w.t0 < timeout:
                for pid in _tree(proc.pid):
                    peak, anon = peak_rss_mb(pid), status_mb(pid, "RssAnon")
                    if peak is not None:
                        w.peaks[pid] = max(w.peaks.get(pid, 0.0), peak)
                        w.anon[pid] = max(w.anon.get(pid, 0.0), anon or 0.0)
                if not lines:
                    steps_seen(w)
                if w.steps and max(w.steps) >= until_step:
                    break
                time.sleep(SAMPLE_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            w.returncode = proc.wait()
            if reader is not None:
                reader.join(timeout=5)
    w.tail = log.read_text(errors="replace").splitlines()[-15:]
    return w


def _read_lines(proc: subprocess.Popen, w: Watched, steps_seen, out) -> None:
    for line in proc.stdout:
        out.write(line)
        steps_seen(w, line)


# --- the two sides -----------------------------------------------------------------------------------------


def vit_side(root: Path, workdir: Path, workers: int, deit: bool, steps: int, val: bool,
             net: Network = NETWORKS["quickstart_32"]) -> list[str]:
    """`vit pretrain` on the tree as a user types it: the quickstart recipe, the tree as its data."""
    return [str(VIT), "pretrain", "--recipe", str(QUICKSTART), "--workdir", str(workdir), *net.vit,
            f"data.source={root}", "data.train_split=train",
            f"data.val_split={'validation' if val else ''}", "data.test_split=",
            "model.num_classes=0", f"data.num_workers={workers}", "data.crop_min_area=0.08",
            f"data.batch_size={net.batch}", "fewshot.every=0", f"schedule.steps={steps}", "schedule.epochs=0",
            "schedule.warmup_steps=0",
            "run.log_every=1", f"run.ckpt_every={10 * steps}", "run.eval_every=0",
            *(DEIT_VIT if deit else [])]


def vit_steps(workdir: Path):
    """Steps seen in the run's metrics.jsonl (a row per step: run.log_every=1)."""
    path, offset = workdir / "metrics.jsonl", [0]

    def seen(w: Watched) -> None:
        if not path.exists():
            return
        with path.open() as f:
            f.seek(offset[0])
            chunk = f.read()
        done = chunk.rfind("\n") + 1
        offset[0] += len(chunk[:done].encode())
        now = time.perf_counter() - w.t0
        for line in chunk[:done].splitlines():
            step = json.loads(line).get("step")
            if step is not None and "train/loss" in line:
                w.steps.setdefault(step, now)

    return seen


def timm_side(train_py: Path, root: Path, out: Path, workers: int, deit: bool, classes: int, val: bool,
              net: Network = NETWORKS["quickstart_32"]) -> list[str]:
    """timm's train.py on the tree with the network and what vit's side does."""
    return [sys.executable, str(PILLOW13), str(train_py), "--data-dir", str(root), "--train-split", "train",
            "--val-split", "val" if val else "", *net.timm, "--img-size", str(net.img), "-b", str(net.batch),
            "--opt", "adamw", "--lr", "2e-3", "--weight-decay", "0.05", "--epochs", "1",
            "--warmup-epochs", "0", "--workers", str(workers), "--device", "cpu", "--log-interval", "1",
            "--scale", "0.08", "1", "--color-jitter", "0", "--interpolation", "bilinear",
            "--mean", "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5", "--num-classes", str(classes),
            "--output", str(out), *(DEIT_TIMM if deit else [])]


def timm_steps(w: Watched, line: str) -> None:
    """train.py's `Train: EPOCH [ IDX/N ...` line: IDX + 1 updates done."""
    if line.startswith("Train:") and "[" in line:
        idx = int(line.split("[", 1)[1].split("/", 1)[0])
        w.steps.setdefault(idx + 1, time.perf_counter() - w.t0)


# --- the measurement ---------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Where and how long each command runs."""

    root: Path
    scratch: Path
    classes: int
    steps: int
    warmup: int
    timm_train: Path | None
    timeout: float = 1800.0


@dataclass(frozen=True)
class Run:
    """One command's settings."""

    name: str
    workers: int = 0
    deit: bool = False
    steps: int = 1
    val: bool = False
    net: Network = NETWORKS["quickstart_32"]


def run_vit(plan: Plan, run: Run, env: dict) -> dict:
    workdir = plan.scratch / f"vit-{run.name}"
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = vit_side(plan.root, workdir, run.workers, run.deit, run.steps, run.val, run.net)
    w = watch(cmd, env, vit_steps(workdir), run.steps, plan.timeout, plan.scratch / f"vit-{run.name}.log")
    shutil.rmtree(workdir, ignore_errors=True)
    return {**w.result(run.net.batch, plan.warmup), "log_tail": w.tail if not w.steps else []}


def run_timm(plan: Plan, run: Run, env: dict) -> dict:
    out = plan.scratch / f"timm-{run.name}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = timm_side(plan.timm_train, plan.root, out, run.workers, run.deit, plan.classes, run.val, run.net)
    w = watch(cmd, env, timm_steps, run.steps, plan.timeout, plan.scratch / f"timm-{run.name}.log",
              lines=True)
    shutil.rmtree(out, ignore_errors=True)
    return {**w.result(run.net.batch, plan.warmup), "log_tail": w.tail if not w.steps else []}


def environment(plan: Plan) -> dict:
    """Both sides' environment: offline, unbuffered; vit's folder index in the scratch directory (empty for
    the first start, reused after), HF's cache too (its copies of a tar source's evaluation splits)."""
    return {**os.environ, "VITCLI_CACHE": str(plan.scratch / "vit-cache"), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(plan.scratch / "hf"), "PYTHONUNBUFFERED": "1"}


def measure(plan: Plan, runs: list[Run], start: bool) -> dict:
    """With `start`, each side started twice to its first step (the val split included, as a run with
    evaluation starts); then each throughput run on each side, the sides in turn."""
    env = environment(plan)
    sides = {"vit": run_vit, **({"timm": run_timm} if plan.timm_train else {})}
    out = {side: {"start": {}, "train": {}} for side in sides}
    for attempt in ("first", "second") if start else ():
        for side, go in sides.items():
            progress(f"{side}: {attempt} start (to the first step)")
            out[side]["start"][attempt] = go(plan, Run(f"start-{attempt}", val=True), env)
    for run in runs:
        for side, go in sides.items():
            progress(f"{side}: {run.name}, {run.steps} steps")
            out[side]["train"][run.name] = go(plan, run, env)
    if "timm" in out:
        out["ratio"] = {name: _ratio(out["vit"]["train"][name], out["timm"]["train"][name])
                        for name in out["vit"]["train"]}
    return out


def shards(plan: Plan, photos: list[Path], per_class: int, runs: list[Run], env: dict) -> dict:
    """The same figures on WebDataset tar shards, vit's side (timm's train.py reads them only through the
    `webdataset` package): `vit prepare-data --shards tar` of a tree of plan.classes x `per_class` (its
    time and peak memory), then two starts and the throughput runs on the shards."""
    source, out = plan.scratch.parent / "shard-source", plan.scratch.parent / "shards"
    if not (source / "train").is_dir():
        build_tree(source, photos, plan.classes, per_class, 0)
    found = {"images": plan.classes * per_class}
    if not (out / "manifest.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        progress(f"vit prepare-data --shards tar: {found['images']} images")
        cmd = [str(VIT), "prepare-data", str(source), "--out", str(out), "--shards", "tar",
               "--workers", str(os.cpu_count() or 1)]
        w = watch(cmd, env, lambda _: None, 1, plan.timeout * 4, plan.scratch / "prepare.log")
        seconds = time.perf_counter() - w.t0
        found["prepare"] = {"seconds": seconds, "img_s": found["images"] / seconds,
                            **{k: v for k, v in w.result(1, 0).items() if "_mb" in k or k == "returncode"}}
    found["tars"] = len(list(out.glob("*.tar")))
    on_shards = dataclasses.replace(plan, root=out)
    for attempt in ("first", "second"):
        progress(f"vit on tar shards: {attempt} start")
        found.setdefault("start", {})[attempt] = run_vit(on_shards, Run(f"shards-start-{attempt}"), env)
    for run in runs:
        progress(f"vit on tar shards: {run.name}, {run.steps} steps")
        found.setdefault("train", {})[run.name] = run_vit(on_shards, dataclasses.replace(
            run, name=f"shards-{run.name}"), env)
    return found


def _ratio(ours: dict, theirs: dict) -> float | None:
    return ours["img_s"] / theirs["img_s"] if ours["img_s"] and theirs["img_s"] else None


def throughput_runs(networks: list[str], workers: list[int], augs: list[str], steps: int) -> list[Run]:
    """Every (network, workers, augmentation) named `<network>_<aug>_workers<N>`."""
    return [Run(f"{net}_{aug}_workers{w}", w, aug == "deit", steps, False, NETWORKS[net])
            for net in networks for w in workers for aug in augs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timm-train", type=Path, help="timm's train.py (its repository, the installed version)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--per-class", type=int, default=1281)
    p.add_argument("--val-per-class", type=int, default=50)
    p.add_argument("--steps", type=int, default=60, help="training steps of each throughput run")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of img/s")
    p.add_argument("--networks", default="quickstart_32", help=f"of {', '.join(NETWORKS)}")
    p.add_argument("--workers", default="0,1", help="loader workers of the throughput runs")
    p.add_argument("--augmentation", default="plain,deit")
    p.add_argument("--no-start", action="store_true", help="skip the two start measurements")
    p.add_argument("--only", help="of the throughput runs, only these names (<network>_<aug>_workers<N>)")
    p.add_argument("--shard-per-class", type=int, default=32,
                   help="entries per class of the tree made into tar shards (vit prepare-data re-encodes "
                        "every image); 0 skips the shards")
    p.add_argument("--keep", type=Path, help="build the tree here and keep it (else a temporary directory)")
    p.add_argument("--quick", action="store_true", help="1,000 classes x 8 entries, a few steps")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    a = p.parse_args()
    if a.quick:
        a.per_class, a.val_per_class, a.steps, a.warmup, a.workers = 8, 2, 6, 2, "0"
        a.shard_per_class = 2
        a.augmentation = "plain"
    if a.timm_train and not a.timm_train.is_file():
        p.error(f"--timm-train {a.timm_train}: no such file")
    base = a.keep or Path(tempfile.mkdtemp(prefix="rehearse-"))
    try:
        results = rehearse(a, base)
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(results, indent=2) + "\n"
    if a.out:
        a.out.write_text(text)
    sys.stdout.write(text)


def rehearse(a: argparse.Namespace, base: Path) -> dict:
    """Build (or reuse) the tree under `base`, then measure."""
    root, scratch = base / "imagenet", base / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    photos = sorted((base / "photos" / "train").rglob("*.jpg")) or photographs(base / "photos")
    if not (root / "train").is_dir():
        progress(f"tree: {a.classes} classes x {a.per_class} (+ {a.val_per_class} val) hard links")
        tree = build_tree(root, photos, a.classes, a.per_class, a.val_per_class)
        (base / "tree.json").write_text(json.dumps(tree))
    else:  # a kept tree (--keep): what it was built with
        tree = {**json.loads((base / "tree.json").read_text()), "reused": True}
    plan = Plan(root, scratch, a.classes, a.steps, a.warmup, a.timm_train)
    runs = throughput_runs(a.networks.split(","), [int(w) for w in a.workers.split(",")],
                           a.augmentation.split(","), a.steps)
    runs = [r for r in runs if not a.only or r.name in a.only.split(",")]
    results = {"date": time.strftime("%Y-%m-%d"), "machine": _machine(),
               "command": " ".join(["python", *sys.argv]), "tree": tree,
               "timm_side": (f"train.py: {a.timm_train} (through bench/timm_train_pillow13.py: posterize at "
                             "0 bits black, which Pillow 13 refuses)") if a.timm_train else
                            "not run (no --timm-train)",
               "baseline_mb": import_baseline(), **measure(plan, runs, not a.no_start)}
    if a.shard_per_class:
        results["shards"] = shards(plan, photos, a.shard_per_class, runs, environment(plan))
    return {"summary": summary(results), **results}


def summary(results: dict) -> dict:
    """The figures a reader wants, rounded: each side's two starts, images/s of each run (and vit's over
    timm's), and per network the largest peak (VmHWM) and own memory (RssAnon) of any main process and any
    worker of each side (the starts run the quickstart network); the same for the shards."""
    sides = [s for s in ("vit", "timm") if s in results]
    out = {"start_s": {s: _starts(results[s]) for s in sides},
           "img_s": {name: {**{s: _round(results[s]["train"][name]["img_s"]) for s in sides},
                            **({"ratio": _round(results["ratio"][name], 2)} if "ratio" in results else {})}
                     for name in results["vit"]["train"]},
           "memory_mb": {"baseline": round(results["baseline_mb"]),
                         **{s: _memory(results[s]) for s in sides}}}
    if "shards" in results:
        sh = results["shards"]
        out["shards"] = {"images": sh["images"], "tars": sh["tars"],
                         "prepare_img_s": _round(sh.get("prepare", {}).get("img_s")),
                         "start_s": _starts(sh), "memory_mb": _memory(sh),
                         "img_s": {k: _round(v["img_s"]) for k, v in sh["train"].items()}}
    return out


def _starts(side: dict) -> dict:
    return {k: _round(v["first_step_s"]) for k, v in side.get("start", {}).items()}


def _memory(side: dict) -> dict:
    """Per network: the largest of each memory figure over its runs (the starts count as quickstart_32)."""
    by_net: dict[str, list[dict]] = {}
    for name, run in [*(("quickstart_32", r) for r in side.get("start", {}).values()),
                      *side.get("train", {}).items()]:
        by_net.setdefault(next(n for n in NETWORKS if name.startswith(n)), []).append(run)
    return {net: {k: round(max([v for r in runs for v in _as_list(r.get(k))] or [0]))
                  for k in ("main_peak_mb", "main_anon_mb", "worker_peak_mb", "worker_anon_mb")}
            for net, runs in by_net.items()}


def _as_list(v) -> list[float]:
    return [] if v is None else v if isinstance(v, list) else [v]


def _round(v: float | None, digits: int = 1) -> float | None:
    return None if v is None else round(v, digits)


def import_baseline() -> float:
    """The peak resident MiB of a process that only imports what both sides import (torch, timm): what a
    process costs before it holds any data or model (the CUDA build of torch maps much of it)."""
    code = "import resource, torch, timm; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout)


def _machine() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    import timm
    import torch

    return {"cpu": name, "cores": os.cpu_count(), "torch": torch.__version__, "timm": timm.__version__}


if __name__ == "__main__":
    main()
