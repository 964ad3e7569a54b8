"""A search that prunes against the grid it replaces (issue 47's goal: on the quickstart, a 12-trial
search over optim.lr and optim.weight_decay with pruning reaches the 4 x 3 grid's best validation
top-1 in <= 60% of the grid's training steps).

Both sides are `vit pretrain` as a user types it, each a command in its own process, the two at the
same time (the figure is training steps, which sharing the cores does not change), on
recipes/quickstart/pretrain.yaml as it is (its run.eval_every, the pruner's reports):
  grid     --sweep optim.lr=5e-4,1e-3,2e-3,4e-3 --sweep optim.weight_decay=0.01,0.05,0.2
  search   --search optim.lr=log:5e-4:4e-3 --search optim.weight_decay=log:0.01:0.2 --trials 12
           (the grid's ranges, log-uniform as the grid's values are spaced; the search.* keys at
           their defaults, Optuna's: 10 random trials before TPE, 5 finished before any is pruned)
From each point's metrics.jsonl: the steps it trained (its last logged training step: a pruned
trial's is where it stopped), summed per side; from sweep.json, each side's best val/top1.
  steps_share    search steps / grid steps (the goal: <= 0.6)
  reached        the search's best val/top1 >= the grid's
  steps_to_reach the search's steps, in the order its trials ran, until the first trial that reached
                 the grid's best (null: none did)
  speedup        grid steps / search steps when reached, else 0: the target's figure (>= 1 / 0.6)

    python bench/search.py [--quick] [--out FILE] [--keep DIR]   # ~25 min on 2 free cores
(--keep DIR again: each side skips what it finished, so an interrupted bench goes on where it was)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"
GRID = ["--sweep", "optim.lr=5e-4,1e-3,2e-3,4e-3", "--sweep", "optim.weight_decay=0.01,0.05,0.2"]
SEARCH = ["--search", "optim.lr=log:5e-4:4e-3", "--search", "optim.weight_decay=log:0.01:0.2",
          "--trials", "12"]
# --quick: the script checked in seconds, not the goal (a few steps on a few images, 2 x 2 and 4 trials)
QUICK = ["schedule.epochs=0", "schedule.steps=6", "schedule.warmup_steps=1", "run.eval_every=2",
         "run.log_every=1", "data.synthetic.train_size=64", "data.synthetic.val_size=32",
         "data.synthetic.test_size=32", "data.batch_size=16", "search.prune_after=1"]
QUICK_GRID = ["--sweep", "optim.lr=5e-4,4e-3", "--sweep", "optim.weight_decay=0.01,0.2"]
QUICK_SEARCH = [*SEARCH[:-1], "4"]


def vit_both(sides: dict[str, list[str]]) -> dict[str, tuple[dict, float]]:
    """`vit ARGS --json` of each side, each a process of its own, at the same time: what each printed,
    and its wall-clock seconds. A side whose workdir holds its finished points prints their table."""
    t0, procs, out = time.perf_counter(), {}, {}
    for name, args in sides.items():
        procs[name] = subprocess.Popen([sys.executable, "-m", "vitcli", *args, "--json"], text=True,
                                       stdout=subprocess.PIPE)
    for name, proc in procs.items():
        printed, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"search bench: the {name} exited {proc.returncode}")
        out[name] = (json.loads(printed), time.perf_counter() - t0)
    return out


def trained_steps(point: Path) -> int:
    """The last training step a point's metrics.jsonl logged (0 when it logged none)."""
    rows = [json.loads(line) for line in (point / "metrics.jsonl").read_text().splitlines() if line]
    return max((r["step"] for r in rows if "train/loss" in r), default=0)


def side(workdir: Path, table: dict, seconds: float) -> dict:
    """One side's figures from its table (sweep.json) and its points' metrics.jsonl."""
    points = [{"point": r["point"], "status": r["status"], "val/top1": r.get("val/top1"),
               "steps": trained_steps(workdir / r["point"])} for r in table["points"]]
    best = max((p["val/top1"] for p in points if p["val/top1"] is not None), default=None)
    return {"best_val_top1": best, "steps": sum(p["steps"] for p in points), "seconds": seconds,
            "pruned": sum(p["status"] == "pruned" for p in points), "points": points}


def compare(grid: dict, search: dict) -> dict:
    """The goal's figures (the module docstring)."""
    reached = search["best_val_top1"] is not None and search["best_val_top1"] >= grid["best_val_top1"]
    spent, to_reach = 0, None
    for p in search["points"]:
        spent += p["steps"]
        if to_reach is None and p["val/top1"] is not None and p["val/top1"] >= grid["best_val_top1"]:
            to_reach = spent
    return {"steps_share": search["steps"] / grid["steps"], "reached": reached, "steps_to_reach": to_reach,
            "speedup": grid["steps"] / search["steps"] if reached else 0.0}


def measure(quick: bool, root: Path) -> dict:
    base = ["pretrain", "--recipe", str(QUICKSTART), *(QUICK if quick else [])]
    out = {"command_grid": " ".join(["vit", *base, "--workdir", "GRID", *(QUICK_GRID if quick else GRID)]),
           "command_search": " ".join(["vit", *base, "--workdir", "SEARCH",
                                       *(QUICK_SEARCH if quick else SEARCH)]),
           "load_1min": [os.getloadavg()[0]]}
    print("search bench: the grid and the search, at the same time", file=sys.stderr)
    sides = {"grid": QUICK_GRID if quick else GRID, "search": QUICK_SEARCH if quick else SEARCH}
    ran = vit_both({name: [*base, "--workdir", str(root / name), *extra] for name, extra in sides.items()})
    for name, (table, seconds) in ran.items():
        out[name] = side(root / name, table, seconds)
    out["load_1min"].append(os.getloadavg()[0])
    return {**out, **compare(out["grid"], out["search"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the goal")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--keep", help="run in this folder (kept) instead of a temporary one")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        results = measure(a.quick, Path(a.keep or d))
    text = json.dumps(results, indent=2) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
