"""`objective: dino` through the one trainer: the teacher is exported, its EMA and centre are state
that resumes bit-identically after a SIGKILL, the loss does not depend on how the global batch is
split (one micro-batch, accumulation, two ranks), a teacher that collapses stops the run in one
line, and impossible recipes are refused."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from helpers import kill_when, run_vit
from vitcli.checkpoints import state
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

TINY = ["objective=dino", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "dino.out_dim=64", "dino.hidden_dim=32",
        "dino.bottleneck_dim=16", "dino.local_crops=2", "dino.local_crop_size=16",
        "data.synthetic.train_size=64", "data.synthetic.val_size=32", "data.synthetic.test_size=32",
        "data.batch_size=16", "data.num_workers=0", "optim.lr=1e-3", "optim.weight_decay=0.04",
        "optim.weight_decay_end=0.4", "schedule.warmup_steps=2", "schedule.decay=cosine", "run.log_every=1",
        "run.precision=fp32", "dino.freeze_last_layer_epochs=0.5", "optim.clip_grad_norm=0"]
# DINOv2's terms: iBOT on a shared head, KoLeo over groups of 8, Sinkhorn-Knopp centring
V2 = ["dino.ibot_weight=1", "dino.koleo_weight=0.1", "dino.koleo_group=8", "dino.centering=sinkhorn"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
QUIET = ["data.val_split=", "data.test_split="]


def vit(workdir: Path, *extra: str, nproc: int = 1) -> list[str]:
    launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                if nproc > 1 else [])
    return [sys.executable, *launcher, "-m", "vitcli.cli", "pretrain", "--workdir", str(workdir), *TINY,
            *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(workdir: Path, key: str = "train/loss") -> list[float]:
    return [r[key] for r in read_metrics(workdir / "metrics.jsonl") if key in r]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dino")
    recipe = resolve("pretrain", None, TINY + V2 + ["schedule.steps=8", "run.eval_every=4"])
    results = one_run(recipe, workdir)
    return workdir, results


def test_the_exported_file_is_the_teachers_vit_and_its_terms_are_logged(pretrained):
    workdir, results = pretrained
    sd, meta = load_weights(workdir / MODEL_FILE)
    timm_vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0,
                                 num_classes=0)
    timm_vit.load_state_dict(sd, strict=True)
    assert meta["recipe"]["objective"] == "dino"
    saved = state.load_state(state.checkpoints(workdir)[0])["model"]
    teacher, student = ({k.removeprefix(f"{side}.backbone."): v for k, v in saved.items()
                         if k.startswith(f"{side}.backbone.")} for side in ("teacher", "student"))
    assert all(torch.equal(sd[k], teacher[k]) for k in sd), "the exported weights are the teacher's"
    assert any(not torch.equal(sd[k], student[k]) for k in sd), "... not the student's"
    assert {"center", "patch_center", "mask_token"} <= set(saved), "the centres resume with the weights"
    rows = read_metrics(workdir / "metrics.jsonl")
    logged = set().union(*rows)
    assert {"train/dino_loss", "train/ibot_loss", "train/koleo_loss", "train/kl", "train/teacher_entropy",
            "train/teacher_mean_entropy"} <= logged, sorted(logged)
    assert {"val/dino_ce", "val/teacher_entropy", "test/dino_ce"} <= set(results), sorted(results)
    assert results["train/flops_per_img"] > 0


def test_the_teacher_fine_tunes_and_scores_frozen(pretrained, tmp_path, monkeypatch, capsys):
    """What a user does next with a DINO run: fine-tune its teacher, and score it frozen (kNN)."""
    workdir, _ = pretrained
    small = ["data.synthetic.train_size=64", "data.synthetic.val_size=32", "data.synthetic.test_size=32",
             "data.num_workers=0"]
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", workdir, "--res", 32, "--workdir",
                           tmp_path / "ft", *small, "data.batch_size=32", "schedule.steps=2",
                           "schedule.warmup_steps=1")
    assert code == 0, err
    code, out, err = run_vit(monkeypatch, capsys, "eval-fewshot", "--ckpt", workdir, "--tasks", "synthetic",
                             "--protocols", "knn", "--workdir", tmp_path / "fs", "fewshot.seeds=1",
                             "fewshot.shots=1", "data.synthetic.train_size=64", "data.synthetic.test_size=32")
    assert code == 0, err
    assert "knn" in out.lower(), out[-1000:]


def test_the_last_layer_stays_frozen_for_its_epochs(tmp_path):
    """dino.freeze_last_layer_epochs=0.5 of 4 steps an epoch: the student's last layer does not move
    in steps 0 and 1, and does after."""
    args = TINY + QUIET + ["dino.freeze_last_layer_epochs=0.5", "run.ckpt_every=1", "run.keep_checkpoints=10",
                           "dino.norm_last_layer=false", "schedule.warmup_steps=0"]
    one_run(resolve("pretrain", None, args + ["schedule.steps=3"]), tmp_path)
    states = {int(p.name.split("-")[1].split(".")[0]): state.load_state(p)["model"]
              for p in state.checkpoints(tmp_path)}
    last = [k for k in states[1] if k.startswith("student.head.last")]
    assert last, sorted(states[1])
    moved = [any(not torch.equal(states[s][k], states[s + 1][k]) for k in last) for s in (1, 2)]
    assert moved == [False, True], moved


@pytest.mark.parametrize("terms", [[], V2], ids=["dino", "dinov2"])
def test_one_process_accumulation_and_two_ranks_train_the_same(tmp_path, terms):
    """The same global batch of 16 as one micro-batch, as 2 accumulated micro-batches of 8, and as
    two ranks of 8: each image's crops and masks follow its index in the run, the teacher is centred
    (running centre or Sinkhorn-Knopp) over the global batch and KoLeo's groups are fixed, so the
    losses and weights differ only by the float summation order."""
    steps = [*QUIET, "schedule.steps=4", *terms]
    run(vit(tmp_path / "one", *steps))
    run(vit(tmp_path / "accum", *steps, "data.micro_batch_size=8"))
    run(vit(tmp_path / "two", *steps, nproc=2))
    ref = losses(tmp_path / "one")
    assert len(ref) == 4
    for other in ("accum", "two"):
        found = losses(tmp_path / other)
        assert np.allclose(ref, found, rtol=0, atol=2e-5), (other, ref, found)
        a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("one", other))
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst < 5e-5, (other, worst)


def test_a_run_killed_at_a_checkpoint_resumes_to_the_same_weights(tmp_path):
    """SIGKILLed after its step-4 checkpoint, then the same command again: the teacher, its centre,
    the crops and the schedules of every later step are the uninterrupted run's."""
    steps = [*QUIET, "schedule.steps=8", "run.ckpt_every=4", "model.drop_path=0.1", "dino.ibot_weight=1"]
    run(vit(tmp_path / "straight", *steps))
    kill_when(ENV, vit(tmp_path / "killed", *steps), tmp_path / "killed" / "state-4.pt.sha256")
    resumed = run(vit(tmp_path / "killed", *steps))
    assert "resuming from" in resumed.stderr, resumed.stderr[-2000:]
    a, b = (load_weights(tmp_path / w / MODEL_FILE)[0] for w in ("straight", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert losses(tmp_path / "straight") == losses(tmp_path / "killed")[-8:]


def test_a_teacher_that_collapses_to_uniform_stops_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A teacher temperature of 100 flattens its outputs to uniform: the run stops at the first
    watched step, exit 2, one line naming the collapse and the key to change; the checkpoint written
    before it stays."""
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, *TINY, *QUIET,
                           "schedule.steps=6", "run.log_every=3", "run.ckpt_every=2", "dino.teacher_temp=100",
                           "dino.warmup_teacher_temp=100")
    assert code == 2, err
    line = " ".join(err.split())
    assert "collapsed to uniform" in line and "dino.teacher_temp" in line and "step 3" in line, line
    assert "Traceback" not in err
    assert (tmp_path / "state-2.pt").is_file() and not (tmp_path / MODEL_FILE).exists()


@pytest.mark.parametrize("extra, fragment", [
    (["model.pool=gap"], "reads the class token"),
    (["dino.local_crop_size=12"], "multiple of model.patch_size=8"),
    (["dino.global_crop_scale=[0.5,0.2]"], "dino.global_crop_scale"),
    (["dino.blur_prob=[1.0,0.5]"], "three probabilities"),
    (["dino.blur_sigma=[2.0,0.1]"], "dino.blur_sigma"),
    (["dino.koleo_weight=0.1", "dino.koleo_group=6"], "must divide data.batch_size=16"),
    (["ema.decay=0.99"], "already the student's EMA"),
    (["run.strategy=fsdp"], "trains with ddp"),
    (["dino.centering=sinkhorn_knopp"], "dino.centering"),
    (["dino.teacher_temp=0"], "dino.teacher_temp must be positive"),
    (["optim.weight_decay=0", "optim.weight_decay_end=0.4"], "needs optim.weight_decay > 0"),
    (["model.name=BiT-R50x1"], "objective: dino needs a plain ViT"),
    (["data.randaugment=rand-m9-mstd0.5"], "data.randaugment: objective: dino augments its crops"),
    (["data.hflip=false"], "data.hflip=false: objective: dino"),
    (["data.mixup_alpha=0.8"], "objective: dino has none"),
])
def test_impossible_dino_recipes_are_refused(extra, fragment):
    with pytest.raises(RecipeError, match=fragment.replace("[", r"\[")):
        resolve("pretrain", None, TINY + ["schedule.steps=10", *extra])


def test_a_choice_holding_a_newline_is_refused_on_one_line():
    """A shared recipe's value cannot break the error onto a second line (the value is quoted as
    Python writes it)."""
    with pytest.raises(RecipeError) as caught:
        resolve("pretrain", None, TINY + ["schedule.steps=10", "dino.centering=center\nrm -rf ~"])
    assert "\n" not in str(caught.value) and "'center\\nrm -rf ~' is not one of" in str(caught.value)


def test_dino_is_a_pretraining_objective():
    with pytest.raises(RecipeError, match="pretraining objective"):
        resolve("finetune", None, TINY + ["schedule.steps=10", "init.random=true"])
