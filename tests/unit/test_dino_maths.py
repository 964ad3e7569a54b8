"""DINO v1's pieces, which no package installs (facebookresearch/dino is not on PyPI), against
transliterations of its source (main_dino.py DINOLoss, utils.cosine_scheduler, vision_transformer.py
DINOHead, at commit 7c446df), and the properties the run relies on: KoLeo and the iBOT masks do not
depend on how a batch is split, the head compiles in one graph, the collapse monitors read as
documented (the frozen last layer: tests/integration/test_dino_train.py). Tolerances: 1e-6
relative in float32, stated per test otherwise.
"""

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from vitcli.models import dino_loss as dl
from vitcli.models import ibot_masks
from vitcli.models.dino_head import DinoHead, load_reference

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # torch's weight_norm

B, K = 6, 32


def close(a, b, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


class DinoV1Loss(nn.Module):
    """main_dino.py's DINOLoss, one process (its all_reduce and world size dropped)."""

    def __init__(self, out_dim, ncrops, warmup_teacher_temp, teacher_temp,
                 warmup_teacher_temp_epochs, nepochs, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.ncrops = ncrops
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = np.concatenate((
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs),
            np.ones(nepochs - warmup_teacher_temp_epochs) * teacher_temp))

    def forward(self, student_output, teacher_output, epoch):
        student_out = student_output / self.student_temp
        student_out = student_out.chunk(self.ncrops)
        temp = self.teacher_temp_schedule[epoch]
        teacher_out = F.softmax((teacher_output - self.center) / temp, dim=-1)
        teacher_out = teacher_out.detach().chunk(2)
        total_loss = 0
        n_loss_terms = 0
        for iq, q in enumerate(teacher_out):
            for v in range(len(student_out)):
                if v == iq:
                    continue
                loss = torch.sum(-q * F.log_softmax(student_out[v], dim=-1), dim=-1)
                total_loss += loss.mean()
                n_loss_terms += 1
        total_loss /= n_loss_terms
        self.update_center(teacher_output)
        return total_loss

    @torch.no_grad()
    def update_center(self, teacher_output):
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        batch_center = batch_center / len(teacher_output)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


def cosine_scheduler(base_value, final_value, epochs, niter_per_ep, warmup_epochs=0,
                     start_warmup_value=0):
    """DINO's utils.cosine_scheduler."""
    warmup_schedule = np.array([])
    warmup_iters = warmup_epochs * niter_per_ep
    if warmup_epochs > 0:
        warmup_schedule = np.linspace(start_warmup_value, base_value, warmup_iters)
    iters = np.arange(epochs * niter_per_ep - warmup_iters)
    schedule = final_value + 0.5 * (base_value - final_value) * (
        1 + np.cos(np.pi * iters / len(iters)))
    schedule = np.concatenate((warmup_schedule, schedule))
    assert len(schedule) == epochs * niter_per_ep
    return schedule


class DinoV1Head(nn.Module):
    """vision_transformer.py's DINOHead (use_bn=False)."""

    def __init__(self, in_dim, out_dim, norm_last_layer=True, nlayers=3, hidden_dim=2048,
                 bottleneck_dim=256):
        super().__init__()
        layers = [nn.Linear(in_dim, hidden_dim), nn.GELU()]
        for _ in range(nlayers - 2):
            layers += [nn.Linear(hidden_dim, hidden_dim), nn.GELU()]
        layers.append(nn.Linear(hidden_dim, bottleneck_dim))
        self.mlp = nn.Sequential(*layers)
        self.last_layer = nn.utils.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        self.last_layer.weight_g.data.fill_(1)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x):
        x = self.mlp(x)
        x = nn.functional.normalize(x, dim=-1, p=2)
        return self.last_layer(x)


