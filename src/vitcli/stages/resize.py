"""`vit resize-posemb`: the flags to a request for checkpoints.resize, and what changed as a
table."""

from __future__ import annotations

from vitcli.checkpoints.resize import resize_checkpoint
from vitcli.errors import CheckpointError
from vitcli.runtime.metrics import pairs_table, stdout


def parse_grid(text: str) -> tuple[int, int]:
    """`24x16` -> (24, 16); a one-line error for anything that is not a rectangle of positive
    sides."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise CheckpointError(f"--grid {text!r}: expected HxW with positive integers, e.g. 24x24")
    return int(parts[0]), int(parts[1])


def run_resize(src: str, *, out, res, grid, patch, method: str, dry_run: bool,
               old_grid: str | None = None, overwrite: bool = False) -> dict[str, str]:
    """Validate the flags, resize, and show what changed as a table on stdout; return it, what ->
    detail."""
    new_grid = parse_grid(grid) if grid else None
    rows = resize_checkpoint(src, new_grid=new_grid, res=res, patch_size=patch, method=method,
                             old_grid=old_grid or "", out=str(out) if out else None, dry_run=dry_run,
                             overwrite=overwrite)
    stdout.print(pairs_table("resize-posemb", rows))
    return dict(rows)
