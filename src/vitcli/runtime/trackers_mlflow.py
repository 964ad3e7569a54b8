"""MLflow beside metrics.jsonl (run.loggers=[mlflow]), on rank 0: the resolved recipe as dotted
parameters, each metrics.jsonl row as it is written, the figures, summary.json and recipe.yaml as
artefacts at the end; the run id in WORKDIR/mlflow_id, so a resumed run (Ctrl-C, SIGKILL, a SLURM
requeue) continues the same MLflow run.

One value per step, equal to metrics.jsonl, whatever killed the run. MLflow's client cannot delete a
metric's point once logged, so nothing goes to MLflow that a resumed run would log differently:
- the steps past the resumed checkpoint that the killed run logged already are not logged again
  (per metric, steps up to the last one MLflow held at the start are skipped). The values MLflow
  holds for them are the rerun's, bit for bit: a resume is deterministic (checkpoints.manager),
  for every metric but those that time the run;
- those (MEASURED: images per second, the share spent waiting for data) are not logged live: the
  end of the run, a resume for the rows before its checkpoint, and the exit of a run stopped early
  for the rows up to its newest checkpoint, send them from metrics.jsonl, final there by then;
- at the end, and at a resume, every (metric, step) of metrics.jsonl that MLflow lacks is sent: the
  rows missed while the server was away, or by a kill between a row's two writes.
A rollback past a loss spike (train/rollback.py) replays steps with other batches: those are logged
again (MLflow then holds both: the thrown-away steps are the spike's story, metrics.jsonl drops
them).

A server that does not answer at the start is a TrackingError before anything is written
(check_reachable, from the run's start); one that stops answering mid-run is one warning, the run
goes on (metrics.jsonl is the record), and it is tried again every RETRY_S seconds.
"""

from __future__ import annotations

import atexit
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from rich.markup import escape

from vitcli.errors import TrackingError, VitcliError, first_line
from vitcli.runtime.files import write_text
from vitcli.runtime.metrics import console, read_metrics
from vitcli.runtime.run_dir import newest_step
from vitcli.runtime.run_files import METRICS_FILE, MLFLOW_ID_FILE, RECIPE_FILE, SUMMARY_FILE

# metrics.jsonl's metrics that time the run (train/loop.py's _log): a rerun of a step measures anew
MEASURED = frozenset({"train/img_per_s", "train/data_wait"})
# MLflow's own limits (mlflow.utils.validation): per log_batch, and a parameter's characters
PARAMS_PER_BATCH, METRICS_PER_BATCH, PARAM_CHARS = 100, 1000, 6000
PROBE_S = 5.0  # the start's wait for /health: a dead host fails the run in seconds, not minutes
# MLflow's client retries a request 7 times over minutes and waits 120 s for an answer by default:
# here a failed request is retried by the tracker itself, every RETRY_S, while training goes on
REQUEST_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
RETRY_S = 60.0
ROLLBACK_KEY = "rollback/from_step"  # the row train/rollback.py writes where it went back to
DEFAULT_EXPERIMENT = "vitcli"


def tracking_uri(uri: str) -> str:
    """run.mlflow_uri, else MLFLOW_TRACKING_URI; "" for MLflow's own default (./mlflow.db)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI", "")


def experiment_name(name: str) -> str:
    """run.experiment, else MLFLOW_EXPERIMENT_NAME, else "vitcli"."""
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME", "") or DEFAULT_EXPERIMENT


def check_reachable(uri: str) -> None:
    """A TrackingError within PROBE_S seconds when the tracking server (an http(s) URI) does not
    answer its /health; a local store (a path, sqlite://) MLflow creates itself."""
    uri = tracking_uri(uri)
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_S) as answer:
            answer.read()
    except (OSError, ValueError) as e:  # refused, unknown host, timed out, an HTTP error status
        why = e.reason if type(e) is urllib.error.URLError else e  # "[Errno 111] Connection refused"
        raise TrackingError(f"MLflow tracking server {uri} does not answer ({first_line(why)}): start it, "
                            f"or fix run.mlflow_uri / MLFLOW_TRACKING_URI, or drop mlflow from "
                            f"run.loggers") from None


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The recipe as MLflow parameters: nested keys dotted (`optim.lr`), values as text (lists as
    JSON), cut to MLflow's PARAM_CHARS."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
            continue
        text = json.dumps(value) if isinstance(value, list | dict) else str(value)
        out[name] = text if len(text) <= PARAM_CHARS else text[:PARAM_CHARS - 1] + "…"
    return out