def test_the_dino_v1_loss_centre_and_teacher_temperature_over_epochs():
    """Three epochs of DINO v1's loss (2 global + 4 local crops, the teacher warming from 0.04 to
    0.07 over 2 epochs), the centre carried from one to the next, against ours."""
    ncrops, epochs = 6, 3
    theirs = DinoV1Loss(K, ncrops, 0.04, 0.07, 2, epochs)
    center = torch.zeros(1, K)
    g = torch.Generator().manual_seed(0)
    for epoch in range(epochs):
        student = torch.randn(ncrops * B, K, generator=g)
        teacher = torch.randn(2 * B, K, generator=g)
        temp = dl.teacher_temperature(epoch, 0.04, 0.07, 2)
        assert temp == theirs.teacher_temp_schedule[epoch]
        probs = dl.centred_probs(teacher, center, temp)
        ours = dl.dino_loss(student.chunk(ncrops), probs.chunk(2), 0.1)
        close(ours, theirs(student, teacher, epoch))
        center = dl.updated_center(center, teacher.sum(0, keepdim=True), 2 * B, 0.9)
        close(center, theirs.center)


@pytest.mark.parametrize("warmup", [0, 2])
def test_the_cosine_schedule_is_dino_v1s(warmup):
    ref = cosine_scheduler(5e-4, 1e-6, 10, 7, warmup_epochs=warmup, start_warmup_value=1e-7)
    for step, value in enumerate(ref):  # math.cos against numpy's: within an ulp or so
        assert dl.cosine(5e-4, 1e-6, step, 70, 7 * warmup, 1e-7) == pytest.approx(value, rel=1e-12)


def test_the_head_is_dino_v1s_with_its_last_layer_normalised():
    torch.manual_seed(0)
    theirs = DinoV1Head(16, K, hidden_dim=24, bottleneck_dim=8)
    ours = DinoHead(16, K, hidden_dim=24, bottleneck_dim=8)
    load_reference(ours, theirs)
    x = torch.randn(B, 16)
    close(ours(x), theirs(x))
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == \
        [n for n, p in theirs.named_parameters() if p.requires_grad]


