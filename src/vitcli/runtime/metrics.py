"""metrics.jsonl (one JSON object per line: `step` plus slash-named metrics) and the live progress
bar."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from vitcli.errors import TrainingError
from vitcli.runtime.files import write_text


def result_width() -> int | None:
    """The width of the tables on stdout: None (rich measures the terminal) when stdout is one; the
    terminal's when stdout is piped but stderr still shows one (`vit ... | tee log`, where a table
    once ran 109 columns wide past an 80-column terminal); else, into a file or a pipe with no
    terminal, 160, where rich would cut tables at 80."""
    if sys.stdout.isatty():
        return None
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns or 160
    # not a terminal, or a stream without a descriptor
    except (OSError, ValueError, AttributeError):
        return 160


# progress and log lines (no source locations: users read these)
console = Console(stderr=True, log_path=False)
# Results a user may pipe: tables and paths
stdout = Console(width=result_width())


class MetricsLog:
    """Append-only metrics file; on resume, rows past the resumed step are dropped so no step
    repeats."""

    def __init__(self, path: Path, resume_step: int = 0, enabled: bool = True, trackers: list | None = None):
        self.path, self.enabled = path, enabled
        self.trackers = trackers or []  # TensorBoard, W&B (trackers.py): each row goes to them too
        if enabled and resume_step and path.exists():
            kept = [ln for ln, row in _parsed_lines(path) if row["step"] <= resume_step]
            # rewritten atomically: a kill now must not take the rows before the resumed step with
            # it
            write_text(path, "".join(ln + "\n" for ln in kept))
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
        for tracker in self.trackers:
            tracker.write(step, {k: v for k, v in row.items() if k != "step" and v is not None})

    def close(self) -> None:
        """Close the trackers (metrics.jsonl is closed after every row)."""
        for tracker in self.trackers:
            tracker.close()


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    return [row for _, row in _parsed_lines(Path(path))]


def _parsed_lines(path: Path) -> list[tuple[str, dict]]:
    """(line, row) for each line; a torn last line (the run was killed mid-write) is dropped
    with a warning."""
    lines = [(n, ln) for n, ln in enumerate(path.read_text(errors="replace").splitlines(), 1) if ln.strip()]
    out = []
    for i, (n, ln) in enumerate(lines):
        try:
            out.append((ln, json.loads(ln)))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line can be cut short by a kill; this is damage
                raise TrainingError(f"{path} line {n} is not JSON; repair or delete that line, "
                                    f"or start over with --no-resume") from None
            console.log(f"[yellow]warning: {path}: dropped its torn last line {n} (a write was cut short)")
    return out


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


def pairs_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column (what, detail) table, no header, for a command's report of what it did (print it
    on `console` for a log, on `stdout` for a result)."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")  # a long path folds within the width, never cut to `…`
    for what, detail in rows:
        table.add_row(what, detail)
    return table
