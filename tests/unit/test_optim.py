"""Weight-decay conventions: torch's (decay scaled by the learning rate) and big_vision's (by the
schedule only), each held against the update rule written out by hand."""

import copy

import pytest
import torch

from vitcli.recipe.schema import OptimConfig
from vitcli.train.optim import build_optimizer, torch_weight_decay

LR, WD, STEPS = 1e-2, 1e-3, 6
MULTIPLIERS = [0.2, 0.6, 1.0, 0.8, 0.4, 0.1]  # s_t: a warmup-then-decay schedule's factor on the peak lr


def model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)  # weight (a kernel, decayed) and bias (not decayed)
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(STEPS)]
    return model, grads


def run_ours(cfg: OptimConfig, model, grads, fast: bool = True) -> dict[str, torch.Tensor]:
    opt = build_optimizer(model, cfg, fast)
    for s, g in zip(MULTIPLIERS, grads):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * s  # what the trainer's schedule sets each step
        for n, p in model.named_parameters():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def big_vision_adam(params, grads, b1=0.9, b2=0.999, eps=1e-8):
    """optax chain(scale_by_adam, scale(lr), add_decayed_weights(wd, kernels), scale_by_schedule,
    scale(-1))."""
    p = {n: t.detach().clone() for n, t in params}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    for t, (s, g) in enumerate(zip(MULTIPLIERS, grads), start=1):
        for n, w in list(p.items()):
            m[n] = b1 * m[n] + (1 - b1) * g[n]
            v[n] = b2 * v[n] + (1 - b2) * g[n] ** 2
            u = (m[n] / (1 - b1**t)) / ((v[n] / (1 - b2**t)).sqrt() + eps) * LR
            if n == "weight":
                u = u + WD * w
            p[n] = w - s * u
    return p


def big_vision_momentum(params, grads, momentum=0.9):
    """optax chain(trace(momentum), scale(lr), add_decayed_weights(wd, kernels), scale_by_schedule,
    scale(-1))."""
    p = {n: t.detach().clone() for n, t in params}
    buf = {n: torch.zeros_like(t) for n, t in p.items()}
    for s, g in zip(MULTIPLIERS, grads):
        for n, w in list(p.items()):
            buf[n] = g[n] + momentum * buf[n]
            u = LR * buf[n] + (WD * w if n == "weight" else 0)
            p[n] = w - s * u
    return p


@pytest.mark.parametrize("name,reference", [("adamw", big_vision_adam), ("sgd", big_vision_momentum)])
def test_big_vision_convention_follows_the_optax_update(name, reference):
    model, grads = model_and_grads()
    expected = reference(model.named_parameters(), grads)
    cfg = OptimConfig(name=name, lr=LR, weight_decay=WD, weight_decay_convention="big_vision")
    got = run_ours(cfg, copy.deepcopy(model), grads)
    for n in expected:  # float32 arithmetic in both: tolerance a few ulps of the parameter scale
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-7)


def test_torch_convention_decays_by_the_learning_rate_times_weight_decay():
    # with zero gradients AdamW only decays: w_T = w_0 * prod_t (1 - lr * s_t * wd)
    model, grads = model_and_grads()
    zero = [{n: torch.zeros_like(t) for n, t in g.items()} for g in grads]
    w0 = model.weight.detach().clone()
    got = run_ours(OptimConfig(lr=LR, weight_decay=0.3), model, zero)
    factor = torch.tensor([1 - LR * s * 0.3 for s in MULTIPLIERS], dtype=torch.float64).prod()
    torch.testing.assert_close(got["weight"].double(), w0.double() * factor, rtol=1e-6, atol=0)


def test_conventions_differ_by_the_peak_learning_rate():
    assert torch_weight_decay(OptimConfig(lr=1e-3, weight_decay=1e-4, weight_decay_convention="big_vision")) \
        == pytest.approx(0.1)  # big_vision's ViT configs: wd 1e-4 at lr 1e-3, the AugReg paper's "0.1"
    assert torch_weight_decay(OptimConfig(lr=1e-3, weight_decay=0.1)) == 0.1


@pytest.mark.parametrize("convention", ["torch", "big_vision"])
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_or_foreach_step_equals_the_per_tensor_loop(name, convention):
    model, grads = model_and_grads(seed=1)
    cfg = OptimConfig(name=name, lr=LR, weight_decay=WD, weight_decay_convention=convention)
    fast_opt = build_optimizer(copy.deepcopy(model), cfg)
    assert any(fast_opt.defaults.get(k) for k in ("fused", "foreach")), fast_opt.defaults  # not the loop
    fast = run_ours(cfg, copy.deepcopy(model), grads)
    loop = run_ours(cfg, copy.deepcopy(model), grads, fast=False)
    for n in loop:  # the same float32 update, summed in another order: a few ulps apart at most
        torch.testing.assert_close(fast[n], loop[n], rtol=1e-6, atol=1e-7)
