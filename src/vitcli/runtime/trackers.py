"""Experiment trackers beside metrics.jsonl: TensorBoard event files, Weights & Biases, MLflow
(trackers_mlflow.py) and trackio, on rank 0 only.

metrics.jsonl is always written (resume, `vit plot` and the run summary read it); `run.loggers` adds
the others. Each is an optional extra (`pip install 'vitcli[tensorboard]'`, `[wandb]`, `[mlflow]`,
`[trackio]`), imported only when a recipe asks for it, so a plain install carries none. docs/tracking.md
says what each keeps and how a resumed run continues its tracked run.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import re
import secrets
from pathlib import Path

from rich.markup import escape

from vitcli.errors import first_line
from vitcli.recipe.schema import RunConfig
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console
from vitcli.runtime.run_files import (
    RECIPE_FILE,
    SUMMARY_FILE,
    TENSORBOARD_DIR,
    TRACKIO_ID_FILE,
    WANDB_DIR,
    WANDB_ID_FILE,
)
from vitcli.runtime.trackers_mlflow import (
    DEFAULT_EXPERIMENT,
    MLflow,
    check_reachable,
    finish_run,
    flat_params,
)


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


class Trackio:
    """One trackio run per workdir in trackio's local store (TRACKIO_DIR, else ~/.cache/huggingface/
    trackio); a resumed run continues it, without the steps the store holds already. Never a
    dashboard nor a browser: `trackio show` opens one."""

    def __init__(self, workdir: Path, resume_step: int, config: dict, project: str):
        import trackio  # optional extra: imported only when asked for
        from trackio.sqlite_storage import SQLiteStorage

        id_file = workdir / TRACKIO_ID_FILE
        resumed = bool(resume_step) and id_file.exists()
        # a name of its own: two workdirs named alike (runs/a/pretrain, runs/b/pretrain) stay apart
        name = id_file.read_text().strip() if resumed else f"{workdir.name}-{secrets.token_hex(3)}"
        write_text(id_file, name + "\n")
        self.project = trackio_project(project)
        self.run = open_trackio(self.project, name, "allow" if resumed else "never",
                                config=flat_params(config))
        self.trackio, self.closed = trackio, False
        # registered after trackio's own exit hook, so it runs first: a run stopped before its end
        # is finished here, quietly, and trackio's hook finds nothing to print on stdout about
        atexit.register(self.close)
        held = SQLiteStorage.get_last_step(self.project, run=name) if resumed else None
        self.skip_to = -1 if held is None else held  # a killed run's steps past the checkpoint
        console.log(f"trackio: run {escape(name)} in project {escape(self.project)} "
                    f"(`trackio show --project {escape(self.project)}`)")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log one row at `step`, unless the store holds that step already."""
        if step > self.skip_to:
            self.run.log(metrics, step=step)

    def close(self) -> None:
        """Finish the run (its rows flushed to the store), once."""
        if self.closed:
            return
        self.closed = True
        # trackio's own finish, which also forgets the run: its exit hook would finish it again,
        # printing on stdout
        with contextlib.redirect_stdout(io.StringIO()):
            self.trackio.finish()


def trackio_project(experiment: str) -> str:
    """run.experiment, else "vitcli"."""
    return experiment or DEFAULT_EXPERIMENT


def open_trackio(project: str, name: str, resume: str, config: dict | None = None):
    """trackio's run: no dashboard, no browser, none of its own CPU or GPU sampling, and its banner
    kept off stdout (which `--json` keeps for the result)."""
    import trackio  # optional extra: imported only when asked for

    with contextlib.redirect_stdout(io.StringIO()):
        return trackio.init(project=project, name=name, config=config, resume=resume, embed=False,
                            auto_log_cpu=False, auto_log_gpu=False)


def finish_trackio(workdir: Path, experiment: str) -> None:
    """After summary.json and the figures are written: they and recipe.yaml as one artefact of the
    trackio run (`<run>-files`). A failure is a warning: the run is done, its files are in the
    workdir."""
    import trackio  # optional extra: imported only when asked for

    try:
        name = (workdir / TRACKIO_ID_FILE).read_text().strip()
        run = open_trackio(trackio_project(experiment), name, "must")
        files = trackio.Artifact(re.sub(r"[^A-Za-z0-9._-]", "-", name) + "-files", type="run")
        for path in [*sorted(workdir.glob("*.png")), workdir / SUMMARY_FILE, workdir / RECIPE_FILE]:
            if path.is_file():
                files.add_file(path)
        with contextlib.redirect_stdout(io.StringIO()):
            run.log_artifact(files)
            trackio.finish()
    except Exception as e:  # noqa: BLE001 - the store's own errors: the run is done all the same
        console.log(f"[yellow]warning: trackio: the run's files were not kept "
                    f"({escape(first_line(e, named=True))}); they are in {escape(str(workdir))}")


def check_trackers(run: RunConfig) -> None:
    """Before anything is written: a TrackingError when a tracker's server does not answer."""
    if "mlflow" in run.loggers:
        check_reachable(run.mlflow_uri)


def open_trackers(run: RunConfig, workdir: Path, resume_step: int, config: dict) -> list:
    """The trackers `run.loggers` asks for besides jsonl (which MetricsLog writes itself)."""
    trackers = []
    for name in run.loggers:
        if name == "tensorboard":
            trackers.append(TensorBoard(workdir, resume_step))
        elif name == "wandb":
            trackers.append(WandB(workdir, resume_step, config))
        elif name == "mlflow":
            trackers.append(MLflow(workdir, resume_step, config, run.mlflow_uri, run.experiment))
        elif name == "trackio":
            trackers.append(Trackio(workdir, resume_step, config, run.experiment))
    return trackers


def finish_trackers(run: RunConfig, workdir: Path) -> None:
    """After summary.json and the figures are written (rank 0): the trackers that keep files take
    them (MLflow's artefacts, trackio's)."""
    if "mlflow" in run.loggers:
        finish_run(workdir, run.mlflow_uri)
    if "trackio" in run.loggers:
        finish_trackio(workdir, run.experiment)
