"""`vit plot`: the training curves of one or more workdirs in one PNG (figures/curves.py draws
them)."""

from __future__ import annotations

from pathlib import Path

from vitcli.errors import OutputError
from vitcli.figures.curves import curves_figure, loss_name, read_run, run_labels
from vitcli.figures.figure7 import save_figure
from vitcli.runtime.metrics import stdout
from vitcli.runtime.run_files import CURVES_FILE
from vitcli.runtime.workdir import check_output_file


def plot(workdirs: list[Path], out: Path | None = None) -> Path:
    """All runs' curves in one PNG, by default WORKDIR/curves.png for one run, ./curves.png for
    several; returns where it went."""
    if not workdirs:
        raise OutputError("name at least one workdir")
    out = out or (Path(workdirs[0]) / CURVES_FILE if len(workdirs) == 1 else Path(CURVES_FILE))
    if out.suffix.lower() != ".png":  # it writes PNG bytes whatever the name says
        raise OutputError(f"--out {out}: vit plot writes a PNG; name a .png file, e.g. "
                          f"{out.with_suffix('.png')}")
    check_output_file(out, "--out")
    labels = run_labels(workdirs)
    runs = dict(zip(labels, (read_run(w) for w in workdirs)))
    save_figure(curves_figure(runs, dict(zip(labels, map(loss_name, workdirs)))), out)
    stdout.print(f"wrote {out}", highlight=False)
    return out
