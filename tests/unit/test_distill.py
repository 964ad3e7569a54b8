"""Distillation is DeiT's: the losses against a transliteration of facebookresearch/deit `losses.py`
(DistillationLoss, at commit 7e160fe) on the same logits, DeiT's base criteria (timm's), the teacher
frozen, and a distilled student predicting with the mean of its two heads."""

import pytest
import torch
import torch.nn.functional as F
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

from vitcli.errors import RecipeError
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DistillConfig, ModelConfig, OptimConfig
from vitcli.train import distill
from vitcli.train.losses import loss_fn

B, K, SMOOTHING = 8, 5, 0.1


class DeitDistillationLoss(torch.nn.Module):
    """facebookresearch/deit losses.py DistillationLoss.forward, transliterated (comments
    dropped)."""

    def __init__(self, base_criterion, teacher_model, distillation_type, alpha, tau):
        super().__init__()
        self.base_criterion, self.teacher_model = base_criterion, teacher_model
        assert distillation_type in ["none", "soft", "hard"]
        self.distillation_type, self.alpha, self.tau = distillation_type, alpha, tau

    def forward(self, inputs, outputs, labels):
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss
        if outputs_kd is None:
            raise ValueError("expected a Tuple[Tensor, Tensor]")
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs)
        if self.distillation_type == "soft":
            T = self.tau
            distillation_loss = F.kl_div(
                F.log_softmax(outputs_kd / T, dim=1),
                F.log_softmax(teacher_outputs / T, dim=1),
                reduction="sum",
                log_target=True,
            ) * (T * T) / outputs_kd.numel()
        elif self.distillation_type == "hard":
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))
        return base_loss * (1 - self.alpha) + distillation_loss * self.alpha


def tiny_teacher() -> torch.nn.Module:
    """A frozen stand-in teacher that reads its images: (B, 3, 4, 4) -> (B, K) logits."""
    teacher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, K))
    with torch.no_grad():
        teacher[1].weight.normal_(0, 1.0)
    return teacher.requires_grad_(False).eval()


