"""val/loss is the quantity train/loss is: a run with optim.loss=sigmoid reports big_vision's
sigmoid_xent on the val logits (the loss formulas themselves: unit/test_loss.py)."""

import numpy as np
import pytest
import torch

from helpers import bv_sigmoid_xent, bv_softmax_xent
from vitcli.checkpoints.weights import load_weights
from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.runtime.run_files import METRICS_FILE, MODEL_FILE
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=48", "data.synthetic.test_size=32", "data.batch_size=32",
        "data.num_workers=0", "data.eval_batch_size=32", "schedule.steps=3", "schedule.warmup_steps=1",
        "run.eval_every=2", "run.precision=fp32"]


def test_val_loss_is_the_recipes_sigmoid_loss(tmp_path):
    """optim.loss=sigmoid (the paper's ImageNet-21k recipes): val/loss is big_vision's sigmoid_xent
    on the val logits, not softmax cross-entropy, at every evaluation as in the final one."""
    r = resolve("pretrain", None, TINY + ["optim.loss=sigmoid"])
    results = one_run(r, tmp_path)
    logits, y = val_logits(r, tmp_path)
    assert len(y) == 48
    want = bv_sigmoid_xent(logits, np.eye(4)[y])
    assert results["val/loss"] == pytest.approx(want, rel=1e-5)
    # the two losses would not pass for each other
    assert abs(want - bv_softmax_xent(logits, np.eye(4)[y])) > 0.1
    logged = [row["val/loss"] for row in read_metrics(tmp_path / METRICS_FILE) if "val/loss" in row]
    assert len(logged) == 2 and logged[-1] == pytest.approx(want, rel=1e-5)


def val_logits(r, workdir) -> tuple[np.ndarray, np.ndarray]:
    """The finished run's logits on its val split, computed here from model.safetensors."""
    model = zoo.build_model(r.model, 4)
    model.load_state_dict(load_weights(workdir / MODEL_FILE)[0])
    ds = sources.load_split(r.data, r.data.val_split)
    with torch.inference_mode():
        pairs = [(model.eval()(x).double().numpy(), y.numpy())
                 for x, y in batches.eval_batches(ds, r.data, r.model.img_size, r.data.eval_batch_size)]
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
