"""`objective: mae` through the one trainer: the loss falls, the metrics are the pretext's, the
exported file is the encoder alone (a headless timm ViT) that fine-tuning starts from, the masks
follow the images whatever the micro-batches, and a run SIGKILLed at a checkpoint resumes to the
uninterrupted run's exact weights."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from timm.models.vision_transformer import VisionTransformer

from helpers import kill_when, run_vit
from vitcli.checkpoints import state
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
TINY = ["objective=mae", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "mae.decoder_embed_dim=16", "mae.decoder_depth=1",
        "mae.decoder_num_heads=2", "data.synthetic.train_size=128", "data.synthetic.val_size=64",
        "data.synthetic.test_size=64", "data.batch_size=32", "data.num_workers=0", "optim.lr=3e-3",
        "optim.weight_decay=0", "schedule.warmup_steps=2", "schedule.decay=cosine", "run.log_every=1",
        f"data.mean={IMAGENET[0]}", f"data.std={IMAGENET[1]}", "run.precision=fp32"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mae")
    results = one_run(resolve("pretrain", None, TINY + ["schedule.steps=40", "run.eval_every=20"]), workdir)
    return workdir, results


def test_mae_pretraining_lowers_its_loss_and_reports_its_own_metrics(pretrained):
    workdir, results = pretrained
    train = [r["train/loss"] for r in read_metrics(workdir / "metrics.jsonl") if "train/loss" in r]
    first, last = train[0], sum(train[-5:]) / 5
    assert last < 0.8 * first, (first, last)  # ~1 at the start: each target patch has unit variance
    assert {"val/mae_loss", "test/mae_loss"} <= set(results) and "val/top1" not in results
    assert results["train/flops_per_img"] > 0 and "train/mfu" in results


def test_the_exported_file_is_the_encoder_a_headless_timm_vit(pretrained):
    workdir, _ = pretrained
    sd, meta = load_weights(workdir / MODEL_FILE)
    assert not any(k.startswith(("decoder", "backbone.")) for k in sd), sorted(sd)[:5]
    timm_vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0,
                                 num_classes=0)
    timm_vit.load_state_dict(load_file(str(workdir / MODEL_FILE)), strict=True)
    assert meta["recipe"]["objective"] == "mae"
    saved = state.load_state(state.checkpoints(workdir)[0])["model"]
    assert "decoder.mask_token" in saved and "decoder.pred.weight" in saved, "the decoder trains on, in state"


def test_finetuning_starts_from_the_encoder_and_its_pixel_normalisation(pretrained, tmp_path, monkeypatch,
                                                                         capsys):
    workdir, _ = pretrained
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", workdir, "--res", 32, "--workdir",
                           tmp_path / "ft", "data.synthetic.train_size=64", "data.synthetic.val_size=32",
                           "data.synthetic.test_size=32", "data.batch_size=32", "data.num_workers=0",
                           "schedule.steps=3", "schedule.warmup_steps=1")
    assert code == 0, err
    ft = load_weights(tmp_path / "ft" / MODEL_FILE)[1]["recipe"]
    assert (ft["data"]["mean"], ft["data"]["std"]) == IMAGENET, "the checkpoint's normalisation"
    assert json.loads((tmp_path / "ft" / "summary.json").read_text())["test/top1"] >= 0


def test_accumulated_micro_batches_mask_and_train_as_one_batch(tmp_path):
    """A batch of 32 as one micro-batch or as 4 of 8: without random crops or flips every
    micro-batch holds the same images either way, and each image keeps its mask, so the weights
    differ only by the float summation order of the gradient (after 4 steps: measured 8.6e-6; with
    masks drawn per micro-batch instead, 1.0e-2)."""
    args = TINY + ["schedule.steps=4", "data.val_split=", "data.test_split=", "data.crop_min_area=1.0",
                   "data.hflip=false"]
    one_run(resolve("pretrain", None, args), tmp_path / "one")
    one_run(resolve("pretrain", None, [*args, "data.micro_batch_size=8"]), tmp_path / "four")
    one, four = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("one", "four"))
    worst = max((one[k] - four[k]).abs().max().item() for k in one)
    assert worst < 1e-4, worst


def _vit(workdir, *extra) -> list[str]:
    args = TINY + ["schedule.steps=60", "run.ckpt_every=10", "run.log_every=10", "data.val_split=",
                   "data.test_split=", "model.drop_path=0.1", *extra]
    return [sys.executable, "-m", "vitcli.cli", "pretrain", "--workdir", str(workdir), *args]


def test_a_run_killed_at_a_checkpoint_resumes_to_the_same_weights(tmp_path):
    """SIGKILLed after its step-10 checkpoint (no handler runs), then the same command again: the
    masks (and drop-path) of every later step are the uninterrupted run's, so the weights are
    equal."""
    straight = subprocess.run(_vit(tmp_path / "straight"), env=ENV, capture_output=True, text=True,
                              timeout=300, check=False)
    assert straight.returncode == 0, straight.stderr[-2000:]
    kill_when(ENV, _vit(tmp_path / "killed"), tmp_path / "killed" / "state-10.pt.sha256")  # complete
    resumed = subprocess.run(_vit(tmp_path / "killed"), env=ENV, capture_output=True, text=True, timeout=300,
                             check=False)
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, resumed.stderr[-2000:]
    a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("straight", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, fragment", [
    (["mae.mask_ratio=0.99"], "keeps 0 of 16 patches"),
    (["model.pos_embed=sincos_2d"], "must be learned_1d"),
    (["mae.decoder_embed_dim=18"], "must be a multiple of 4"),
    (["mae.decoder_num_heads=3", "mae.decoder_embed_dim=16"], "and of mae.decoder_num_heads=3"),
    (["model.name=BiT-R50x1"], "objective: mae needs a plain ViT"),
    (["optim.layer_decay=0.75"], "objective: mae trains every layer"),
    (["data.mixup_alpha=0.8"], "objective: mae has none"),
])
def test_impossible_mae_recipes_are_refused(extra, fragment):
    with pytest.raises(RecipeError, match=fragment):
        resolve("pretrain", None, TINY + ["schedule.steps=10", *extra])