def test_the_head_compiles_in_one_graph():
    """torch.compile's full graph (aot_eager: the graph capture and autograd, no kernels built),
    the same outputs and gradients as eager."""
    torch.manual_seed(0)
    head = DinoHead(16, K, hidden_dim=24, bottleneck_dim=8, norm_last_layer=False)
    x = torch.randn(B, 16)
    compiled = torch.compile(head, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (head, compiled):
        head.zero_grad(set_to_none=True)
        out = fn(x)
        out.square().sum().backward()
        outs.append((out.detach(), [p.grad.clone() for p in head.parameters()]))
    close(outs[1][0], outs[0][0])
    for a, b in zip(outs[1][1], outs[0][1]):
        close(a, b)


def test_koleo_depends_on_the_groups_not_on_the_micro_batches():
    """Over groups of 4: one call on 8 rows, two micro-batches of 4 averaged, the same; rows
    reordered within their group, the same; rows exchanged across groups, another value."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 5, generator=g)
    whole = dl.koleo_loss(x, 4)
    close((dl.koleo_loss(x[:4], 4) + dl.koleo_loss(x[4:], 4)) / 2, whole)
    close(dl.koleo_loss(x[[2, 0, 3, 1, 7, 6, 5, 4]], 4), whole)
    assert not torch.allclose(dl.koleo_loss(x[[0, 1, 2, 4, 3, 5, 6, 7]], 4), whole, rtol=1e-3)


def test_koleo_is_its_formula():
    """-mean log distance to the nearest other row, written with torch.cdist on a group of 5."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, generator=g)
    z = F.normalize(x, dim=-1)
    d = torch.cdist(z, z) + torch.diag(torch.full((5,), math.inf))
    close(dl.koleo_loss(x, 5), -torch.log(d.min(dim=1).values).mean(), rtol=1e-5, atol=1e-6)


def test_ibot_masks_do_not_change_with_the_micro_batch_or_the_rank():
    whole = ibot_masks.masks_for(7, 0, 24, 8, 0.5, (0.1, 0.5))
    splits = ((0, 5), (5, 11), (16, 8))  # (first sample, count): three micro-batches or ranks
    parts = [ibot_masks.masks_for(7, start, n, 8, 0.5, (0.1, 0.5)) for start, n in splits]
    assert torch.equal(torch.cat(parts), whole)
    assert whole.dtype == torch.bool and whole.shape == (24, 64)
    assert whole.any(dim=1).any() and not whole.any(dim=1).all()  # some images masked, some not
    assert not torch.equal(ibot_masks.masks_for(7, 0, 24, 8, 0.5, (0.1, 0.5), view=1), whole)
    assert not torch.equal(ibot_masks.masks_for(8, 0, 24, 8, 0.5, (0.1, 0.5)), whole)


def test_ibot_masks_take_their_ratio_from_the_range():
    """Each masked image asks for int(64 * U(0.2, 0.3)) patches, 12..19: blocks stop once they
    reach it, overshooting by less than one block (at most max_num_patches = 32)."""
    masks = ibot_masks.masks_for(0, 0, 400, 8, 1.0, (0.2, 0.3))
    counts = masks.sum(-1)
    assert counts.min() >= 1 and counts.max() < 19 + 32
    assert 12 <= counts.double().median() <= 25
    assert not ibot_masks.masks_for(0, 0, 50, 8, 0.0, (0.2, 0.3)).any()


def test_sinkhorn_knopp_gives_assignments_that_share_the_prototypes():
    """Rows that sum to 1; each prototype's share of the 64 rows nearer 64 / 8 the more the
    iterations, equal to it (1e-3) once they converge."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 8, generator=g)
    close(dl.sinkhorn_knopp(logits, 0.1, 3).sum(-1), torch.ones(64))
    spreads = [(dl.sinkhorn_knopp(logits, 0.1, n).sum(0) - 8).abs().max() for n in (1, 3, 10, 50)]
    assert all(a > b for a, b in itertools.pairwise(spreads))
    close(dl.sinkhorn_knopp(logits, 0.1, 200).sum(0), torch.full((8,), 8.0), rtol=1e-3, atol=0)


def test_ibot_loss_weights_every_image_alike():
    """An image with one masked patch weighs as much as one with four: the loss is the mean over
    the images of each one's mean cross-entropy, the unmasked counting zero."""
    masks = torch.zeros(3, 6, dtype=torch.bool)
    masks[0, 0] = True
    masks[1, :4] = True
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(5, K, generator=g), torch.softmax(torch.randn(5, K, generator=g), -1)
    ce = -(t * F.log_softmax(s / 0.1, -1)).sum(-1)
    expected = (ce[0] + ce[1:].mean()) / 3
    close(dl.ibot_loss(s, t, dl.ibot_weights(masks), 3, 0.1), expected)


def test_the_patch_centre_stays_without_masked_patches():
    center = torch.randn(1, K)
    assert torch.equal(dl.updated_patch_center(center, torch.zeros(1, K), 0, 0.9), center)
    moved = dl.updated_patch_center(center, torch.ones(1, K) * 4, 2, 0.9)
    close(moved, center * 0.9 + 2 * 0.1)


def test_the_collapse_monitors_read_as_documented():
    one_hot = F.one_hot(torch.arange(4) % K, K).float()
    uniform = torch.full((4, K), 1 / K)
    assert dl.entropy(one_hot) == 0
    close(dl.entropy(uniform), torch.tensor(math.log(K)))
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(4, K, generator=g), -1)
    s = torch.randn(4, K, generator=g)
    cross_entropy = -(p * F.log_softmax(s / 0.1, -1)).sum(-1).mean()
    close(dl.kl(p, s, 0.1), cross_entropy - dl.entropy(p))  # the DINO loss less the entropy
    close(dl.kl(p, p.log() * 0.1, 0.1), torch.tensor(0.0), atol=1e-6, rtol=0)
