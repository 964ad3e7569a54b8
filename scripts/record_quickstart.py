"""Record what the quickstart measured, for the docs to quote: docs/measured/quickstart.json.

Reads the runs `make record` leaves in RUNS (`scripts/quickstart.sh --record`: the demo's stages, the
two baselines the docs set them against and `vit evaluate` of the fine-tune) and keeps the figures
README.md, docs/ and the quickstart recipes quote, in the units they quote them (percent, seconds), with
the date the runs finished, the machine (its CPU, its cores and how busy they were) and the source they
ran. `python scripts/quotes.py --write` then rewrites every quote of them.

    python scripts/record_quickstart.py runs/record
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

from vitcli.runtime.run_files import EVALUATE_FILE, FEWSHOT_FILE, METRICS_FILE, SUMMARY_FILE

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "measured" / "quickstart.json"
COMMAND = "make record"  # scripts/quickstart.sh --record into a fresh runs/record, then this script


def percent(fraction: float) -> float:
    """A top-1 as the docs quote it: percent, two decimals kept (the docs round further)."""
    return round(100 * fraction, 2)


def training(workdir: Path) -> dict:
    """A pretrain or finetune run's figures from its summary.json and its first logged training loss. The
    seconds are kept to be read with the machine's load; img/s and MFU, which a busy CPU makes
    meaningless, are not (add them when a record from an idle machine is to be quoted)."""
    summary = json.loads((workdir / SUMMARY_FILE).read_text())
    first = next(row for row in map(json.loads, (workdir / METRICS_FILE).read_text().splitlines())
                 if "train/loss" in row)
    return {"seconds": round(summary["seconds"], 1),
            "train_loss": [round(first["train/loss"], 3), round(summary["train/loss"], 3)],
            "val_top1": percent(summary["val/top1"]), "test_top1": percent(summary["test/top1"]),
            "test_loss": round(summary["test/loss"], 4)}


def fewshot(workdir: Path) -> dict:
    """An eval-fewshot run's mean accuracy (and std over its seeds) per shot count, in percent."""
    rows = json.loads((workdir / FEWSHOT_FILE).read_text())["summary"]
    return {"shots": [r["shots"] for r in rows], "top1": [percent(r["mean"]) for r in rows],
            "std": [percent(r["std"]) for r in rows]}


def evaluation(workdir: Path) -> dict:
    """`vit evaluate`'s top-1 (percent) and loss."""
    results = json.loads((workdir / EVALUATE_FILE).read_text())
    return {"top1": percent(results["top1"]), "loss": round(results["loss"], 4)}


def machine() -> dict:
    """The CPU, its cores, whether it runs bf16 natively, and the load average of the last 15 minutes: the
    runs' when this runs right after them, as `make record` does (above the core count, other processes
    shared the CPU and the seconds are longer than the machine alone would take)."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "unknown")
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in cpuinfo,
            "load_15min": round(os.getloadavg()[2], 1)}


def git(*args: str) -> str:
    """What `git ARGS` prints in the repository; "" outside a git checkout (a tarball), not an error."""
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def source() -> str:
    """The commit that last changed src/ and recipes/, and whether the runs' copy had changes on top:
    lines other than comments (a recipe header's quotes change with every record), or new files."""
    commit = git("log", "-1", "--format=%h", "--", "src", "recipes") or "unknown"
    changed = git("diff", "HEAD", "--name-only", "-G", "^[[:space:]]*[^#[:space:]]", "--", "src", "recipes")
    new = git("ls-files", "--others", "--exclude-standard", "--", "src", "recipes")
    return commit + (" with uncommitted changes" if changed or new else "")


def record(runs: Path) -> dict:
    """The whole record of one `make record`."""
    finished = (runs / "pretrain" / SUMMARY_FILE).stat().st_mtime
    return {
        "what": "the quickstart as make record measured it (make demo's stages, two baselines, vit evaluate "
                "of the fine-tune), quoted by README.md, docs/ and recipes/quickstart/ (scripts/quotes.py); "
                "seconds are wall time, under machine.load_15min",
        "command": COMMAND,
        "date": datetime.datetime.fromtimestamp(finished, datetime.timezone.utc).date().isoformat(),
        "machine": machine(),
        "software": {"vitcli_source": source(), "torch": version("torch"), "timm": version("timm")},
        "pretrain": training(runs / "pretrain"),
        "finetune": training(runs / "finetune"),
        "fewshot": fewshot(runs / "fewshot"),
        "finetune_scratch": training(runs / "finetune_scratch"),
        "fewshot_random_init": fewshot(runs / "fewshot_random_init"),
        "evaluate": evaluation(runs / "evaluate"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="the directory make record ran the quickstart into")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record(args.runs), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
