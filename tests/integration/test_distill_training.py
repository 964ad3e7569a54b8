"""Distillation runs as a user runs it: a teacher from a checkpoint of ours or a timm CNN saved to
safetensors, frozen through training, the student a plain ViT or a DeiT distilled one."""

import pytest
import timm
import torch
from safetensors.torch import save_file

from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.read import Loaded
from vitcli.checkpoints.weights import load_weights
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DistillConfig
from vitcli.run.build import build_job
from vitcli.runtime.dist import setup
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run
from vitcli.train import distill, loop

CLASSES = 4
SIZES = ("model.patch_size", "model.embed_dim", "model.depth", "model.num_heads", "model.mlp_dim")
TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
    "model.mlp_dim=64", f"data.synthetic.num_classes={CLASSES}", "data.synthetic.train_size=64",
    "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "data.val_split=",
    "data.test_split=", "schedule.warmup_steps=1", "schedule.steps=2", "run.log_every=1",
    "run.precision=fp32", "data.crop_min_area=1.0", "optim.lr=3e-3",
]


def recipe(*extra, sized: bool = True):
    """TINY and `extra`; `sized=False` leaves the network's sizes to a timm name (which fixes them)."""
    given = TINY if sized else [o for o in TINY if not o.startswith(SIZES)]
    return resolve("pretrain", None, given + list(extra), complete=complete)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher of ours: a vitcli workdir, 3 steps of a 2-block ViT wider than the student."""
    workdir = tmp_path_factory.mktemp("teacher")
    one_run(recipe("model.depth=2", "model.embed_dim=64", "model.num_heads=4", "schedule.steps=3"), workdir)
    return workdir


def test_a_tiny_pretrain_learns_from_a_teacher_of_ours(teacher, tmp_path):
    """2 steps, hard and soft: the loss is logged, and the weights differ from the run without a
    teacher; with alpha 0 they are the same bit for bit (building the teacher draws nothing from the
    run's RNG)."""
    runs = {"none": [], "hard": ["distill.type=hard"], "soft": ["distill.type=soft", "distill.tau=2"],
            "zero": ["distill.type=soft", "distill.alpha=0"]}
    weights = {}
    for name, keys in runs.items():
        extra = [f"distill.teacher={teacher}", *keys] if keys else []
        one_run(recipe(*extra), tmp_path / name)
        rows = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/loss" in r]
        assert [r["step"] for r in rows] == [1, 2] and all(r["train/loss"] > 0 for r in rows)
        weights[name] = load_weights(tmp_path / name / "model.safetensors")[0]
    plain = weights["none"]
    same = {name: all(torch.equal(v, plain[k]) for k, v in sd.items()) for name, sd in weights.items()}
    assert same == {"none": True, "hard": False, "soft": False, "zero": True}


def test_the_teacher_stays_frozen_and_outside_the_optimizer(teacher, tmp_path, monkeypatch):
    """Through training: in eval mode, no gradient, its weights unchanged, none of its tensors in
    the optimizer, whose state covers the student's parameters alone."""
    r = recipe(f"distill.teacher={teacher}", "distill.type=soft", "run.compile=false")
    dist = setup("cpu")
    job = build_job(r, tmp_path, dist)
    before = {k: v.clone() for k, v in job.objective.teacher.state_dict().items()}
    built, build = [], loop.build_optimizer

    def kept(model, cfg):  # the loop's own optimizer, kept to be looked at
        built.append(build(model, cfg))
        return built[-1]

    monkeypatch.setattr(loop, "build_optimizer", kept)
    loop.train(job, dist)
    frozen = job.objective.teacher
    assert not any(m.training for m in frozen.modules())
    assert all(not p.requires_grad and p.grad is None for p in frozen.parameters())
    assert all(torch.equal(v, before[k]) for k, v in frozen.state_dict().items())
    optimized = {id(p) for group in built[0].param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in frozen.parameters()}
    assert built[0].state and set(map(id, built[0].state)) <= {id(p) for p in job.model.parameters()}


def test_a_deit_distilled_student_learns_from_a_timm_cnn(tmp_path):
    """DeiT's setting in small: a timm CNN teacher (test_resnet standing in for RegNetY) read from a
    safetensors file with distill.teacher_model naming its architecture, and a DeiT distilled
    student trained through its distillation token."""
    torch.manual_seed(0)
    cnn = timm.create_model("test_resnet", num_classes=CLASSES)
    save_file({k: v.contiguous() for k, v in cnn.state_dict().items()}, str(tmp_path / "cnn.safetensors"))
    r = recipe("model.name=deit_tiny_distilled_patch16_224",
               f"distill.teacher={tmp_path / 'cnn.safetensors'}", "distill.teacher_model=test_resnet",
               "distill.type=hard", "data.batch_size=8", sized=False)  # DeiT-Ti itself, at 32 px
    assert build_job(r, tmp_path / "job", setup("cpu")).model.distilled_training  # (class, distillation)
    one_run(r, tmp_path / "run")
    sd, _ = load_weights(tmp_path / "run" / "model.safetensors")
    assert {"dist_token", "head_dist.weight"} <= set(sd)
    assert sd["head.weight"].any() and sd["head_dist.weight"].any(), "both heads left zero: trained"
    # fine-tuned on other classes, as any checkpoint: both heads new, zero, of the new classes (a
    # pair of heads once stopped `vit finetune` with "'tuple' object has no attribute 'weight'")
    ft = resolve("finetune", None, [*TINY, f"init.checkpoint={tmp_path / 'run'}", "data.batch_size=8",
                                    "data.synthetic.num_classes=6"], complete=complete)
    job = build_job(ft, tmp_path / "ft-job", setup("cpu"))
    heads = {k: v for k, v in job.model.state_dict().items() if k.startswith(("head.", "head_dist."))}
    assert sorted(heads) == ["head.bias", "head.weight", "head_dist.bias", "head_dist.weight"]
    assert all(v.shape[0] == 6 and not v.any() for v in heads.values())
    one_run(ft, tmp_path / "ft")


def test_a_timm_name_is_its_own_architecture():
    """A teacher named by timm (downloaded: untested offline) is built as that architecture, tag
    dropped."""
    loaded = Loaded({}, {}, "hub", "test_resnet.r160_in1k")
    named = DistillConfig(teacher=loaded.path, type="hard")
    cfg = distill.teacher_config(loaded, describe(loaded), named, 32)
    assert (cfg.name, cfg.img_size) == ("test_resnet", 32)
