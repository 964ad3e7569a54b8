"""DINO's and DINOv2's losses, targets, schedules and collapse monitors as pure functions.

References: DINO (Caron et al. 2021), facebookresearch/dino main_dino.py (DINOLoss) and utils.py
(cosine_scheduler); DINOv2 (Oquab et al. 2023), facebookresearch/dinov2 0.0.1.dev2 dinov2/loss/
(DINOLoss, iBOTPatchLoss, KoLeoLoss), dinov2/train/ssl_meta_arch.py and dinov2/utils/utils.py
(CosineScheduler). tests/unit/test_dino_reference.py holds each against the installed dinov2,
tests/unit/test_dino_maths.py DINO v1's pieces against a transliteration.

Nothing here reduces across processes or keeps state: the centres are returned, and every
global quantity (the centre's batch sum, Sinkhorn-Knopp's sums, the number of images) is summed by
the caller over its micro-batches and ranks first, so one process, accumulation and several ranks
compute the same numbers (the references reduce over the ranks of one step's batch only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F


def dino_loss(student: Sequence[Tensor], teacher: Sequence[Tensor], student_temp: float) -> Tensor:
    """DINO's cross-entropy H(teacher, student) over pairs of views (main_dino.py DINOLoss).

    student: (B, K) logits per view, the global views first, then the local ones; teacher: (B, K)
    probabilities per global view (centred_probs or sinkhorn_knopp). Each pair (teacher view iq,
    student view v != iq) contributes its batch mean; the result is their mean, over
    n_global * (n_views - 1) pairs. DINOv2's arrangement (ssl_meta_arch: the local crops against
    both teacher views, the global crops against the swapped ones, each sum divided by that count
    of terms) is the same number (tests/unit/test_dino_reference.py). Computed in float32.
    """
    log_p = [F.log_softmax(s.float() / student_temp, dim=-1) for s in student]
    total, pairs = 0.0, 0
    for iq, q in enumerate(teacher):
        for v, lp in enumerate(log_p):
            if v == iq:  # the student's and the teacher's output on the same view: skipped
                continue
            total = total + torch.sum(-q.float() * lp, dim=-1).mean()
            pairs += 1
    return total / pairs


def centred_probs(teacher_logits: Tensor, center: Tensor, temp: float) -> Tensor:
    """The teacher's targets with DINO's centring: softmax((t - c) / temp) over the prototypes
    (DINOLoss.softmax_center_teacher). (B, K) and (1, K) -> (B, K), float32."""
    return F.softmax((teacher_logits.float() - center) / temp, dim=-1)


def updated_center(center: Tensor, batch_sum: Tensor, count: int | Tensor, momentum: float
                   ) -> Tensor:
    """The centre after one step: an EMA of the teacher's mean logit (DINOLoss.update_center).

    batch_sum: (1, K), the teacher's logits summed over all `count` rows of the step (every global
    view of every image, over micro-batches and ranks; sum in float32: bfloat16 logits summed over
    thousands of rows lose the centre's digits); the references sum them over one rank's batch and
    all-reduce it.
    """
    return center * momentum + (batch_sum / count) * (1 - momentum)


def sinkhorn_knopp(teacher_logits: Tensor, temp: float, iterations: int,
                   reduce: Callable[[Tensor], Tensor] = lambda t: t,
                   count: int | Tensor | None = None) -> Tensor:
    """DINOv2's Sinkhorn-Knopp targets in place of the centre (SwAV; DINOLoss and
    iBOTPatchLoss.sinkhorn_knopp_teacher): (B, K) logits -> (B, K) assignment, each row summing to 1
    and each prototype taking an equal share of the global batch.

    `reduce` sums a tensor over every rank and micro-batch holding rows of the batch (the caller's
    all_reduce; the identity for one); `count` is the global number of rows (default: B). float32,
    the reference's operations in its order. exp is taken without subtracting a maximum, as
    there: logits / temp must stay below ~88 (a unit-norm last layer's cosines give <= 1 / temp).
    """
    q = torch.exp(teacher_logits.float() / temp).t()  # (K, B): the paper's notation
    n = q.shape[1] if count is None else count
    k = q.shape[0]
    q /= reduce(torch.sum(q))
    for _ in range(iterations):
        q /= reduce(torch.sum(q, dim=1, keepdim=True))  # each prototype's total weight 1 / K
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True)  # each row's 1 / n
        q /= n
    q *= n  # rows summing to 1: an assignment
    return q.t()


def ibot_loss(student_masked_logits: Tensor, teacher_masked_probs: Tensor, weights: Tensor,
              images: int, student_temp: float) -> Tensor:
    """iBOT's masked-token loss (iBOTPatchLoss.forward_masked): the cross-entropy of the teacher's
    targets on each masked patch, weighted by 1 / (its image's masked patches), summed and divided
    by `images`, the number of global-crop images, masked or not (the reference: one rank's).

    (M, K) logits and probabilities of the M masked patches, (M,) weights (ibot_weights). Each image
    thus counts its mean over its masked patches. ssl_meta_arch's scales on it (x 2, x 1/2) cancel.
    """
    lp = F.log_softmax(student_masked_logits.float() / student_temp, dim=-1)
    ce = torch.sum(teacher_masked_probs.float() * lp, dim=-1)  # (M,)
    return -(ce * weights).sum() / images


def ibot_weights(masks: Tensor) -> Tensor:
    """(B, N) bool masks -> (M,) the weight of each masked patch, in the order of masks[masks]:
    1 / (masked patches of its image) (dinov2/data/collate.py's masks_weight)."""
    per_image = 1 / masks.sum(-1).clamp(min=1.0)
    return per_image.unsqueeze(-1).expand_as(masks)[masks]


def updated_patch_center(center: Tensor, batch_sum: Tensor, count: int | Tensor, momentum: float
                         ) -> Tensor:
    """The masked patches' centre after one step (iBOTPatchLoss.reduce_center_update and
    apply_center_update): an EMA of the teacher's mean logit over the step's masked patches.

    batch_sum: (1, K), the teacher's logits summed over all `count` masked patches of the step.
    A departure on several ranks: the reference averages each rank's mean (every rank weighing the
    same whatever its number of masked patches), we take the mean over all masked patches, which
    does not depend on how the batch is split (the same on one rank). With no masked patch at all
    the centre stays (the reference's mean over none is NaN).
    """
    count = torch.as_tensor(count, device=center.device)
    moved = updated_center(center, batch_sum, count.clamp(min=1), momentum)
    return torch.where(count > 0, moved, center)


def koleo_loss(x: Tensor, group: int) -> Tensor:
    """DINOv2's KoLeo regulariser (Sablayrolles et al. 2018; dinov2 KoLeoLoss): -mean log of each
    L2-normalised row's distance to its nearest neighbour, the neighbours sought within each
    group of `group` consecutive rows, averaged over all rows (every group is the same size).

    x: (B, D), B a multiple of `group`. The reference applies it to each rank's batch of each global
    view and sums the two views' losses (x 0.1): pass one view's rows grouped as the reference's
    ranks would hold them and sum over views as it does; the groups, not the micro-batches, decide
    the neighbours. float32, outside autocast, as the reference.
    """
    eps = 1e-8
    with torch.autocast(x.device.type, enabled=False):
        z = F.normalize(x.float(), eps=eps, p=2, dim=-1)
        z = z.reshape(-1, group, x.shape[-1])  # (G, n, D)
        with torch.no_grad():
            dots = z @ z.transpose(1, 2)  # (G, n, n); the largest product: the nearest neighbour
            dots.diagonal(dim1=1, dim2=2).fill_(-1)
            nearest = torch.max(dots, dim=2).indices  # (G, n)
        neighbours = torch.gather(z, 1, nearest.unsqueeze(-1).expand_as(z))
        distances = F.pairwise_distance(z, neighbours, p=2, eps=eps)  # (G, n): |a - b + eps|
        return -torch.log(distances + eps).mean()


def cosine(start: float, end: float, step: int, total: int, warmup_steps: int = 0,
           warmup_start: float = 0.0) -> float:
    """The value at `step` of DINO's utils.cosine_scheduler / dinov2's CosineScheduler (freeze_iters
    0): `warmup_steps` of np.linspace(warmup_start, start, warmup_steps), then a cosine from start
    to end over the other total - warmup_steps steps (reaching end only in the limit); `end` from
    step `total` on (CosineScheduler's; DINO v1's array has no such step)."""
    if step >= total:
        return end
    if step < warmup_steps:
        return _linspace_at(warmup_start, start, warmup_steps, step)
    i, n = step - warmup_steps, total - warmup_steps
    return end + 0.5 * (start - end) * (1 + math.cos(math.pi * i / n))


def teacher_temperature(step: int, start: float, end: float, warmup_steps: int) -> float:
    """The teacher's temperature at `step`: linear from `start` to `end` over `warmup_steps`
    (np.linspace, reaching `end` at step warmup_steps - 1), then `end` (main_dino.py's
    teacher_temp_schedule, per epoch; dinov2's per iteration, train.py)."""
    if step >= warmup_steps:
        return end
    return _linspace_at(start, end, warmup_steps, step)


def _linspace_at(a: float, b: float, n: int, i: int) -> float:
    """np.linspace(a, b, n)[i] as numpy computes it: i * ((b - a) / (n - 1)) + a, the last point b,
    a single point a."""
    if n == 1:
        return a
    return b if i == n - 1 else i * ((b - a) / (n - 1)) + a


def entropy(probs: Tensor) -> Tensor:
    """Mean over the rows of the entropy of (B, K) distributions, in nats (0 log 0 = 0).

    The collapse monitor of the DINO paper (Sec. 5.3, Fig. 7): the teacher's targets collapse to one
    prototype when it falls to 0, to the uniform when it reaches log K."""
    return -torch.special.xlogy(probs.float(), probs.float()).sum(-1).mean()


def kl(teacher_probs: Tensor, student_logits: Tensor, student_temp: float) -> Tensor:
    """Mean over the rows of KL(teacher || softmax(student / student_temp)), in nats: the DINO
    cross-entropy less the teacher's entropy (DINO Fig. 7). Near 0 with an entropy near 0 or log K,
    the student copies a collapsed teacher; it is the part of the loss that still teaches."""
    p = teacher_probs.float()
    log_q = F.log_softmax(student_logits.float() / student_temp, dim=-1)
    return (torch.special.xlogy(p, p) - p * log_q).sum(-1).mean()