def chunks(items: list, size: int) -> list[list]:
    """`items` in lists of at most `size` (MLflow's batch limits)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


class MLflow:
    """One MLflow run per workdir; a resumed run continues it, each (metric, step) logged once."""

    def __init__(self, workdir: Path, resume_step: int, config: dict, uri: str, experiment: str):
        for var, value in REQUEST_ENV.items():  # a user's own settings win
            os.environ.setdefault(var, value)
        # optional extra: imported only when asked for
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric, self.workdir = Metric, workdir
        self.uri, self.down_since = tracking_uri(uri) or "MLflow's default store", None
        self.closed = False
        try:
            self.client = MlflowClient(tracking_uri=tracking_uri(uri) or None)
            self.uri = self.client.tracking_uri  # MLflow's default made explicit (sqlite:///...)
            self.run_id = self._open_run(resume_step, experiment_name(experiment))
            self._log_params([Param(k, v) for k, v in flat_params(config).items()])
            held = self._held()
            # per metric, the steps a killed run logged past the resumed checkpoint are not logged again
            self.skip_to = {key: max(steps) for key, steps in held.items() if steps}
            if resume_step:  # rows MLflow missed before the checkpoint, the timed ones among them
                self._sync([r for r in read_metrics_or_none(workdir) if r["step"] <= resume_step], held)
            where = self._where()
            atexit.register(self._at_exit)  # a run stopped before its end (Ctrl-C, SIGTERM, an error)
        except VitcliError:  # a damaged metrics.jsonl says so itself
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the service: the run cannot track
            raise TrackingError(f"MLflow at {self.uri}: {first_line(e, named=True)}; fix it or drop "
                                f"mlflow from run.loggers") from None
        console.log(f"MLflow: {escape(where)}")

    def _where(self) -> str:
        """The run's page in MLflow's UI for a server, else the run id and the store."""
        if not self.uri.startswith(("http://", "https://")):
            return f"run {self.run_id} in {self.uri}"
        experiment = self.client.get_run(self.run_id).info.experiment_id
        return f"{self.uri.rstrip('/')}/#/experiments/{experiment}/runs/{self.run_id}"

    def _open_run(self, resume_step: int, experiment: str) -> str:
        """The run id in WORKDIR/mlflow_id when resuming and MLflow still has it, else a new run's
        (written there)."""
        id_file = self.workdir / MLFLOW_ID_FILE
        run_id = id_file.read_text().strip() if resume_step and id_file.exists() else ""
        if run_id and self._active(run_id):
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        if run_id:
            console.log(f"[yellow]warning: MLflow run {run_id} ({id_file}) is not at {escape(self.uri)} "
                        f"(deleted, or another store): this run starts a new one")
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=self.workdir.name,
                                     tags={"vitcli.workdir": str(self.workdir.resolve())})
        write_text(id_file, run.info.run_id + "\n")
        return run.info.run_id

    def _active(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _log_params(self, params: list) -> None:
        """The parameters MLflow does not hold yet (they cannot change once logged: a resumed run
        whose resumable keys changed keeps the first values there, and says which)."""
        have = self.client.get_run(self.run_id).data.params
        for chunk in chunks([p for p in params if p.key not in have], PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)
        changed = sorted(p.key for p in params if p.key in have and have[p.key] != p.value)
        if changed:
            console.log(f"MLflow keeps the first values of {', '.join(changed)} (parameters cannot "
                        f"change); recipe.yaml holds this run's")

    def _held(self) -> dict[str, set[int]]:
        """The steps MLflow holds, by metric."""
        keys = self.client.get_run(self.run_id).data.metrics
        return {key: {m.step for m in self.client.get_metric_history(self.run_id, key)} for key in keys}

    def _sync(self, rows: list[dict], held: dict[str, set[int]]) -> None:
        """Send each (metric, step) of `rows` (metrics.jsonl's) that MLflow does not hold."""
        now = int(time.time() * 1000)
        missing = [self.metric(k, v, now, row["step"]) for row in rows for k, v in row.items()
                   if k != "step" and v is not None and row["step"] not in held.get(k, ())]
        for chunk in chunks(missing, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log one row's metrics at `step` (not the timed ones, nor a step a killed run logged);
        while the server is away, one warning, and a new try every RETRY_S."""
        if ROLLBACK_KEY in metrics:  # a rollback's row: its replayed steps are logged (docstring)
            self.skip_to = {}
        if self.down_since is not None and time.monotonic() - self.down_since < RETRY_S:
            return
        now = int(time.time() * 1000)
        points = [self.metric(k, v, now, step) for k, v in metrics.items()
                  if k not in MEASURED and step > self.skip_to.get(k, -1)]
        try:
            for chunk in chunks(points, METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=chunk)
        except Exception as e:  # noqa: BLE001 - the service failed: the run goes on
            self._away(e)
            return
        if self.down_since is not None:
            console.log(f"MLflow at {escape(self.uri)} answers again (step {step}); the rows it "
                        f"missed are sent at the end")
            self.down_since = None

    def _away(self, error: Exception) -> None:
        if self.down_since is None:
            console.log(f"[yellow]warning: MLflow at {escape(self.uri)} stopped answering "
                        f"({escape(first_line(error, named=True))}); training goes on, metrics.jsonl "
                        f"keeps every row; tried again every {RETRY_S:.0f} s, the rows missed sent "
                        f"at the end")
        self.down_since = time.monotonic()

    def close(self) -> None:
        """Send what MLflow lacks of metrics.jsonl (the timed metrics, the rows missed)."""
        self.closed = True
        try:
            self._sync(read_metrics_or_none(self.workdir), self._held())
        except Exception as e:  # noqa: BLE001
            console.log(f"[yellow]warning: MLflow at {escape(self.uri)}: the end's metrics were not "
                        f"sent ({escape(first_line(e, named=True))}); metrics.jsonl holds them all")


    def _at_exit(self) -> None:
        """At the exit of a run that stopped before its end (Ctrl-C and SIGTERM write a checkpoint
        first): what MLflow lacks of metrics.jsonl up to the newest checkpoint sent, those rows being
        final (a resume starts there), and the run marked KILLED (a resume marks it running again).
        Nothing after close(), nor while the server is away: the exit is not held up."""
        if self.closed or self.down_since is not None:
            return
        try:
            last = newest_step(self.workdir)
            self._sync([r for r in read_metrics_or_none(self.workdir) if r["step"] <= last], self._held())
            self.client.set_terminated(self.run_id, "KILLED")
        except Exception:  # noqa: BLE001 - exiting: metrics.jsonl holds them, a resume sends them
            return


def finish_run(workdir: Path, uri: str) -> None:
    """After summary.json and the curves are written (rank 0): they, recipe.yaml and every figure of
    the workdir as the artefacts of the run WORKDIR/mlflow_id names; the run marked finished. A
    failure is a warning: the run is done, its files are in the workdir."""
    from mlflow.tracking import MlflowClient  # optional extra: imported only when asked for

    where = tracking_uri(uri) or "MLflow's default store"
    try:
        client = MlflowClient(tracking_uri=tracking_uri(uri) or None)
        where = client.tracking_uri
        run_id = (workdir / MLFLOW_ID_FILE).read_text().strip()
        for path in [*sorted(workdir.glob("*.png")), workdir / SUMMARY_FILE, workdir / RECIPE_FILE]:
            if path.is_file():
                client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, "FINISHED")
    except Exception as e:  # noqa: BLE001 - the service failed: the run is done all the same
        console.log(f"[yellow]warning: MLflow at {escape(where)}: the artefacts were not sent "
                    f"({escape(first_line(e, named=True))}); they are in {escape(str(workdir))}")


def read_metrics_or_none(workdir: Path) -> list[dict]:
    """metrics.jsonl's rows, none if it is not there."""
    path = workdir / METRICS_FILE
    return read_metrics(path) if path.exists() else []
