"""`vit export`'s model card (README.md), read back with huggingface_hub's own parser, offline: the
model-index of a real run (vit pretrain, 2 steps on the built-in data), its `vit evaluate` and its
`vit eval-fewshot` come back as dataset, split, metric and value, equal to the numbers in their
files; the recipe block is the checkpoint's recipe; a run that recorded no results has no
model-index; results of another checkpoint are refused in one line, nothing written.
"""

import json
import re
from types import SimpleNamespace

import pytest
import yaml

from helpers import REPO, run_vit, snapshot, tiny_vit
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.weights import save_weights
from vitcli.data.rows.tasks import get_tasks
from vitcli.models.zoo import model_spec
from vitcli.recipe.schema import ModelConfig

hub = pytest.importorskip("huggingface_hub")
from huggingface_hub.repocard_data import model_index_to_eval_results

QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")
SMALL = ["data.synthetic.train_size=64", "data.synthetic.val_size=32",
         "data.synthetic.test_size=32", "data.batch_size=32", "data.num_workers=0",
         "schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1"]
FEWSHOT = ["--tasks", "synthetic", "--shots", "1", "--seeds", "1", "data.synthetic.train_size=40",
           "data.synthetic.test_size=40", "data.num_workers=0"]
TINY = ModelConfig(name="custom", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                   mlp_dim=64)


def _vit(monkeypatch, capsys, *args) -> str:
    code, out, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    return out


def _export(monkeypatch, capsys, ckpt, fmt, out, *more) -> str:
    return _vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", fmt, "--out", out, *more)


