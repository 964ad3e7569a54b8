"""Weight EMA (train/ema.py) against timm's ModelEmaV3 itself: the decay schedule, the weights after
a sequence of updates (exact: the same foreach kernel on the same fp32 numbers), the swap that
evaluates and exports the EMA, its saved state, and the recipe keys that configure it."""

import dataclasses
import re

import pytest
import torch
from timm.utils.model_ema import ModelEmaV3
from torch import nn

from helpers import tiny_vit
from vitcli.errors import CheckpointError, RecipeError
from vitcli.figures.curves import panel
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import EmaConfig
from vitcli.train.ema import WeightEma, ema_decay, ema_metric

CONFIGS = {  # the settings ModelEmaV3 takes, each path of get_decay taken
    "plain": EmaConfig(decay=0.9),
    "warmup": EmaConfig(decay=0.99, warmup=True),
    "warmup_capped": EmaConfig(decay=0.6, warmup=True, warmup_gamma=2.0, warmup_power=0.75),
    "warmup_floor": EmaConfig(decay=0.95, min_decay=0.5, warmup=True),
    "after_step": EmaConfig(decay=0.8, update_after_step=3, warmup=True, warmup_power=1.0),
}


def timm_ema(model: nn.Module, cfg: EmaConfig, **kw) -> ModelEmaV3:
    return ModelEmaV3(model, decay=cfg.decay, min_decay=cfg.min_decay,
                      update_after_step=cfg.update_after_step, use_warmup=cfg.warmup,
                      warmup_gamma=cfg.warmup_gamma, warmup_power=cfg.warmup_power, **kw)


