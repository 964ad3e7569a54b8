"""Today's training recipes (DeiT, T2T-ViT, AugReg, MAE's pretraining and fine-tune, DINO's and DINOv2's)
run their first
steps as shipped, shrunk only in size: a tiny network of the recipe's own family at 32 px on the
built-in data, a small batch and two steps, every other key as the file sets it (augmentation,
repeated augmentation, EMA, distillation, layer decay, loss, schedule, MAE's decoder). Each writes
its weights and logs both steps."""

import dataclasses

import pytest

from helpers import REPO
from vitcli.checkpoints.complete import complete
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run

# a model name fixes its sizes (naming ViT-L/16 and setting model.embed_dim=32 is refused), so the
# ViT recipes' networks are shrunk as `custom`; T2T-ViT's and timm's DeiTs' names are their architecture,
# so only their input shrinks
VIT = ["model.name=custom"]
SMALL = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
         "model.num_heads=2", "model.mlp_dim=64"]
RUN = ["data.source=synthetic", "data.synthetic.num_classes=4", "data.synthetic.train_size=96",
       "data.synthetic.img_size=32", "data.train_split=train", "data.val_split=", "data.test_split=",
       "data.batch_size=16", "data.micro_batch_size=0", "data.num_workers=0", "fewshot.every=0",
       "schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1", "run.log_every=1",
       "run.eval_every=0", "run.precision=fp32"]
# DINO's head and local crops, shrunk with the network (KoLeo's groups with the batch)
DINO = [*SMALL, "dino.out_dim=256", "dino.hidden_dim=64", "dino.bottleneck_dim=32", "dino.local_crop_size=16",
        "dino.koleo_group=8"]
RECIPES = {  # file -> (stage, what shrinks its network); DeiT-S and -B are DeiT-Ti's but for the name
    # timm's DeiTs at 32 px: a timm name's sizes are timm's too
    "recipes/deit/deit_tiny_i1k.yaml": ("pretrain", SMALL[:1]),
    "recipes/deit/deit_base_distilled_i1k.yaml": ("pretrain", SMALL[:1]),
    "recipes/paper/t2t_vit_14_i1k.yaml": ("pretrain", SMALL[:1]),  # T2T-ViT-14 itself, at 32 px
    "recipes/augreg/vit_s16_i21k.yaml": ("pretrain", [*VIT, *SMALL]),
    "recipes/augreg/vit_b16_i21k.yaml": ("pretrain", [*VIT, *SMALL]),
    "recipes/finetune/mae_vit_b16_i1k.yaml": ("finetune", [*VIT, *SMALL]),
    "recipes/pretrain/mae_vit_b16_i1k.yaml": ("pretrain", [*VIT, *SMALL]),  # MAE's 8-block decoder as shipped
    "recipes/pretrain/mae_vit_l16_i1k.yaml": ("pretrain", [*VIT, *SMALL]),
    "recipes/pretrain/dino_vit_s16_i1k.yaml": ("pretrain", [*VIT, *DINO]),
    # iBOT, KoLeo, layer decay as shipped
    "recipes/pretrain/dinov2_vit_l16_i1k.yaml": ("pretrain", [*VIT, *DINO]),
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny teacher of the student's 4 classes, for the distilled recipe (its own is a Hub
    download)."""
    workdir = tmp_path_factory.mktemp("teacher")
    one_run(resolve("pretrain", None, [*SMALL, *RUN], complete=complete), workdir)
    return workdir


@pytest.mark.parametrize("path", list(RECIPES), ids=lambda p: p.split("/")[-1])
def test_a_shipped_recipe_runs_its_first_steps(path, tmp_path, teacher):
    stage, shrink = RECIPES[path]
    text = (REPO / path).read_text()
    extra = [f"distill.teacher={teacher}", "distill.teacher_model="] if "distill:" in text else []
    r = resolve(stage, REPO / path, [*shrink, *RUN, *extra], complete=complete)
    if r.model.name == "custom":  # shrunk as asked
        assert (r.model.embed_dim, r.model.depth) == (32, 1), r.model
    summary = one_run(r, tmp_path)
    steps = [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row]
    assert steps == [1, 2] and summary["steps"] == 2 and (tmp_path / "model.safetensors").is_file()
    kept = {"ema.decay": r.ema.decay, "data.repeated_aug": r.data.repeated_aug,
            "optim.layer_decay": r.optim.layer_decay, "distill.type": r.distill.type,
            "data.randaugment": r.data.randaugment, "objective": r.objective.replace("supervised", "")}
    assert any(v not in (0, 0.0, 1, 1.0, "", "none") for v in kept.values()), kept  # today's keys, as set


@pytest.mark.parametrize("name", ["deit_small", "deit_base"])
def test_deit_s_and_b_are_deit_ti_but_for_the_network(name):
    """Table 9 trains the three sizes alike: their files differ in the model's name (and the header)
    only, so DeiT-Ti's run above stands for theirs."""
    ti, other = (resolve("pretrain", REPO / f"recipes/deit/{n}_i1k.yaml", complete=complete, inputs=False)
                 for n in ("deit_tiny", name))
    assert other.model.name == f"{name}_patch16_224" and other.model.embed_dim > ti.model.embed_dim
    assert dataclasses.replace(other, model=ti.model) == ti
