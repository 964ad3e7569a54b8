"""recipes/bigvision/vit_s16_i1k.yaml is big_vision's configs/vit_s16_i1k.py: each value below is
copied by hand from that file (and the code that gives it meaning) and mapped onto vitcli's keys by
the rule the recipe's header states; then the decay and the learning rate a step sees are
big_vision's."""

import dataclasses
import math

import pytest

from helpers import REPO
from vitcli.checkpoints.complete import complete
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.train.optim import param_groups, torch_weight_decay
from vitcli.train.schedule import learning_rate, total_steps

# google-research/big_vision at 0127fb6b337ee2a27bf4e54dea79cff176527356 (2025-05-19),
# big_vision/configs/vit_s16_i1k.py
BIG_VISION = {
    "seed": 0, "total_epochs": 90, "loss": "softmax_xent", "input.data.split": "train[:99%]",
    "input.batch_size": 1024,
    "input.pp": "decode_jpeg_and_inception_crop(224)|flip_lr|randaug(2,10)|value_range(-1, 1)",
    "pp_eval": "decode|resize_small(256)|central_crop(224)", "log_training_steps": 50,
    "ckpt_steps": 1000,
    "model": {"variant": "S/16", "rep_size": True, "pool_type": "gap", "posemb": "sincos2d"},
    "grad_clip_norm": 1.0, "optax_name": "scale_by_adam", "lr": 0.001, "wd": 0.0001,
    "schedule": {"warmup_steps": 10_000, "decay_type": "cosine"}, "mixup.p": 0.2,
    "evals.minival.split": "train[99%:]", "evals.val.split": "validation", "evals.log_steps": 2500,
}
# models/vit.py decode_variant("S/16")
S_16 = {"width": 384, "depth": 12, "mlp_dim": 1536, "num_heads": 6, "patch": 16}
INCEPTION_AREA_MIN = 5  # pp/ops_image.py get_decode_jpeg_and_inception_crop(area_min=5), in percent
ADAM = (0.9, 0.999)  # optax.scale_by_adam's defaults
IMAGENET_TRAIN = 1_281_167


@pytest.fixture(scope="module")
def recipe():
    path = REPO / "recipes/bigvision/vit_s16_i1k.yaml"
    return resolve("pretrain", path, complete=complete, inputs=False)


def test_the_model_is_big_visions_vit_s16(recipe):
    m, bv = recipe.model, BIG_VISION["model"]
    assert (m.embed_dim, m.depth, m.mlp_dim, m.num_heads, m.patch_size) == tuple(S_16.values())
    assert m.pool == bv["pool_type"] and m.pos_embed == "sincos_2d" and bv["posemb"] == "sincos2d"
    assert m.representation_size == (S_16["width"] if bv["rep_size"] is True else bv["rep_size"])
    assert m.head_zero_init and m.head_bias_init == 0 and m.dropout == m.drop_path == 0
    assert m.img_size == 224


def test_the_data_is_big_visions_pipeline(recipe):
    d, pp = recipe.data, BIG_VISION["input.pp"].split("|")
    assert d.batch_size == BIG_VISION["input.batch_size"]
    assert pp[0] == "decode_jpeg_and_inception_crop(224)" and d.inception_crop
    assert d.crop_min_area == INCEPTION_AREA_MIN / 100
    assert pp[1] == "flip_lr" and d.hflip
    layers, magnitude = (int(v) for v in pp[2][len("randaug("):-1].split(","))
    assert d.randaugment == f"rand-m{magnitude}-n{layers}"
    lo, hi = (float(v) for v in pp[3][len("value_range("):-1].split(","))
    # value_range(lo, hi) maps x / 255 in [0, 1] to lo + (hi - lo) x; vitcli feeds (x / 255 - mean)
    # / std
    assert d.std == [1 / (hi - lo)] * 3 and d.mean == [-lo / (hi - lo)] * 3
    assert d.mixup_alpha == BIG_VISION["mixup.p"] and d.cutmix_alpha == 0 and d.mix_prob == 1
    resize, crop = (int(op[op.index("(") + 1:-1]) for op in BIG_VISION["pp_eval"].split("|")[1:])
    assert d.eval_crop_pct == crop / resize and d.eval_crop_mode == "center"