class _Capture:
    """run_vit's capsys for a module fixture (pytest's own is per test): the output stays in
    pytest's capture, shown with a failure."""

    def readouterr(self):
        return SimpleNamespace(out="", err="see the captured output")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-step pretrain run, its evaluation on the test split and its few-shot evaluation."""
    root = tmp_path_factory.mktemp("card")
    with pytest.MonkeyPatch.context() as mp:
        out = _Capture()
        _vit(mp, out, "pretrain", "-r", QUICK, "--workdir", root / "run", *SMALL)
        _vit(mp, out, "evaluate", "--ckpt", root / "run", "--workdir", root / "ev", "--split",
             "test", "data.num_workers=0")
        _vit(mp, out, "eval-fewshot", "--ckpt", root / "run", "--workdir", root / "fs", *FEWSHOT)
    return root


def _results(card) -> set[tuple]:
    """(dataset, split, metric type, metric name, value) of each result huggingface_hub reads."""
    return {(r.dataset_name, r.dataset_split, r.metric_type, r.metric_name, r.metric_value)
            for r in card.data.eval_results}


def test_the_runs_results_come_back_through_huggingface_hubs_parser(monkeypatch, capsys,
                                                                    tmp_path, runs):
    _export(monkeypatch, capsys, runs / "run", "hf", tmp_path / "hf", "--results", runs / "ev")
    card = hub.ModelCard.load(tmp_path / "hf" / "README.md")
    summary = json.loads((runs / "run" / "summary.json").read_text())
    evaluated = json.loads((runs / "ev" / "results.json").read_text())
    want = {("synthetic", "validation", "accuracy", "Top 1 Accuracy", summary["val/top1"]),
            ("synthetic", "validation", "loss", "Loss", summary["val/loss"]),
            ("synthetic", "test", "accuracy", "Top 1 Accuracy", summary["test/top1"]),
            ("synthetic", "test", "loss", "Loss", summary["test/loss"]),
            *((evaluated["data"], evaluated["split"], metric, name, evaluated[key])
              for key, metric, name in (("top1", "accuracy", "Top 1 Accuracy"),
                                        ("top5", "top_5_accuracy", "Top 5 Accuracy"),
                                        ("loss", "loss", "Loss")))}
    assert _results(card) == want
    assert (card.data.library_name, card.data.pipeline_tag) == ("transformers",
                                                                "image-classification")
    assert card.data.model_name == "hf"
    # the other way in: model-index as the Hub stores it, through huggingface_hub's converter
    name, back = model_index_to_eval_results(card.data.to_dict()["model-index"])
    assert name == "hf"
    assert {(r.dataset_split, r.metric_name, r.metric_value) for r in back} == \
        {(w[1], w[3], w[4]) for w in want}
    block = re.search(r"```yaml\n(.*?)```", card.text, re.DOTALL)[1]
    assert yaml.safe_load(block) == read_checkpoint(str(runs / "run")).meta["recipe"]
    assert "TimmWrapperImageProcessor" in card.text and "bilinear" in card.text


def test_the_timm_card_carries_the_few_shot_scorecard(monkeypatch, capsys, tmp_path, runs):
    out = _export(monkeypatch, capsys, runs / "run", "timm", tmp_path / "timm", "--results",
                  runs / "fs")
    card = hub.ModelCard.load(tmp_path / "timm" / "README.md")
    assert card.data.library_name == "timm" and "timm" in card.data.tags
    fewshot = json.loads((runs / "fs" / "results.json").read_text())["summary"]
    got = {(r.dataset_name, r.dataset_split, r.metric_name): r.metric_value
           for r in card.data.eval_results}
    for row in fewshot:  # the synthetic task: its source and test split, as the task registry says
        name = f"{row['shots']}-shot accuracy (mean of seeds)"
        assert got[("synthetic", "test", name)] == row["mean"]
    assert "results (model-index) from" in " ".join(out.split())


def test_a_vtab_scorecard_names_each_tasks_dataset(monkeypatch, capsys, tmp_path, runs):
    """vtab.json as `vit finetune --task vtab` writes it: each task's Hub dataset and test split,
    from the task registry."""
    scores = {"vtab/dmlab": {"group": "structured", "lr": 0.01, "test/top1": 0.25},
              "vtab/cifar100": {"group": "natural", "lr": 0.003, "test/top1": 0.5}}
    (tmp_path / "vtab").mkdir()
    (tmp_path / "vtab" / "vtab.json").write_text(json.dumps(scores))
    _export(monkeypatch, capsys, runs / "run", "timm", tmp_path / "timm", "--results",
            tmp_path / "vtab")
    card = hub.ModelCard.load(tmp_path / "timm" / "README.md")
    for name, row in scores.items():
        task = get_tasks(name)[0]
        assert (task.source, task.test_split, "accuracy", "Top 1 Accuracy", row["test/top1"]) in \
            _results(card)


def test_a_run_without_results_has_no_model_index_and_says_so(monkeypatch, capsys, tmp_path):
    save_weights(tmp_path / "model.safetensors", tiny_vit(num_classes=3).state_dict(),
                 {"model": {**model_spec(TINY, 3), "class_names": ["a", "b", "c"]}})
    out = _export(monkeypatch, capsys, tmp_path / "model.safetensors", "hf", tmp_path / "hf")
    card = hub.ModelCard.load(tmp_path / "hf" / "README.md")
    assert card.data.eval_results is None and "model-index" not in card.data.to_dict()
    assert "None recorded" in card.text and "no model-index" in " ".join(out.split())


def test_results_of_another_checkpoint_are_refused_and_nothing_is_written(monkeypatch, capsys,
                                                                           tmp_path, runs):
    mine = tmp_path / "run"
    mine.mkdir()
    (mine / "model.safetensors").write_bytes((runs / "run" / "model.safetensors").read_bytes())
    record = json.loads((runs / "ev" / "results.json").read_text())
    record["inputs"]["checkpoint"]["sha256"] = "0" * 64  # the record of another file
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "results.json").write_text(json.dumps(record))
    before = snapshot(tmp_path)
    cases = (("timm", tmp_path / "ev", "another sha256"),
             ("timm", tmp_path, "holds no results.json"),
             ("onnx", runs / "ev", "--format onnx writes no card"))
    for fmt, results, said in cases:
        code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", mine, "--format", fmt,
                               "--out", tmp_path / "out", "--results", results)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(tmp_path) == before