class Normed(nn.Module):
    """A model with buffers beside its parameters: BatchNorm's float running statistics (averaged,
    as ModelEmaV3 averages every floating state-dict entry) and its integer batch count (copied by
    timm)."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def moved(model: nn.Module, generator: torch.Generator) -> None:
    """One "optimizer step": every floating state entry moves by a random amount (buffers too)."""
    with torch.no_grad():
        for v in model.state_dict().values():
            if v.is_floating_point():
                v.add_(torch.randn(v.shape, generator=generator).to(v.dtype))


def floating(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point()}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_decay_is_timms_get_decay_at_every_step(name):
    cfg = CONFIGS[name]
    reference = timm_ema(nn.Linear(1, 1), cfg)
    decays = [ema_decay(step, cfg) for step in range(60)]
    assert decays == [reference.get_decay(step) for step in range(60)]  # exact: the same float maths
    assert decays[: cfg.update_after_step + 2] == [0.0] * (cfg.update_after_step + 2), "first a copy"
    assert len(set(decays)) > 2 if cfg.warmup else set(decays) == {0.0, cfg.decay}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("make", [lambda: tiny_vit(num_classes=3), Normed])
def test_the_ema_after_n_updates_is_timms_model_ema_v3_fed_the_same_weights(name, make):
    """Exact (torch.equal): both run torch._foreach_lerp_ with the same host weight on the same fp32
    tensors, warm-up and update_after_step included."""
    cfg, model, g = CONFIGS[name], make(), torch.Generator().manual_seed(0)
    ours, reference = WeightEma(model, cfg), timm_ema(model, cfg)
    moved(model, g)  # the EMA's first update copies whatever the weights are by then
    for step in range(1, 13):
        ours.update(model, step)
        reference.update(model, step=step)
        moved(model, g)
    expected = floating(reference.module.state_dict())
    assert ours.state_dict().keys() == expected.keys()
    assert all(torch.equal(ours.state_dict()[k], expected[k]) for k in expected)
    live = floating(model.state_dict())
    assert not any(torch.equal(ours.state_dict()[k], live[k]) for k in live), "an average, not the weights"


def test_a_low_precision_model_keeps_its_ema_in_fp32_as_timm_with_dtype_float32():
    """A bf16 model: the EMA stays fp32 (a bf16 one would round the small (1 - decay) steps away),
    updated with ModelEmaV3's mul and add for mixed dtypes; the same numbers as
    ModelEmaV3(dtype=torch.float32)."""
    cfg, model, g = CONFIGS["warmup"], tiny_vit(num_classes=3).to(torch.bfloat16), torch.Generator()
    ours, reference = WeightEma(model, cfg), timm_ema(model, cfg, dtype=torch.float32)
    for step in range(1, 8):
        moved(model, g)
        ours.update(model, step)
        reference.update(model, step=step)
    expected = floating(reference.module.state_dict())
    assert {v.dtype for v in ours.state_dict().values()} == {torch.float32}
    assert all(torch.equal(ours.state_dict()[k], expected[k]) for k in expected)


def test_inside_swapped_the_model_holds_the_ema_and_after_it_its_own_weights_bit_for_bit():
    model, g = Normed(), torch.Generator().manual_seed(1)
    ema = WeightEma(model, CONFIGS["plain"])
    for step in range(1, 4):
        moved(model, g)
        ema.update(model, step)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped(model):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(inside[k], v) for k, v in ema.state_dict().items())
    assert not all(torch.equal(inside[k], before[k]) for k in ema.state_dict())
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert torch.equal(inside["bn.num_batches_tracked"], before["bn.num_batches_tracked"])


def test_a_saved_ema_loads_back_exactly_and_one_of_another_model_is_refused():
    model, g = tiny_vit(num_classes=3), torch.Generator().manual_seed(2)
    ema = WeightEma(model, CONFIGS["warmup"])
    for step in range(1, 4):
        moved(model, g)
        ema.update(model, step)
    saved = {k: v.clone() for k, v in ema.state_dict().items()}
    fresh = WeightEma(tiny_vit(num_classes=3, seed=5), CONFIGS["warmup"])
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)
    with pytest.raises(CheckpointError, match=re.escape("(head.bias is in one only)")):
        fresh.load_state_dict({k: v for k, v in saved.items() if k != "head.bias"})


def test_metrics_of_the_ema_weights_are_named_beside_the_live_ones_and_drawn_in_their_panels():
    assert ema_metric("val/top1") == "val_ema/top1"
    assert ema_metric("test/loss") == "test_ema/loss"
    assert ema_metric("fewshot/cifar100/5shot") == "fewshot_ema/cifar100/5shot"
    for name in ("val/top1", "val/loss", "test/mpp_accuracy", "fewshot/cifar100/5shot"):
        assert panel(ema_metric(name)) == panel(name) is not None, name


@pytest.mark.parametrize("overrides, fragment", [
    (["ema.decay=1"], "ema.decay must be in [0, 1), got 1.0"),
    (["ema.decay=-0.5"], "ema.decay must be in [0, 1), got -0.5"),
    (["ema.decay=0.9", "ema.min_decay=0.95"], "ema.min_decay=0.95 is above ema.decay=0.9"),
    (["ema.save=best"], "ema.save: 'best' is not one of live, ema"),
    (["ema.save=ema"], "ema.save=ema, but ema.decay=0 keeps no EMA weights"),
    (["ema.warmup_gamma=0"], "ema.warmup_gamma must be positive, got 0.0"),
    (["ema.warmup_power=-1"], "ema.warmup_power must be positive, got -1.0"),
    (["ema.update_after_step=-1"], "ema.update_after_step must be >= 0, got -1"),
    (["ema.decay=nan"], "ema.decay must be a finite number"),
    (["ema.warmup=sometimes"], "ema.warmup: expected bool, got 'sometimes'"),
])
def test_a_bad_ema_key_is_refused_with_one_line_naming_it(overrides, fragment):
    with pytest.raises(RecipeError, match=re.escape(fragment)) as e:
        resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1", *overrides])
    assert "\n" not in str(e.value)


def test_the_ema_keys_resolve_to_timms_defaults_and_off():
    r = resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1"])
    assert r.ema == EmaConfig() and r.ema.decay == 0 and r.ema.save == "live"
    reference = ModelEmaV3(nn.Linear(1, 1))
    e = r.ema
    assert (e.min_decay, e.update_after_step, e.warmup, e.warmup_gamma, e.warmup_power) == (
        reference.min_decay, reference.update_after_step, reference.use_warmup, reference.warmup_gamma,
        reference.warmup_power)
    on = resolve("pretrain", None, ["schedule.steps=10", "schedule.warmup_steps=1", "ema.decay=0.9998",
                                    "ema.warmup=true", "ema.save=ema"])
    assert dataclasses.asdict(on.ema) == {**dataclasses.asdict(EmaConfig()), "decay": 0.9998, "warmup": True,
                                          "save": "ema"}
