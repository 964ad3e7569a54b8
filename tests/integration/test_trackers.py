"""run.loggers: TensorBoard events, a W&B offline run and trackio's local store carry the same rows
as metrics.jsonl, resumes do not repeat steps, and a logger that cannot run is refused before
training. (MLflow, against a real server: test_mlflow.py.)"""

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime import trackers
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import TRACKIO_ID_FILE, WANDB_ID_FILE
from vitcli.stages.run import one_run

# trackio reads its store's folder once, when imported: a temporary one, never ~/.cache/huggingface
if "TRACKIO_DIR" not in os.environ:
    os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="vitcli-trackio-")
    atexit.register(shutil.rmtree, os.environ["TRACKIO_DIR"], ignore_errors=True)
TRACKIO_DIR = os.environ["TRACKIO_DIR"]

TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
    "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
    "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.synthetic.img_size=32",
    "data.batch_size=16", "data.num_workers=0", "data.eval_batch_size=32", "schedule.warmup_steps=1",
    "run.log_every=1",
]


def tensorboard_scalars(logdir) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_every_metrics_jsonl_row(tmp_path):
    one_run(resolve("pretrain", None, [*TINY, "schedule.steps=4", "run.loggers=jsonl,tensorboard"]), tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    expected = {(k, r["step"]): v for r in rows for k, v in r.items() if k != "step" and v is not None}
    got = {(k, step): v for k, by_step in scalars.items() for step, v in by_step.items()}
    assert got.keys() == expected.keys()
    assert {"train/loss", "train/lr", "test/top1"} <= set(scalars)
    for key, value in expected.items():  # TensorBoard stores float32
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_a_resumed_run_purges_tensorboard_steps_past_the_checkpoint(tmp_path):
    args = [*TINY, "run.loggers=tensorboard", "run.ckpt_every=2", "data.val_split=", "data.test_split="]
    one_run(resolve("pretrain", None, [*args, "schedule.steps=3"]), tmp_path)  # checkpoints at 2 and 3
    for stale in tmp_path.glob("state-3.pt*"):
        stale.unlink()  # as if killed after step 3 was logged but before its checkpoint landed
    one_run(resolve("pretrain", None, [*args, "schedule.steps=3"]), tmp_path, resume=True)
    losses = tensorboard_scalars(tmp_path / "tensorboard")["train/loss"]
    jsonl = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(losses) == [1, 2, 3]
    assert losses[3] == pytest.approx(jsonl[3], rel=1e-6)  # the rerun's value, not the first run's


def test_wandb_offline_run_records_the_rows_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    r = resolve("pretrain", None, [*TINY, "schedule.steps=2", "run.loggers=jsonl,wandb", "run.ckpt_every=1"])
    one_run(r, tmp_path)
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    (record,) = tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
    data = record.read_bytes()  # W&B's record log stores each history row's keys and JSON values as text
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert b"train/loss" in data and b"test/top1" in data
    assert repr(last["test/top1"]).encode() in data
    for stale in tmp_path.glob("state-2.pt*"):
        stale.unlink()
    time.sleep(1.1)  # W&B names an offline segment by the second it starts: two in one second share a folder
    one_run(r, tmp_path, resume=True)  # resumes at step 1: the same W&B run id, a second offline segment
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id
    assert len(list(tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))) == 2


def trackio_store():
    """trackio's local store (imported here: after TRACKIO_DIR is set, and only by its tests)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage


def trackio_rows(project: str, name: str) -> dict[int, dict]:
    """The rows trackio's local store holds for run `name`, by step (one per step, or it fails)."""
    logs = trackio_store().get_logs(project, name)
    steps = [log["step"] for log in logs]
    assert len(steps) == len(set(steps)), f"a step logged twice: {sorted(steps)}"
    return {log["step"]: log for log in logs}


def test_trackio_keeps_the_rows_in_its_local_store_and_a_resume_continues_the_run(tmp_path, capsys):
    args = [*TINY, "run.loggers=jsonl,trackio", "run.experiment=vit-tests", "run.ckpt_every=2",
            "schedule.steps=3", "data.val_split=", "data.test_split="]
    one_run(resolve("pretrain", None, args), tmp_path)
    assert str(sys.modules["trackio"].utils.TRACKIO_DIR) == TRACKIO_DIR  # never a user's store
    name = (tmp_path / TRACKIO_ID_FILE).read_text().strip()
    assert name.startswith(tmp_path.name)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert sorted(trackio_rows("vit-tests", name)) == [r["step"] for r in rows] == [1, 2, 3]
    for stale in tmp_path.glob("state-3.pt*"):
        stale.unlink()  # as if killed after step 3 was logged but before its checkpoint landed
    one_run(resolve("pretrain", None, args), tmp_path, resume=True)
    assert (tmp_path / TRACKIO_ID_FILE).read_text().strip() == name
    stored = trackio_rows("vit-tests", name)  # step 3 once, not again
    assert sorted(stored) == [1, 2, 3]
    for row in read_metrics(tmp_path / "metrics.jsonl"):
        assert stored[row["step"]]["train/loss"] == row["train/loss"]
    assert "Trackio" not in capsys.readouterr().out  # its banner kept off stdout (--json's)
    assert any(p.name.startswith("vit-tests") for p in Path(TRACKIO_DIR).iterdir())  # the store
    versions = trackio_store().get_run_artifacts("vit-tests", name, None)["output"]
    assert [v["version"] for v in versions] == [0, 1]  # the figures and summary, at each end
    manifest = trackio_store().get_artifact_manifest("vit-tests", versions[-1]["name"], None)
    assert {f["path"] for f in manifest["manifest"]} == {"curves.png", "summary.json", "recipe.yaml"}


def test_loggers_are_checked_before_training(monkeypatch):
    with pytest.raises(RecipeError, match=r"run.loggers: 'tensorbord' is not one of jsonl, "
                                          r"tensorboard, wandb, mlflow, trackio"):
        resolve("pretrain", None, [*TINY, "run.loggers=tensorbord"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(RecipeError, match=r"pip install 'vitcli\[wandb\]'"):
        resolve("pretrain", None, [*TINY, "run.loggers=wandb"])


def test_wandb_never_asks_for_a_login(monkeypatch, tmp_path):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert trackers.wandb_mode() == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password x\n")
    assert trackers.wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trackers.wandb_mode() == "disabled"