def draws(soft_targets: bool):
    """(images, class-token logits, distillation-token logits, target) of one batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, 4, 4, generator=g)
    cls, dist = (torch.randn(B, K, generator=g) * 3 for _ in range(2))
    y = torch.randint(0, K, (B,), generator=g)
    if soft_targets:  # mixup's: two smoothed one-hots mixed
        y = 0.7 * F.one_hot(y, K) + 0.3 * F.one_hot(y.flip(0), K)
    return x, cls.requires_grad_(), dist.requires_grad_(), y.float() if soft_targets else y


@pytest.mark.parametrize("kind, tau, alpha", [("hard", 1.0, 0.5), ("soft", 1.0, 0.5), ("soft", 3.0, 0.2),
                                              ("hard", 1.0, 1.0)])
@pytest.mark.parametrize("soft_targets", [False, True])
@pytest.mark.parametrize("token", [True, False])
def test_the_loss_is_deits_distillation_loss(kind, tau, alpha, soft_targets, token):
    """Through the distillation token, the class-token logits meet the labels and the
    distillation-token logits the teacher; on the class token (token=False), both terms read the
    same logits, which is DeiT's loss handed the pair (logits, logits). DeiT's base criterion:
    timm's SoftTargetCrossEntropy after mixup, LabelSmoothingCrossEntropy otherwise. fp32, tolerance
    1e-6."""
    x, cls, dist, y = draws(soft_targets)
    teacher = tiny_teacher()
    base = SoftTargetCrossEntropy() if soft_targets else LabelSmoothingCrossEntropy(SMOOTHING)
    cfg = DistillConfig(teacher="t", type=kind, alpha=alpha, tau=tau)
    ours = distill.criterion(loss_fn(OptimConfig(label_smoothing=SMOOTHING)), teacher, cfg)
    outputs = (cls, dist) if token else cls
    theirs = DeitDistillationLoss(base, teacher, kind, alpha, tau)
    expected = theirs(x, outputs if token else (cls, cls), y)
    got = ours(outputs, y, x)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # and the student's gradients are the reference's
    grads = torch.autograd.grad(got, [cls, dist] if token else [cls])
    want = torch.autograd.grad(expected, [cls, dist] if token else [cls])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_terms_are_the_formulas_the_issue_states():
    """Written out without F.kl_div: sum of p_t (log p_t - log p_s) at temperature tau, x tau^2, /
    (B x K); and the mean negative log-probability of the teacher's top class. float64, tolerance
    1e-12."""
    g = torch.Generator().manual_seed(1)
    s, t, tau = torch.randn(B, K, generator=g, dtype=torch.float64), torch.randn(B, K, generator=g,
                                                                                 dtype=torch.float64), 2.0
    log_ps, log_pt = (torch.log_softmax(v / tau, dim=1) for v in (s, t))
    soft = (log_pt.exp() * (log_pt - log_ps)).sum() * tau * tau / (B * K)
    assert distill.soft_distillation(s, t, tau).item() == pytest.approx(soft.item(), abs=1e-12)
    hard = -torch.log_softmax(s, dim=1)[torch.arange(B), t.argmax(1)].mean()
    assert distill.hard_distillation(s, t).item() == pytest.approx(hard.item(), abs=1e-12)


def test_without_a_teacher_the_loss_is_the_recipes():
    x, cls, _, y = draws(False)
    base = loss_fn(OptimConfig(label_smoothing=SMOOTHING))
    assert torch.equal(distill.criterion(base, None, DistillConfig())(cls, y, x), base(cls, y))


def test_the_teacher_gets_no_gradient_and_the_student_does():
    x, cls, dist, y = draws(False)
    teacher = tiny_teacher()
    loss = distill.criterion(loss_fn(OptimConfig()), teacher, DistillConfig(teacher="t", type="soft"))(
        (cls, dist), y, x)
    loss.backward()
    assert cls.grad is not None and dist.grad is not None and dist.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())


def distilled_student(**kw) -> torch.nn.Module:
    cfg = ModelConfig(name="deit_tiny_distilled_patch16_224", img_size=32, **kw)
    torch.manual_seed(0)
    return zoo.build_model(cfg, K)


def test_a_distilled_student_predicts_with_the_mean_of_its_two_heads():
    """Trained through its distillation token, timm's VisionTransformerDistilled returns both heads'
    logits; evaluated, their mean (DeiT's inference), which is what the evaluators score."""
    model = distilled_student(head_zero_init=False)
    distill.use_distillation_token(model, DistillConfig(teacher="t", type="hard"))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cls, dist = model.train()(x)  # no dropout or drop-path: the same forward as in eval
        mean = model.eval()(x)
    assert not torch.allclose(cls, dist), "two different heads, or the mean would prove nothing"
    torch.testing.assert_close(mean, (cls + dist) / 2, rtol=1e-5, atol=1e-6)


def test_only_distillation_trains_through_the_token():
    """Without a teacher a distilled model trains on the mean of its heads, timm's default."""
    model = distilled_student()
    distill.use_distillation_token(model, DistillConfig())
    assert not model.distilled_training
    assert isinstance(model.train()(torch.zeros(1, 3, 32, 32)), torch.Tensor)


def test_both_heads_of_a_distilled_model_start_at_zero():
    """model.head_zero_init reaches the distillation token's head too (timm's get_classifier gives a
    pair)."""
    heads = zoo.classifiers(distilled_student())
    assert len(heads) == 2 and all(not h.weight.any() and not h.bias.any() for h in heads)


@pytest.mark.parametrize("overrides, fragment", [
    (["distill.type=medium"], "distill.type: 'medium' is not one of none, hard, soft"),
    (["distill.teacher=t", "distill.type=soft", "distill.alpha=1.5"], "distill.alpha must be in [0, 1]"),
    (["distill.teacher=t", "distill.type=soft", "distill.tau=0"], "distill.tau must be positive"),
    (["distill.type=hard"], "distill.type=hard needs a teacher"),
    (["distill.teacher=t"], "distill.teacher=t is set but distill.type is none"),
    (["distill.teacher_model=regnety_160"], "distill.teacher (its weights) is empty"),
    (["distill.teacher=t", "distill.type=hard", "objective=mpp"], "objective: mpp has none"),
])
def test_bad_distillation_keys_are_refused_naming_the_key(overrides, fragment):
    with pytest.raises(RecipeError) as e:
        resolve("pretrain", None, ["schedule.steps=2", "schedule.warmup_steps=1", *overrides])
    assert fragment in str(e.value) and "\n" not in str(e.value)
