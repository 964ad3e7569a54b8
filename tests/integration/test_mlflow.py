"""run.loggers=[mlflow] against a real MLflow tracking server (`mlflow server` on localhost, one for
the module), read back through MLflow's own client: one value per step equal to metrics.jsonl,
the recipe as dotted parameters, the figures and summary.json as artefacts; a SIGKILLed run resumed
by the same command still has one value per step; a server that does not answer at the start is one
line before anything is written, one that goes away mid-run a warning."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient
from test_trackers import TINY  # the same tiny run the other trackers log

from helpers import REPO, kill_tree, refused, run_vit, warnings
from vitcli.errors import Interrupted
from vitcli.recipe.resolve import resolve
from vitcli.runtime import trackers_mlflow
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import MLFLOW_ID_FILE
from vitcli.stages.run import one_run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(uri + "/health", timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`mlflow server` with a SQLite store and proxied artefacts in a temporary folder; its URI."""
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"http://127.0.0.1:{free_port()}"
    # its job runner is a second process nothing here uses: off, for the start-up's sake
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(root / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", uri.rsplit(":", 1)[1],
             "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination",
             str(root / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not healthy(uri):
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 150 s"
            time.sleep(0.2)
        yield uri
    finally:
        kill_tree(proc.pid)
        proc.wait()


def tracked(server: str, workdir) -> tuple[MlflowClient, str]:
    return MlflowClient(tracking_uri=server), (workdir / MLFLOW_ID_FILE).read_text().strip()


def histories(client: MlflowClient, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric's (step, value) points as MLflow holds them, sorted."""
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}


def jsonl_points(workdir) -> dict[str, list[tuple[int, float]]]:
    points: dict[str, list] = {}
    for row in read_metrics(workdir / "metrics.jsonl"):
        for k, v in row.items():
            if k != "step" and v is not None:
                points.setdefault(k, []).append((row["step"], v))
    return {k: sorted(v) for k, v in points.items()}


def test_a_run_keeps_its_rows_parameters_and_figures_in_mlflow(server, tmp_path):
    r = resolve("pretrain", None, [*TINY, "schedule.steps=4", "run.loggers=jsonl,mlflow",
                                   f"run.mlflow_uri={server}", "run.experiment=vit-tests"])
    one_run(r, tmp_path)
    client, run_id = tracked(server, tmp_path)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "vit-tests"
    got = histories(client, run_id)
    assert got == jsonl_points(tmp_path)  # every step once, the very values of metrics.jsonl
    assert {"train/loss", "train/img_per_s", "test/top1"} <= set(got)
    params = run.data.params
    assert params["optim.lr"] == str(r.optim.lr)
    assert params["model.embed_dim"] == "32" and params["data.synthetic.num_classes"] == "4"
    assert params["run.loggers"] == '["jsonl", "mlflow"]'
    artefacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"curves.png", "summary.json", "recipe.yaml"} <= artefacts


def test_a_sigkilled_run_resumed_logs_each_step_once(server, tmp_path, monkeypatch, capsys):
    """SIGKILL after step 7 of 12 (mid-epoch: 8 steps an epoch) of the quickstart's network, the
    checkpoint at 4: MLflow holds steps the resumed run trains again; the same command then leaves
    one value per step, metrics.jsonl's. The killed run is a process of its own; the same command
    runs again here (cli.main), saving a process's start-up (~18 s of imports on a busy 2-core
    machine)."""
    args = ["pretrain", "--recipe", str(REPO / "recipes/quickstart/pretrain.yaml"), "--workdir",
            str(tmp_path), "data.synthetic.train_size=256", "data.batch_size=32",
            "data.synthetic.val_size=64", "data.synthetic.test_size=64", "schedule.steps=12",
            "schedule.warmup_steps=2", "run.log_every=1", "run.ckpt_every=4", "run.eval_every=6",
            "run.ckpt_async=false", "run.loggers=[jsonl,mlflow]", f"run.mlflow_uri={server}"]
    monkeypatch.setenv("VITCLI_FAULTS", "kill@7")
    killed = subprocess.run([sys.executable, "-m", "vitcli", *args], capture_output=True, text=True,
                            check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    client, run_id = tracked(server, tmp_path)
    # the kill comes before step 7's row: MLflow holds 5 and 6, past the checkpoint at 4
    assert max(s for s, _ in histories(client, run_id)["train/loss"]) == 6
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err[-2000:]
    assert "resum" in err.lower()
    assert tracked(server, tmp_path)[1] == run_id  # the same MLflow run, continued
    got, want = histories(client, run_id), jsonl_points(tmp_path)
    assert [s for s, _ in got["train/loss"]] == list(range(1, 13))
    assert got == want
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_server_that_does_not_answer_is_one_line_before_anything_is_written(monkeypatch, capsys, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    err = refused(monkeypatch, capsys, tmp_path, "pretrain", "--workdir", tmp_path / "run", *TINY,
                  "schedule.steps=2", "run.loggers=[jsonl,mlflow]", f"run.mlflow_uri={dead}")
    assert f"MLflow tracking server {dead} does not answer" in err
    assert time.monotonic() - t0 < 30
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)  # the environment's URI, the key unset
    err = refused(monkeypatch, capsys, tmp_path, "pretrain", "--workdir", tmp_path / "run", *TINY,
                  "schedule.steps=2", "run.loggers=[jsonl,mlflow]")
    assert f"MLflow tracking server {dead} does not answer" in err


class Relay:
    """A TCP relay to the server, to be cut and restored mid-run: the server going away and coming
    back, as the client sees it."""

    def __init__(self, target: str):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.port, self.open = free_port(), []
        self.start()

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port), reuse_port=True)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def stop(self) -> None:
        for s in [self.listener, *self.open]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.open = []

    def _accept(self, listener) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        with contextlib.suppress(OSError):
            b.shutdown(socket.SHUT_WR)


