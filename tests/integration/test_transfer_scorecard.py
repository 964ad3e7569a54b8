"""`vit eval-fewshot --protocols`: kNN, the logistic probe and ridge beside few-shot, on one cached
feature pass per split; the same protocols logged during training."""

import json

import numpy as np
import pytest
import torch

from helpers import run_vit
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.weights import save_weights
from vitcli.fewshot import features, knn, probe, solver
from vitcli.fewshot.evaluate import FewshotEvaluator
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.runtime.dist import Dist
from vitcli.stages.fewshot import eval_fewshot

CPU = Dist(0, 1, 0, torch.device("cpu"))
TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64"]
DATA = ["data.synthetic.num_classes=6", "data.synthetic.train_size=120", "data.synthetic.test_size=60",
        "data.synthetic.img_size=32", "data.num_workers=0", "run.precision=fp32"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "random.safetensors"
    r = resolve("pretrain", None, TINY, inputs=False)
    torch.manual_seed(0)
    save_weights(path, zoo.build_model(r.model, 0).state_dict(), {"model": zoo.model_spec(r.model, 0)})
    return path


def scorecard(ckpt, workdir, protocols: str, *extra, overwrite=False):
    r = resolve("eval-fewshot", None, [*TINY, *DATA, f"init.checkpoint={ckpt}", "fewshot.tasks=synthetic",
                                       "fewshot.shots=2,5", "fewshot.seeds=1",
                                       f"fewshot.protocols=[{protocols}]", *extra], complete=complete)
    return eval_fewshot(r, workdir, overwrite=overwrite)


def counted_forwards(monkeypatch) -> list[int]:
    """Images that went through pre_logits, per call."""
    calls, real = [], features.pre_logits
    monkeypatch.setattr(features, "pre_logits", lambda m, x: calls.append(len(x)) or real(m, x))
    return calls


def cached_features(workdir):
    """(train, test) (features, labels) from the workdir's cache, told apart by their sizes."""
    sets = [features._read_entry(p)[:2] for p in sorted((workdir / "features").glob("*.safetensors"))]
    return sorted(sets, key=lambda s: -len(s[1]))


def test_every_protocol_scores_the_cached_features_and_a_second_run_extracts_nothing(ckpt, tmp_path,
                                                                                     monkeypatch):
    forwards = counted_forwards(monkeypatch)
    first = scorecard(ckpt, tmp_path, "fewshot")
    assert sum(forwards) == 180 and first["all_data"] == []  # 120 train + 60 test images, once
    forwards.clear()
    second = scorecard(ckpt, tmp_path, "knn,linear,ridge", overwrite=True)  # another request: it says so
    assert forwards == []  # the same checkpoint, task and preprocessing: all from the cache
    (x_tr, y_tr), (x_te, y_te) = cached_features(tmp_path)
    rows = {row["protocol"]: row for row in second["all_data"]}
    assert list(rows) == ["knn", "linear", "ridge"] and second["runs"] == []
    # each row is its protocol on those features, computed here independently of the stage
    assert rows["knn"]["top1"] == knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 6)["top1"]
    assert rows["knn"]["top5"] == knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 6)["top5"]
    assert rows["linear"]["top1"] == probe.linear_probe(x_tr, y_tr, x_te, y_te, 6)["top1"]
    assert (rows["ridge"]["top1"], rows["ridge"]["l2"]) == solver.score(x_tr, y_tr, x_te, y_te, 6, "auto")
    assert all(row["train"] == 120 and row["test"] == 60 for row in rows.values())
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["all_data"] == second["all_data"] and on_disk["protocols"] == ["knn", "linear", "ridge"]
    # few-shot's files described the first run: results.json no longer does, so they went aside with
    # it
    assert not (tmp_path / "results.csv").exists() and not (tmp_path / "fewshot.png").exists()
    (kept,) = tmp_path.glob("previous-*")
    assert {p.name for p in kept.iterdir()} == {"results.json", "results.csv", "fewshot.png", "recipe.yaml"}


def test_knn_settings_reach_the_protocol(ckpt, tmp_path):
    out = scorecard(ckpt, tmp_path, "knn", "fewshot.knn_k=3", "fewshot.knn_temperature=0.5")
    (x_tr, y_tr), (x_te, y_te) = cached_features(tmp_path)
    row = out["all_data"][0]
    assert (row["k"], row["temperature"]) == (3, 0.5)
    assert row["top1"] == knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 6, k=3, temperature=0.5)["top1"]


def test_training_logs_each_protocol_from_one_extraction(monkeypatch):
    r = resolve("pretrain", None, [*TINY, *DATA, "fewshot.tasks=synthetic", "fewshot.shots=2",
                                   "fewshot.seeds=1", "fewshot.protocols=[fewshot,knn,linear,ridge]",
                                   "schedule.steps=2",
                                   "schedule.warmup_steps=1"], complete=complete, inputs=False)
    forwards = counted_forwards(monkeypatch)
    torch.manual_seed(0)
    metrics = dict(FewshotEvaluator(r, CPU).run(zoo.build_model(r.model, 6)))
    assert sum(forwards) == 180  # one pass over train and test serves all four
    assert set(metrics) == {"fewshot/synthetic/2shot", "knn/synthetic/top1", "knn/synthetic/top5",
                            "linear/synthetic/top1", "linear/synthetic/top5", "ridge/synthetic/top1"}
    assert all(0 <= v <= 1 for v in metrics.values())


def test_the_cli_takes_protocols_and_all(ckpt, tmp_path, monkeypatch, capsys):
    args = ["eval-fewshot", "--ckpt", str(ckpt), "--tasks", "synthetic", "--shots", "2", "--seeds", "1",
            "--workdir", str(tmp_path / "w"), *DATA, "--json"]
    code, out, err = run_vit(monkeypatch, capsys, *args, "--protocols", "all")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["protocols"] == ["fewshot", "knn", "linear", "ridge"]
    assert [r["protocol"] for r in payload["all_data"]] == ["knn", "linear", "ridge"] and payload["runs"]
    code, out, err = run_vit(monkeypatch, capsys, *args, "--protocols", "knn,linaer")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "fewshot.protocols: 'linaer' is not one of fewshot, knn, linear, ridge" in err


@pytest.mark.parametrize("override,message", [
    ("fewshot.knn_k=0", "fewshot.knn_k"), ("fewshot.knn_temperature=0", "fewshot.knn_temperature"),
    ("fewshot.probe_holdout=1", "fewshot.probe_holdout"), ("fewshot.probe_holdout=0", "holds nothing out")])
def test_bad_protocol_settings_are_one_line_naming_the_key(ckpt, tmp_path, monkeypatch, capsys, override,
                                                             message):
    code, _, err = run_vit(monkeypatch, capsys, "eval-fewshot", "--ckpt", str(ckpt), "--tasks", "synthetic",
                           "--protocols", "linear", "--workdir", str(tmp_path / "w"), override)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "w").exists()


def test_the_probe_table_prints_top1_and_top5(ckpt, tmp_path, capsys):
    scorecard(ckpt, tmp_path, "knn,ridge")
    out = capsys.readouterr().out
    assert "frozen features, all train data" in out
    row = next(line for line in out.splitlines() if line.startswith("│ synthetic"))
    assert "(" in row.split("│")[2] and "(" not in row.split("│")[3]  # kNN has a top-5, ridge does not
    assert np.isfinite(float(row.split("│")[3]))
