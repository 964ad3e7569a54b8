"""`make bench-startup`: how long `vit` takes to answer, as whole processes (interpreter start included).

Each command runs `--runs` times (default 5) in a fresh process; the JSON on stdout holds the median wall time
and the median peak RSS of each, and whether the misspelt key is reported in under `TARGET_S` (issue 19: it
took 4.7 s and 850 MB when torch, timm and datasets were imported before the recipe was checked).

    python bench/startup.py            # median of 5 runs of each command
    python bench/startup.py --runs 1   # one run each, to check the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 1.0  # a misspelt key reported in under a second
QUICKSTART = "recipes/quickstart/pretrain.yaml"
COMMANDS = {  # name -> (arguments, the exit code it must give)
    "help": (["--help"], 0),
    "misspelt_key": (["pretrain", "--dry-run", "model.nmae=x"], 2),
    "dry_run_quickstart": (["pretrain", "--dry-run", "-r", QUICKSTART], 0),
    "version": (["--version"], 0),
    "env": (["env"], 0),  # imports torch to ask it what it sees: `import_torch` below is its floor
}
# not vit: what a command that needs torch pays before it does anything
IMPORT_TORCH = [sys.executable, "-c", "import torch"]


def vit() -> list[str]:
    """The installed `vit` beside this interpreter, else the module itself."""
    script = Path(sys.executable).parent / "vit"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "vitcli.cli"]


def once(args: list[str], code: int, program: list[str] | None = None) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one `vit ARGS` process (`program ARGS`), which must exit with
    `code`."""
    t0 = time.perf_counter()
    argv = [*(vit() if program is None else program), *args]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    got = os.waitstatus_to_exitcode(status)
    proc.returncode = got  # reaped by wait4: tell Popen, so it does not wait again
    if got != code:
        raise SystemExit(f"vit {' '.join(args)} exited {got}, expected {code}: {proc.stderr.read().decode()}")
    proc.stderr.close()
    return seconds, usage.ru_maxrss / 1024  # Linux: KiB


def measure(runs: int) -> dict:
    """Median seconds and peak RSS of every command over `runs` fresh processes."""
    out: dict = {"runs": runs, "python": sys.version.split()[0], "cpus": os.cpu_count()}
    for name, (args, code) in COMMANDS.items():
        samples = [once(args, code) for _ in range(runs)]
        out[name] = {"command": "vit " + " ".join(args),
                     "median_s": round(statistics.median(s for s, _ in samples), 3),
                     "peak_rss_mb": round(statistics.median(m for _, m in samples), 1)}
        print(f"{name}: {out[name]['median_s']} s", file=sys.stderr)
    samples = [once([], 0, IMPORT_TORCH) for _ in range(runs)]
    out["import_torch"] = {"command": " ".join(IMPORT_TORCH[1:]),
                           "median_s": round(statistics.median(s for s, _ in samples), 3)}
    out["targets"] = {"misspelt_key_under_1s": out["misspelt_key"]["median_s"] < TARGET_S}
    return out


def main() -> None:
    """Parse --runs, measure, print one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    print(json.dumps(measure(parser.parse_args().runs), indent=2))


if __name__ == "__main__":
    main()
