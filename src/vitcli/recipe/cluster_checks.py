"""The slurm section's values, checked at resolve time without torch (so `--slurm --dry-run` refuses
what sbatch would), and SLURM's time-limit format read into seconds (preflight's requeue count uses
it too)."""

from __future__ import annotations

import dataclasses
import re
import unicodedata

from vitcli.errors import RecipeError
from vitcli.recipe.schema import SlurmConfig

# sbatch --time: "minutes", "minutes:seconds", "hours:minutes:seconds", "days-hours",
# "days-hours:minutes" and "days-hours:minutes:seconds" (sbatch(1)); INFINITE/UNLIMITED for no limit
_DAYS = re.compile(r"^(\d+)-(\d+)(?::(\d+))?(?::(\d+))?$")
_CLOCK = re.compile(r"^(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM = re.compile(r"^\d+[KMGT]?$")


def time_limit_seconds(text: str) -> int:
    """sbatch's --time in seconds: `90` -> 5400, `1:30:00` -> 5400, `2-12` -> 216000; 0 for "" (the
    partition's limit, unknown here) and for INFINITE / UNLIMITED."""
    text = text.strip()
    if text.upper() in ("", "INFINITE", "UNLIMITED"):
        return 0
    days = _DAYS.fullmatch(text)
    if days:
        d, h, m, s = (int(g or 0) for g in days.groups())
        return ((d * 24 + h) * 60 + m) * 60 + s
    clock = _CLOCK.fullmatch(text)
    if not clock:
        raise RecipeError(f"slurm.time: {text!r} is not a SLURM time limit (minutes, MM:SS, HH:MM:SS, "
                          "D-HH, D-HH:MM or D-HH:MM:SS)")
    parts = [int(g) for g in clock.groups() if g is not None]
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def time_limit_text(seconds: int) -> str:
    """`seconds` as sbatch's --time, rounded up to a whole minute: 180 -> "0:03:00", 93_600 ->
    "1-2:00:00" (time_limit_seconds reads it back)."""
    minutes = -(-seconds // 60)
    days, minutes = divmod(minutes, 24 * 60)
    clock = f"{minutes // 60}:{minutes % 60:02d}:00"
    return f"{days}-{clock}" if days else clock


def control_character(text: str) -> str | None:
    """The first control character in `text` (newline, CR, NUL, tab, ESC, ...; a Unicode line or
    paragraph separator too), as repr shows it; None when there is none. A value written into the
    batch script must keep to its line: after a newline the rest would run on the compute node as a
    shell line of its own."""
    for char in text:
        if unicodedata.category(char) in ("Cc", "Zl", "Zp"):
            return repr(char)
    return None


def check_one_line(cfg: SlurmConfig) -> None:
    """Every text the slurm section writes into the batch script (each #SBATCH value, each extra
    line) without a control character."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        for i, text in enumerate(value if isinstance(value, list) else [value]):
            found = control_character(text) if isinstance(text, str) else None
            if found:
                where = f"slurm.{f.name}[{i}]" if isinstance(value, list) else f"slurm.{f.name}"
                raise RecipeError(f"{where}: {text!r} holds the control character {found}; it is written "
                                  "into the batch script, where each value keeps to its line: remove it")


def check_slurm(cfg: SlurmConfig) -> None:
    """Counts at least 1 (0 where it means "none" or "the default"), no more processes on a node
    than GPUs, every text on one line, a time limit and memory sbatch reads, and a warning that fits
    inside the time limit."""
    check_one_line(cfg)
    for key in ("nodes", "gpus_per_node", "procs_per_node", "cpus_per_task", "signal_seconds", "max_requeues",
                "array_parallel", "max_restarts"):
        value, least = getattr(cfg, key), 1 if key == "nodes" else 0
        if value < least:
            raise RecipeError(f"slurm.{key} must be at least {least}, got {value}")
    if cfg.gpus_per_node and cfg.procs_per_node > cfg.gpus_per_node:  # each process takes one GPU
        raise RecipeError(f"slurm.procs_per_node={cfg.procs_per_node} is more than slurm.gpus_per_node="
                          f"{cfg.gpus_per_node}: each process on a node takes a GPU of its own; ask for "
                          "more GPUs, or leave slurm.procs_per_node=0 (one process per GPU)")
    if not 1 <= cfg.port <= 65535:
        raise RecipeError(f"slurm.port must be a TCP port (1-65535), got {cfg.port}")
    if cfg.mem and not _MEM.fullmatch(cfg.mem.upper()):
        raise RecipeError(f"slurm.mem: {cfg.mem!r} is not what sbatch --mem takes (a number with K, M, G "
                          "or T, e.g. 500G; 0 = all of a node's)")
    limit = time_limit_seconds(cfg.time)
    if limit and cfg.signal_seconds >= limit:
        raise RecipeError(f"slurm.signal_seconds={cfg.signal_seconds} is not inside slurm.time={cfg.time} "
                          f"({limit} s): the warning would come before the run starts")
    for line in cfg.extra:
        if not line.startswith("-"):
            raise RecipeError(f"slurm.extra: {line!r} is not an sbatch option (write it as --exclusive, "
                              "--mail-type=END, ...)")


def procs_per_node(cfg: SlurmConfig) -> int:
    """torchrun's --nproc-per-node: slurm.procs_per_node, else one process per GPU, else one."""
    return cfg.procs_per_node or cfg.gpus_per_node or 1
