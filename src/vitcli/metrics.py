"""metrics.jsonl (one JSON object per line: `step` plus slash-named metrics) and the live progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

console = Console(stderr=True)  # progress and log lines
# Results a user may pipe: tables and paths. Piped, rich would cut tables at 80 columns; give them room.
stdout = Console(width=None if sys.stdout.isatty() else 160)


class MetricsLog:
    """Append-only metrics file; on resume, rows past the resumed step are dropped so no step repeats."""

    def __init__(self, path: Path, resume_step: int = 0, enabled: bool = True):
        self.path, self.enabled = path, enabled
        if enabled and resume_step and path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif enabled and not resume_step:
            path.write_text("")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Append one row; non-finite values become null so the file stays valid JSON."""
        if not self.enabled:
            return
        row = {"step": step}
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    return [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]


def progress_bar(enabled: bool) -> Progress:
    """Steps done, loss, lr, images/s and ETA; silent on ranks other than 0."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
        transient=False,
    )