def test_minival_is_the_last_percent_the_train_split_leaves(recipe):
    d = recipe.data
    kept = int(BIG_VISION["input.data.split"][len("train[:"):-2])
    assert BIG_VISION["evals.minival.split"] == f"train[{kept}%:]"
    assert d.train_split == "train" and d.holdout == (100 - kept) / 100 and d.val_split == "holdout"
    assert d.test_split == BIG_VISION["evals.val.split"]


def test_the_optimizer_and_loss_are_big_visions(recipe):
    o, s = recipe.optim, recipe.schedule
    assert BIG_VISION["optax_name"] == "scale_by_adam" and o.name == "adamw"
    assert (o.beta1, o.beta2) == ADAM
    assert o.lr == BIG_VISION["lr"] and o.clip_grad_norm == BIG_VISION["grad_clip_norm"]
    assert o.loss == BIG_VISION["loss"].split("_")[0] and o.label_smoothing == 0
    assert s.epochs == BIG_VISION["total_epochs"]
    assert s.warmup_steps == BIG_VISION["schedule"]["warmup_steps"]
    assert s.decay == BIG_VISION["schedule"]["decay_type"] and s.end_lr == 0
    r = recipe.run
    assert (r.seed, r.log_every, r.ckpt_every) == (
        BIG_VISION["seed"], BIG_VISION["log_training_steps"], BIG_VISION["ckpt_steps"])
    assert r.eval_every == BIG_VISION["evals.log_steps"]


def big_vision_multiplier(step: int, total: int, warmup: int) -> float:
    """utils.create_learning_rate_schedule(base=1, decay_type="cosine", warmup_steps): s_t."""
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress)) * min(1.0, step / warmup)


def test_each_step_sees_big_visions_learning_rate_and_weight_decay(recipe):
    """optax.py chains scale(lr), add_decayed_weights(wd), scale_by_schedule: a step moves a weight
    by -s_t (lr x adam + wd x w). torch AdamW moves it by -lr_t adam - lr_t wd' w; so lr_t = lr s_t
    and lr_t wd' = wd s_t. big_vision's steps: round(epochs x train[:99%] / batch) (utils.steps)."""
    train = IMAGENET_TRAIN - round(IMAGENET_TRAIN * 0.01)  # what data.holdout leaves (test_holdout)
    steps = total_steps(0, recipe.schedule.epochs, train, recipe.data.batch_size)
    per_epoch = train / BIG_VISION["input.batch_size"]
    assert steps == round(BIG_VISION["total_epochs"] * per_epoch) == 111_477
    wd = torch_weight_decay(recipe.optim)
    for step in (0, 1, 5_000, 10_000, 50_000, 111_476):
        s_t = big_vision_multiplier(step, steps, BIG_VISION["schedule"]["warmup_steps"])
        lr_t = learning_rate(step, peak_lr=recipe.optim.lr, total_steps=steps,
                             warmup_steps=recipe.schedule.warmup_steps, decay=recipe.schedule.decay)
        assert lr_t == pytest.approx(BIG_VISION["lr"] * s_t, abs=1e-15)
        assert lr_t * wd == pytest.approx(BIG_VISION["wd"] * s_t, abs=1e-15)


def test_the_weights_decayed_are_big_visions_kernels(recipe):
    """wd_mults' default `.*/kernel$`: Dense and Conv kernels (patch embedding, attention, MLP,
    pre-logits, head); not biases, LayerNorm scales, nor the fixed sin-cos table. A one-block model
    of the recipe's kind."""
    cfg = dataclasses.replace(recipe.model, name="custom", img_size=32, patch_size=8, embed_dim=32,
                              depth=1, num_heads=2, mlp_dim=64, representation_size=32)
    model = zoo.build_model(cfg, 10)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, recipe.optim)
    decayed = {names[id(p)] for g in groups if g["weight_decay"] for p in g["params"]}
    kernels = {"patch_embed.proj.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
               "blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight", "pre_logits.fc.weight",
               "head.weight"}
    assert decayed == kernels
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "pos_embed" not in trained
