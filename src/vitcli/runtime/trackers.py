"""Experiment trackers beside metrics.jsonl: TensorBoard event files and Weights & Biases, on rank 0
only.

metrics.jsonl is always written (resume, `vit plot` and the run summary read it); `run.loggers` adds
the others. Both are optional extras (`pip install 'vitcli[tensorboard]'` / `'vitcli[wandb]'`),
imported only when a recipe asks for them, so a plain install carries neither.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rich.markup import escape

from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console
from vitcli.runtime.run_files import TENSORBOARD_DIR, WANDB_DIR, WANDB_ID_FILE


class TensorBoard:
    """Scalars under WORKDIR/tensorboard, one event per metric and step."""

    def __init__(self, workdir: Path, resume_step: int):
        # optional extra: imported only when asked for
        from torch.utils.tensorboard import SummaryWriter

        # like metrics.jsonl on resume: events past the resumed step are purged, so no step repeats
        self.writer = SummaryWriter(str(workdir / TENSORBOARD_DIR),
                                    purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Add one scalar per metric and flush: a killed run keeps every row it logged."""
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class WandB:
    """One W&B run per workdir (resumed runs append to it); offline unless an account is
    configured."""

    def __init__(self, workdir: Path, resume_step: int, config: dict):
        import wandb  # optional extra: imported only when asked for

        id_file = workdir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.exists() else secrets.token_hex(4)
        write_text(id_file, run_id + "\n")
        mode = wandb_mode()
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "vitcli"), name=workdir.name, id=run_id,
                              resume="allow", dir=str(workdir), config=config, mode=mode,
                              # leave our progress bar unwrapped
                              settings=wandb.Settings(console="off"))
        if mode == "offline":
            console.log(f"W&B offline (no account configured): sync later with `wandb sync "
                        f"{escape(str(workdir / WANDB_DIR))}/offline-run-*`")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log one row at `step`."""
        self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run (uploads when online)."""
        self.run.finish()


def wandb_mode() -> str:
    """WANDB_MODE if set; online with an API key (env or ~/.netrc), else offline: never an
    interactive login."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    netrc = Path.home() / ".netrc"
    logged_in = netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace")
    return "online" if os.environ.get("WANDB_API_KEY") or logged_in else "offline"


def open_trackers(names: list[str], workdir: Path, resume_step: int, config: dict) -> list:
    """The trackers `run.loggers` asks for besides jsonl (which MetricsLog writes itself)."""
    trackers = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoard(workdir, resume_step))
        elif name == "wandb":
            trackers.append(WandB(workdir, resume_step, config))
    return trackers
