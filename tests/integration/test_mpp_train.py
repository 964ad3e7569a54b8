"""`objective: mpp` through the one trainer: the loss falls, the metrics are the pretext's, the
exported file is a plain ViT that timm loads, fine-tunes and few-shot-evaluates, and runs repeat
exactly."""

import json

import datasets
import pytest
import torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer

from helpers import run_vit
from vitcli.checkpoints import state
from vitcli.checkpoints.complete import complete
from vitcli.data.rows.synthetic import make_synthetic
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import SyntheticConfig
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

TINY = ["objective=mpp", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.train_size=128",
        "data.synthetic.val_size=64", "data.synthetic.test_size=64", "data.batch_size=32",
        "data.num_workers=0", "optim.lr=3e-3", "optim.weight_decay=0", "schedule.warmup_steps=2",
        "schedule.decay=cosine", "run.log_every=1", "data.crop_min_area=1.0", "data.hflip=false",
        "run.precision=fp32"]  # the loss threshold below was measured in fp32: the same test on any CPU


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mpp")
    results = one_run(resolve("pretrain", None, TINY + ["schedule.steps=40", "run.eval_every=20"]), workdir)
    return workdir, results


def test_mpp_pretraining_lowers_its_loss_and_reports_its_own_metrics(pretrained):
    workdir, results = pretrained
    rows = read_metrics(workdir / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    first, last = train[0]["train/loss"], sum(r["train/loss"] for r in train[-5:]) / 5
    assert last < first - 0.5, (first, last)  # ln 512 = 6.24 at the start
    assert all(0 <= r["train/mpp_accuracy"] <= 1 for r in train)
    assert {"val/mpp_loss", "val/mpp_accuracy", "test/mpp_loss", "test/mpp_accuracy"} <= set(results)
    assert "val/top1" not in results, "no classifier is trained, so none is evaluated"


def test_the_exported_file_is_a_plain_headless_vit_that_timm_loads(pretrained):
    workdir, _ = pretrained
    sd = load_file(str(workdir / MODEL_FILE))
    assert not any(k.startswith(("mask_token", "head.", "backbone.")) for k in sd), sorted(sd)[:5]
    timm_vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0,
                                 num_classes=0)
    timm_vit.load_state_dict(sd, strict=True)
    saved = state.load_state(state.checkpoints(workdir)[0])["model"]  # the newest
    assert "mask_token" in saved and "head.weight" in saved, "the resumable state keeps the pretext parts"


def test_the_mpp_checkpoint_finetunes_and_evaluates_few_shot(pretrained, tmp_path, monkeypatch, capsys):
    workdir, _ = pretrained
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", workdir, "--res", 32, "--workdir",
                           tmp_path / "ft", "data.synthetic.train_size=64", "data.synthetic.val_size=32",
                           "data.synthetic.test_size=32", "data.batch_size=32", "data.num_workers=0",
                           "schedule.steps=3", "schedule.warmup_steps=1")
    assert code == 0, err
    assert json.loads((tmp_path / "ft" / "summary.json").read_text())["test/top1"] >= 0
    code, _, err = run_vit(monkeypatch, capsys, "eval-fewshot", "--ckpt", workdir, "--tasks", "synthetic",
                           "--shots", 1, "--seeds", 1, "data.synthetic.train_size=40",
                           "data.synthetic.test_size=40", "data.num_workers=0", "--workdir", tmp_path / "fs")
    assert code == 0, err


def test_two_mpp_runs_are_identical(tmp_path):
    """The corruption draws come from the per-step stream, so a rerun (or a resume) repeats
    exactly."""
    r = resolve("pretrain", None, TINY + ["schedule.steps=4", "data.val_split=", "data.test_split="])
    for name in ("a", "b"):
        torch.manual_seed(len(name))  # the global stream differs; the run must not depend on it
        one_run(r, tmp_path / name)
    a, b = (load_file(str(tmp_path / n / MODEL_FILE)) for n in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mpp_pretrains_on_unlabeled_images(tmp_path):
    images = make_synthetic(SyntheticConfig(train_size=64, img_size=32), "train").remove_columns("label")
    datasets.DatasetDict({"train": images}).save_to_disk(str(tmp_path / "unlabeled"))
    r = resolve("pretrain", None, TINY + [f"data.source={tmp_path / 'unlabeled'}", "data.label_column=",
                                          "data.val_split=", "data.test_split=", "schedule.steps=3"])
    one_run(r, tmp_path / "w")
    assert (tmp_path / "w" / MODEL_FILE).is_file()


@pytest.mark.parametrize("stage, extra, fragment", [
    ("finetune", [], "is a pretraining objective"),
    ("pretrain", ["model.name=BiT-R50x1"], "needs a plain ViT"),
    ("pretrain", ["mpp.target=color_4x4", "model.patch_size=2"], "must be a multiple of 4"),
    ("pretrain", ["mpp.corrupt_ratio=0.01"], "16 patches corrupts none of them"),
    ("pretrain", ["objective=supervised", "data.label_column="], "supervised training needs labels"),
])
def test_impossible_mpp_recipes_are_refused(stage, extra, fragment):
    with pytest.raises(RecipeError, match=fragment):
        resolve(stage, None, TINY + ["schedule.steps=10", *extra])


def test_few_shot_runs_during_mpp_pretraining(tmp_path):
    r = resolve("pretrain", None, TINY + ["schedule.steps=4", "data.val_split=", "data.test_split=",
                                          "fewshot.tasks=synthetic", "fewshot.shots=1", "fewshot.seeds=1",
                                          "fewshot.every=2", "data.synthetic.test_size=40"],
                complete=complete)
    one_run(r, tmp_path)
    steps = [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")
             if "fewshot/synthetic/1shot" in row]
    assert steps == [2, 4]
