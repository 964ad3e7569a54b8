"""The weight EMA on a GPU: kept on the model's device in fp32, its update and its swap never make
the host wait for the GPU, and a compiled bf16 run evaluates and exports it."""

import math

import torch

from vitcli.checkpoints.weights import load_weights
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import EmaConfig, ModelConfig
from vitcli.stages.run import one_run
from vitcli.train.ema import WeightEma

TINY = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)


def test_the_ema_lives_beside_the_model_and_its_update_and_swap_never_wait_for_the_gpu(cuda):
    model = zoo.build_model(TINY, 4).to(cuda)
    ema = WeightEma(model, EmaConfig(decay=0.999, warmup=True))
    assert {(v.device, v.dtype) for v in ema.state_dict().values()} == {(cuda, torch.float32)}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            ema.update(model, step)
        with ema.swapped(model):
            pass
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_compiled_bf16_run_evaluates_and_exports_its_ema(tmp_path):
    r = resolve("pretrain", None, [
        "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.img_size=32", "data.batch_size=16",
        "data.num_workers=0", "schedule.warmup_steps=1", "data.test_split=", "schedule.steps=4",
        "run.eval_every=2", "run.precision=auto", "run.compile=auto", "ema.decay=0.9", "ema.warmup=true",
        "ema.save=ema"])
    summary = one_run(r, tmp_path)
    assert 0 <= summary["val_ema/top1"] <= 1 and math.isfinite(summary["val_ema/loss"])
    assert load_weights(tmp_path / "model.safetensors")[1]["weights"] == "ema"
