"""The tables a command prints on stdout fit the terminal: a long value (train/mfu_skipped's reason,
a path) folds within the width instead of widening the table past it or being cut to `…`."""

import io
import sys
from pathlib import Path

import pytest

from vitcli.run import report as run
from vitcli.runtime import metrics
from vitcli.runtime.metrics import pairs_table, stdout

WHY = "T2T-ViT-7: the analytic count covers plain ViTs (custom and the paper's sizes) only"
PATH = "/data/runs/a-rather-long-experiment-name-20261125-101010/checkpoints/step_000028/model.safetensors"


def printed(monkeypatch, width: int, show) -> list[str]:
    """The lines `show()` prints on stdout at `width` columns."""
    monkeypatch.setattr(stdout, "width", width)
    with stdout.capture() as captured:
        show()
    return captured.get().splitlines()


def cells(lines: list[str]) -> str:
    """What the table's cells hold, its borders and the line breaks inside cells taken out."""
    return "".join(ch for line in lines for ch in line if ch not in "│┃┏┓┗┛┡┩└┘━─╇┳┻┯┷ ")


@pytest.mark.parametrize("width", [50, 80])
def test_the_run_summary_fits_a_narrow_terminal_and_keeps_every_word(monkeypatch, width):
    summary = {"stage": "pretrain", "seconds": 5.0, "train/loss": 0.5123, "train/mfu_skipped": WHY,
               "data/source": PATH, "data/cache_images": 32}
    lines = printed(monkeypatch, width, lambda: run.report(summary, Path("w")))
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert max(map(len, table)) <= width, "\n".join(lines)
    assert "…" not in "".join(lines)
    assert all(word in cells(table) for word in (*WHY.split(), PATH)), "\n".join(lines)
    reason = next(line for line in table if "T2T-ViT-7" in line)
    count = next(line for line in table if "cache_images" in line)
    assert reason.split("│")[2].startswith(" T2T") and count.split("│")[2].endswith("32 "), \
        "words wrap from the left, numbers stay right"


def test_a_pairs_table_folds_a_long_path(monkeypatch):
    lines = printed(monkeypatch, 40, lambda: stdout.print(pairs_table("vit export", [("wrote", PATH)])))
    assert max(map(len, lines)) <= 40 and "…" not in "".join(lines) and PATH in cells(lines), lines


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def fileno(self) -> int:
        return 2


@pytest.mark.parametrize("out_tty, terminal, width", [
    (True, None, None),  # rich measures the terminal itself
    (False, 80, 80),  # `vit ... | tee log`: stderr still shows the terminal the table must fit
    (False, OSError, 160),  # into a file, nothing watching: room, as before
])
def test_the_table_width_is_the_terminals_even_when_stdout_is_piped(monkeypatch, out_tty, terminal, width):
    def size(fd):
        if terminal is OSError:
            raise OSError(25, "Inappropriate ioctl for device")
        return metrics.os.terminal_size((terminal, 24))

    monkeypatch.setattr(sys, "stdout", Stream(out_tty))
    monkeypatch.setattr(sys, "stderr", Stream(False))
    monkeypatch.setattr(metrics.os, "get_terminal_size", size)
    assert metrics.result_width() == width
