"""A finished run's numbers as a table, and how every table of the stages writes a number."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_files import MODEL_FILE


def report(summary: dict, workdir: Path) -> None:
    """Print the final numbers as a table."""
    table = Table(title=f"{summary['stage']} finished in {summary['seconds']:.0f} s", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right", overflow="fold")
    for k, v in summary.items():
        if "/" in k:
            table.add_row(k, _cell(v))
    stdout.print(table)
    stdout.print(f"weights: {workdir / MODEL_FILE}")


def _cell(v) -> str | Text:
    """Numbers to the right; words (train/mfu_skipped's reason) wrap from the left."""
    if isinstance(v, float):
        return number(v)
    return Text(v, justify="left") if isinstance(v, str) else str(v)


def number(v: float) -> str:
    """4 decimals, but small and large values (a final learning rate of 3e-6, a peak of 9.89e+14
    FLOP/s) in 3 significant digits, not `0.0000`."""
    return f"{v:.3g}" if v and not 1e-3 <= abs(v) < 1e6 else f"{v:.4f}"
