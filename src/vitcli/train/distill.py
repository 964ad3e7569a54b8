"""Knowledge distillation as DeiT does it (Touvron et al. 2021, facebookresearch/deit `losses.py`):
a frozen teacher's logits on the images the student sees are a second target beside the labels.

    loss = (1 - alpha) * base(student's class-token logits, labels) + alpha * distillation
    hard: cross_entropy(student's distillation logits, the teacher's top class)
    soft: KL(log_softmax(teacher / tau) || log_softmax(student / tau)), summed, x tau^2, / (B x K)

The teacher sees the student's very input, mixup and CutMix included (DeiT's engine.py hands
`samples` after `mixup_fn` to both), and runs in the run's precision: its forward is inside the
loop's autocast. A DeiT distilled student (timm's VisionTransformerDistilled, `deit_*_distilled_*`)
learns the teacher through its distillation token: set_distilled_training makes it return
(class-token logits, distillation-token logits) in training, and the mean of its two heads at
evaluation, as DeiT's model does. Any other student distils on its class token: both terms read the
same logits (DeiT's loss requires the token; the formulas do not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import timm
import torch
import torch.nn.functional as F
from torch import nn

from vitcli.checkpoints.describe import CheckpointSpec, describe
from vitcli.checkpoints.fit import adapt_state_dict, head_prefix
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.errors import CheckpointError
from vitcli.models import zoo
from vitcli.recipe.schema import DistillConfig, ModelConfig, Recipe

# loss(student outputs: logits (B, K) or a distilled model's (class, distillation) pair, target (B,)
# or (B, K), images (B, 3, H, W)) -> the 0-d loss the loop minimises
Criterion = Callable[[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor],
                     torch.Tensor]


def soft_distillation(student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
    """DeiT's soft term for logits (B, K): KL of the student's tempered softmax from the teacher's,
    summed and divided by B x K (DeiT keeps this "legacy" mean over every logit, deit issue 61),
    times tau^2 so the gradients keep their size as tau grows (Hinton et al. 2015)."""
    kl = F.kl_div(F.log_softmax(student / tau, dim=1), F.log_softmax(teacher / tau, dim=1),
                  reduction="sum", log_target=True)
    return kl * (tau * tau) / student.numel()


def hard_distillation(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """DeiT's hard term for logits (B, K): cross-entropy against the teacher's top class, no
    smoothing."""
    return F.cross_entropy(student, teacher.argmax(dim=1))


def distillation_term(cfg: DistillConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """term(student logits, teacher logits) of distill.type (hard or soft)."""
    if cfg.type == "soft":
        return lambda student, teacher: soft_distillation(student, teacher, cfg.tau)
    return hard_distillation


def criterion(base, teacher: nn.Module | None, cfg: DistillConfig) -> Criterion:
    """The loop's loss(outputs, target, images): `base` (train.losses.loss_fn) on the logits without
    a teacher; with one, DeiT's DistillationLoss, the teacher's forward without autograd."""

    def plain(outputs, target, images):
        return base(outputs.float(), target)

    if teacher is None:
        return plain
    term = distillation_term(cfg)

    def distilled(outputs, target, images):
        logits, kd = outputs if isinstance(outputs, tuple) else (outputs, outputs)  # (B, K) each
        # no_grad, not inference_mode: the teacher's logits meet the student's in autograd, which
        # refuses to save an inference tensor for the backward pass (torch's advice: no_grad for
        # such tensors)
        with torch.no_grad():
            taught = teacher(images).float()
        return base(logits.float(), target) * (1 - cfg.alpha) + term(kd.float(), taught) * cfg.alpha

    return distilled


def use_distillation_token(model: nn.Module, cfg: DistillConfig) -> None:
    """With a teacher, a DeiT distilled student (timm's VisionTransformerDistilled) trains its
    distillation token on it: its forward then returns both heads' logits in training (their mean at
    evaluation)."""
    if cfg.type != "none" and hasattr(model, "set_distilled_training"):
        model.set_distilled_training(True)


def load_teacher(r: Recipe, num_classes: int, device: torch.device) -> nn.Module | None:
    """The frozen teacher distill.teacher names, on `device`, in eval mode, at the student's
    resolution (its position table resized as init.posemb_method says), its head checked to have the
    student's `num_classes`; None without one. Nothing of it trains: no gradient, so no optimizer
    state."""
    if r.distill.type == "none":
        return None
    try:
        loaded = read_checkpoint(r.distill.teacher)
    except CheckpointError as e:
        raise CheckpointError(f"distill.teacher: {e}") from None
    spec = describe(loaded)
    # its initial draws, overwritten, leave the run's RNG as it was
    with torch.random.fork_rng(devices=[]):
        model = zoo.build_model(teacher_config(loaded, spec, r.distill, r.model.img_size), num_classes)
    check_teacher_classes(loaded, model, num_classes)
    try:
        sd, _ = adapt_state_dict(loaded.state_dict, model, spec, keep_head=True, method=r.init.posemb_method,
                                 keep_representation=spec.representation_size > 0)
        model.load_state_dict(sd, strict=True)
    except CheckpointError as e:
        raise CheckpointError(f"distill.teacher {loaded.path}: {e}") from None
    return model.requires_grad_(False).eval().to(device)


def teacher_config(loaded: Loaded, spec: CheckpointSpec, cfg: DistillConfig, img_size: int) -> ModelConfig:
    """The teacher's network at `img_size`: distill.teacher_model when given, the architecture a
    timm name names, else what the checkpoint `spec` says of itself (ours: its metadata; a foreign
    ViT: its tensors)."""
    name = cfg.teacher_model
    if not name and loaded.kind == "hub" and timm.is_model(cfg.teacher):
        name = timm.models.get_arch_name(cfg.teacher)  # `regnety_160.deit_in1k` -> regnety_160
    if name:
        return zoo.resolve_name(ModelConfig(name=name, img_size=img_size))
    if not spec.name or not spec.num_heads:
        what = "which network it holds" if not spec.name else "its number of attention heads"
        raise CheckpointError(f"distill.teacher {loaded.path} does not say {what}; set distill.teacher_model "
                              "to its architecture (a model.name: ViT-B/16, regnety_160, ...)")
    return dataclasses.replace(ModelConfig(img_size=img_size), **spec.architecture())


def check_teacher_classes(loaded: Loaded, model: nn.Module, num_classes: int) -> None:
    """A CheckpointError when the teacher's head does not predict the student's `num_classes`
    classes."""
    weight = loaded.state_dict.get(f"{head_prefix(model)}weight")  # (K, D)
    found = 0 if weight is None else int(weight.shape[0])
    if found != num_classes:
        has = f"a {found}-class head" if found else "no classification head"
        raise CheckpointError(f"distill.teacher {loaded.path} has {has}, but the student has {num_classes} "
                              "classes: a teacher must predict the student's classes")
