"""One loss definition: the trainer and the held-out evaluators both use the recipe's optim.loss, so
val/loss is the quantity train/loss is. References are written out here, independently, as
big_vision writes them."""

import numpy as np
import pytest
import torch

from helpers import bv_sigmoid_xent, bv_softmax_xent
from vitcli.recipe.schema import OptimConfig
from vitcli.train.losses import loss_fn


def smoothed(y: np.ndarray, k: int, smoothing: float) -> np.ndarray:
    return np.eye(k)[y] * (1 - smoothing) + smoothing / k


@pytest.mark.parametrize("name, reference", [("sigmoid", bv_sigmoid_xent), ("softmax", bv_softmax_xent)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_loss_is_big_visions_with_smoothed_labels(name, reference, smoothing):
    rng = np.random.default_rng(0)
    logits, y = rng.normal(size=(16, 5)) * 3, rng.integers(0, 5, size=16)
    loss = loss_fn(OptimConfig(loss=name, label_smoothing=smoothing))
    got = loss(torch.tensor(logits, dtype=torch.float64), torch.tensor(y)).item()
    assert got == pytest.approx(reference(logits, smoothed(y, 5, smoothing)), rel=1e-9)
    soft = smoothed(y[::-1].copy(), 5, 0.3)  # mixup's soft targets are taken as they are
    got = loss(torch.tensor(logits, dtype=torch.float64), torch.tensor(soft)).item()
    assert got == pytest.approx(reference(logits, soft), rel=1e-9)