def cut(monkeypatch, relay, at: int, back_at: int | None = None) -> None:
    """The relay to the server stopped as the run logs step `at` (and started again at `back_at`)."""
    write = trackers_mlflow.MLflow.write

    def cut_then_write(self, step, metrics):
        if step == at:
            relay.stop()
        if step == back_at:
            relay.start()
        write(self, step, metrics)

    monkeypatch.setattr(trackers_mlflow.MLflow, "write", cut_then_write)


def through(relay, steps: int):
    """A tiny run of `steps` tracked through the relay."""
    return resolve("pretrain", None, [*TINY, f"schedule.steps={steps}", "run.loggers=jsonl,mlflow",
                                      f"run.mlflow_uri={relay.uri}"])


def test_a_server_gone_mid_run_is_a_warning_and_its_rows_follow_when_it_is_back(
        server, tmp_path, monkeypatch, logged):
    relay = Relay(server)
    monkeypatch.setattr(trackers_mlflow, "RETRY_S", 0.0)  # try again at every row
    cut(monkeypatch, relay, at=3, back_at=6)
    one_run(through(relay, steps=8), tmp_path)
    (warned,) = [m for m in warnings(logged) if "MLflow" in m]
    assert "stopped answering" in warned
    assert any("answers again (step 6)" in m for m in logged)
    client, run_id = tracked(server, tmp_path)
    assert histories(client, run_id) == jsonl_points(tmp_path)  # the rows missed, sent at the end
    relay.stop()


def test_a_server_gone_for_good_leaves_the_run_to_finish(server, tmp_path, monkeypatch, logged):
    relay = Relay(server)
    cut(monkeypatch, relay, at=2)
    summary = one_run(through(relay, steps=4), tmp_path)
    warned = [m for m in warnings(logged) if "MLflow" in m]
    # once when it went, once for the end's rows, once for the artefacts: not once a row
    assert ["stopped answering" in warned[0], "metrics were not sent" in warned[1],
            "artefacts were not sent" in warned[2]] == [True] * 3 and len(warned) == 3, warned
    assert summary["steps"] == 4 and (tmp_path / "summary.json").exists()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")][:4] == [1, 2, 3, 4]
    client, run_id = tracked(server, tmp_path)
    assert [s for s, _ in histories(client, run_id)["train/loss"]] == [1]  # what it had before


def test_a_resume_whose_mlflow_run_was_deleted_starts_a_new_one(server, tmp_path, logged):
    args = [*TINY, "schedule.steps=2", "run.ckpt_every=1", "run.loggers=jsonl,mlflow",
            f"run.mlflow_uri={server}", "data.val_split=", "data.test_split="]
    one_run(resolve("pretrain", None, args), tmp_path)
    client, first = tracked(server, tmp_path)
    client.delete_run(first)
    for stale in tmp_path.glob("state-2.pt*"):
        stale.unlink()
    one_run(resolve("pretrain", None, args), tmp_path, resume=True)
    client, second = tracked(server, tmp_path)
    assert second != first
    assert any(f"MLflow run {first}" in m and "starts a new one" in m for m in warnings(logged))
    # the new run has the rows the resume kept (step 1, sent from metrics.jsonl) and its own
    assert histories(client, second) == jsonl_points(tmp_path)


def test_a_run_stopped_by_ctrl_c_is_marked_killed_with_its_rows_to_its_checkpoint(
        server, tmp_path, monkeypatch):
    """Ctrl-C after step 3: the run writes a checkpoint at 4 and stops; the exit hook sends the timed
    rows (final: every row is at or before that checkpoint) and marks the MLflow run KILLED."""
    opened = []
    init, write = trackers_mlflow.MLflow.__init__, trackers_mlflow.MLflow.write

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(self)

    def ctrl_c_after_3(self, step, metrics):
        write(self, step, metrics)
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a person's Ctrl-C, mid-run

    monkeypatch.setattr(trackers_mlflow.MLflow, "__init__", kept)
    monkeypatch.setattr(trackers_mlflow.MLflow, "write", ctrl_c_after_3)
    r = resolve("pretrain", None, [*TINY, "schedule.steps=8", "run.loggers=jsonl,mlflow",
                                   f"run.mlflow_uri={server}"])
    with pytest.raises(Interrupted):
        one_run(r, tmp_path)
    (tracker,) = opened
    client, run_id = tracked(server, tmp_path)
    assert "train/img_per_s" not in histories(client, run_id)  # timed rows wait for their checkpoint
    tracker._at_exit()  # what the interpreter's exit runs (atexit)
    assert client.get_run(run_id).info.status == "KILLED"
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert histories(client, run_id) == jsonl_points(tmp_path)
