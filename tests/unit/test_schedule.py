"""The learning-rate schedule against closed forms and timm's cosine scheduler."""

import math

import pytest

from vitcli.train.schedule import learning_rate, total_steps


def test_warmup_is_linear_from_zero():
    lrs = [learning_rate(s, peak_lr=1e-3, total_steps=100, warmup_steps=10, decay="linear")
           for s in range(11)]
    assert lrs[0] == 0.0
    assert lrs == pytest.approx([1e-3 * s / 10 for s in range(11)], rel=1e-12)


def test_linear_decay_reaches_end_lr():
    kw = {"peak_lr": 1.0, "total_steps": 110, "warmup_steps": 10, "decay": "linear", "end_lr": 0.1}
    assert learning_rate(10, **kw) == pytest.approx(1.0)
    assert learning_rate(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(110, **kw) == pytest.approx(0.1)


def test_cosine_matches_timm():
    """timm's CosineLRScheduler with a warmup prefix is an independent implementation of the same
    curve."""
    import torch
    from timm.scheduler import CosineLRScheduler

    total, warmup, peak = 200, 20, 0.03
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    ref = CosineLRScheduler(opt, t_initial=total - warmup, warmup_t=warmup, warmup_lr_init=0.0,
                            warmup_prefix=True, lr_min=0.0, cycle_limit=1)
    for step in range(total):
        expected = ref._get_lr(step)[0]
        got = learning_rate(step, peak_lr=peak, total_steps=total, warmup_steps=warmup, decay="cosine")
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), step


def test_constant_and_total_steps():
    assert learning_rate(50, peak_lr=0.5, total_steps=100, warmup_steps=0, decay="constant") == 0.5
    assert total_steps(0, 90, 1_281_167, 4096) == math.ceil(90 * 1_281_167 / 4096)
    assert total_steps(123, 90, 10, 1) == 123
