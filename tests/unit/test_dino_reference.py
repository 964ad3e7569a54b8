"""DINO's and DINOv2's maths against the official reference: the `dinov2` 0.0.1.dev2 package from
PyPI (make setup installs it with --no-deps: its pins would replace our torch; these modules need
only torch and numpy). Same weights, same inputs, on a tiny configuration: the head, the DINO loss with
its centring and centre update, Sinkhorn-Knopp's targets, the iBOT loss, its weights and patch
centre, KoLeo, the schedules, the block masks and the parameter groups.

dinov2's iBOTPatchLoss.sinkhorn_knopp_teacher calls dist.all_reduce whether or not a process group
exists, so its test runs inside a one-process gloo group (`one_rank`), destroyed after it.
Tolerances: 1e-6 relative in float32 where both sides run the same operations (orders may differ
by a reduction), stated per test otherwise.
"""

import math
import random
import threading

import numpy as np
import pytest
import timm
import torch
import torch.distributed as dist

from vitcli.models import dino_loss as dl
from vitcli.models import ibot_masks
from vitcli.models.dino_head import DinoHead, load_reference
from vitcli.models.layer_decay import dinov2_param_groups, dinov2_scales

dinov2 = pytest.importorskip("dinov2")
from dinov2.data.collate import collate_data_and_cast
from dinov2.data.masking import MaskingGenerator
from dinov2.layers.dino_head import DINOHead
from dinov2.loss import DINOLoss, KoLeoLoss, iBOTPatchLoss
from dinov2.utils.param_groups import fuse_params_groups, get_params_groups_with_decay
from dinov2.utils.utils import CosineScheduler

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]  # weight_norm, cuda.amp.autocast

B, K, LOCAL = 6, 32, 3  # images, prototypes, local crops
STUDENT_TEMP, TEACHER_TEMP, MOMENTUM = 0.1, 0.04, 0.9


def close(a, b, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.fixture
def one_rank(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("norm_last_layer", [True, False])
def test_the_head_computes_the_reference_head_and_its_gradients(norm_last_layer):
    """Outputs in float32 to 1e-6; the gradients in float64 to 1e-10 (torch's weight_norm has a
    backward formula of its own, ours is autograd's through g * v / |v|: in float32 they part at
    ~2e-5 relative)."""
    torch.manual_seed(0)
    theirs = DINOHead(16, K, nlayers=3, hidden_dim=24, bottleneck_dim=8)
    ours = DinoHead(16, K, hidden_dim=24, bottleneck_dim=8, layers=3,
                    norm_last_layer=norm_last_layer)
    with torch.no_grad():  # a g away from 1, so the normalisation is exercised
        theirs.last_layer.weight_g.uniform_(0.5, 2.0)
    load_reference(ours, theirs)
    x = torch.randn(B, 16)
    close(ours(x), theirs(x))
    ours, theirs, x = ours.double(), theirs.double(), x.double()
    ours(x).square().sum().backward()
    theirs(x).square().sum().backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            close(p.grad, theirs_params[name].grad, rtol=1e-10, atol=1e-12)
    assert ours.last_layer.weight_g.requires_grad is not norm_last_layer
    assert (DinoHead(16, K, 24, 8).last_layer.weight_g == 1).all()  # g starts at 1, as theirs


def test_a_one_layer_head_keeps_the_reference_names():
    theirs = DINOHead(16, K, nlayers=1, bottleneck_dim=8)
    ours = DinoHead(16, K, bottleneck_dim=8, layers=1)
    load_reference(ours, theirs)
    x = torch.randn(B, 16)
    close(ours(x), theirs(x))


def views(seed=0):
    """2 global + LOCAL local student views, the teacher's 2 global views, as logits."""
    g = torch.Generator().manual_seed(seed)
    student = [torch.randn(B, K, generator=g) for _ in range(2 + LOCAL)]
    teacher = torch.randn(2 * B, K, generator=g)
    return student, teacher


def dinov2_dino_loss(loss: DINOLoss, student, teacher_probs):
    """ssl_meta_arch.forward_backward's DINO terms: local crops against both teacher views, the
    global crops against the swapped views, each divided by the total number of terms."""
    n_terms = 2 * LOCAL + 2
    t = teacher_probs.view(2, B, K)
    local = loss(list(student[2:]), list(t)) / n_terms
    swapped = torch.cat((t[1], t[0]))
    return local + loss([torch.cat(student[:2])], [swapped]) * 2 / n_terms


def test_the_dino_loss_with_centring_and_the_centre_update_are_dinov2s():
    student, teacher = views()
    theirs = DINOLoss(K, student_temp=STUDENT_TEMP, center_momentum=MOMENTUM)
    center = torch.randn(1, K) * 0.1
    theirs.center = center.clone()
    theirs_probs = theirs.softmax_center_teacher(teacher, teacher_temp=TEACHER_TEMP)
    ours_probs = dl.centred_probs(teacher, center, TEACHER_TEMP)
    close(ours_probs, theirs_probs)
    ours_loss = dl.dino_loss(student, list(ours_probs.chunk(2)), STUDENT_TEMP)
    close(ours_loss, dinov2_dino_loss(theirs, student, theirs_probs))
    theirs.update_center(teacher)
    theirs.apply_center_update()
    close(dl.updated_center(center, teacher.sum(0, keepdim=True), 2 * B, MOMENTUM), theirs.center)


def test_sinkhorn_knopp_targets_are_dinov2s(one_rank):
    _, teacher = views(1)
    theirs = DINOLoss(K).sinkhorn_knopp_teacher(teacher, TEACHER_TEMP)
    close(dl.sinkhorn_knopp(teacher, TEACHER_TEMP, 3), theirs)
    masked = teacher[:5]
    theirs = iBOTPatchLoss(K).sinkhorn_knopp_teacher(masked, TEACHER_TEMP, torch.tensor([5]))
    close(dl.sinkhorn_knopp(masked, TEACHER_TEMP, 3, count=5), theirs)


def test_sinkhorn_knopp_over_two_ranks_is_one_rank_holding_both_halves():
    _, teacher = views(2)
    halves, out = teacher.chunk(2), [None, None]
    slots, barrier = [None, None], threading.Barrier(2)

    def run(rank):
        def all_reduce(t):  # what torch.distributed.all_reduce(SUM) gives both ranks
            slots[rank] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        out[rank] = dl.sinkhorn_knopp(halves[rank], TEACHER_TEMP, 3, reduce=all_reduce, count=2 * B)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    # the sums' order differs (two partial sums added): 1e-5 relative
    close(torch.cat(out), dl.sinkhorn_knopp(teacher, TEACHER_TEMP, 3), rtol=1e-5, atol=1e-7)


def collated(seed=0, grid=4):
    """dinov2's collate of B images with its masks, the reference's weights and counts."""
    random.seed(seed)
    crop = torch.zeros(3, 2, 2)
    samples = [({"global_crops": [crop, crop], "local_crops": [crop]}, None)] * B
    gen = MaskingGenerator(input_size=(grid, grid),
                           max_num_patches=ibot_masks.max_num_patches(grid))
    return collate_data_and_cast(samples, (0.1, 0.5), 0.5, torch.float32, n_tokens=grid * grid,
                                 mask_generator=gen)


def test_the_ibot_weights_loss_and_patch_centre_are_dinov2s():
    batch = collated()
    masks = batch["collated_masks"]  # (2B, N)
    m = int(masks.sum())
    close(dl.ibot_weights(masks), batch["masks_weight"])
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(m, K, generator=g), torch.randn(m, K, generator=g)
    theirs = iBOTPatchLoss(K, student_temp=STUDENT_TEMP, center_momentum=MOMENTUM)
    center = torch.randn(1, K) * 0.1
    theirs.center = center.view(1, 1, K).clone()
    probs = theirs.softmax_center_teacher(teacher.unsqueeze(0), teacher_temp=TEACHER_TEMP)
    probs = probs.squeeze(0)
    close(dl.centred_probs(teacher, center, TEACHER_TEMP), probs)
    # ssl_meta_arch scales it by loss_scales (2) and ibot_loss_scale (1 / 2)
    ref = theirs.forward_masked(student, probs, student_masks_flat=masks, n_masked_patches=m,
                                masks_weight=batch["masks_weight"]) * 2 * 0.5
    close(dl.ibot_loss(student, probs, dl.ibot_weights(masks), 2 * B, STUDENT_TEMP), ref)
    theirs.update_center(teacher.unsqueeze(0)[:m])  # as ssl_meta_arch passes it: (1, M, K)
    theirs.apply_center_update()
    ours = dl.updated_patch_center(center, teacher.sum(0, keepdim=True), m, MOMENTUM)
    close(ours, theirs.center.view(1, K))


def test_koleo_is_dinov2s_on_each_group():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2 * B, 8, generator=g, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    # ssl_meta_arch: the two global views of one rank's B images, summed (then x 0.1)
    theirs = sum(KoLeoLoss()(p) for p in y.chunk(2))
    ours = dl.koleo_loss(x, B) * 2
    close(ours, theirs)
    ours.backward()
    theirs.backward()
    close(x.grad, y.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("warmup,start_warmup", [(0, 0.0), (1, 0.0), (7, 1e-6), (29, 0.3)])
def test_the_cosine_schedule_is_dinov2s_at_every_step(warmup, start_warmup):
    total = 30 if warmup < 29 else 29
    ref = CosineScheduler(5e-4, 1e-6, total, warmup_iters=warmup, start_warmup_value=start_warmup)
    for step in range(total + 3):  # and past the end, where CosineScheduler returns the final value
        # math.cos against numpy's vectorised cos: within an ulp or so
        ours = dl.cosine(5e-4, 1e-6, step, total, warmup, start_warmup)
        assert ours == pytest.approx(ref[step], rel=1e-12, abs=1e-18)


def test_the_teacher_temperature_is_dinov2s():
    # train.py: a CosineScheduler from warmup_teacher_temp to teacher_temp, constant after
    warmup = 12
    ref = CosineScheduler(0.07, 0.07, warmup, warmup_iters=warmup, start_warmup_value=0.04)
    for step in range(warmup + 4):
        ours = dl.teacher_temperature(step, 0.04, 0.07, warmup)
        assert ours == pytest.approx(ref[step], rel=1e-15)


def replaying(rng: np.random.Generator):
    """A stand-in for python's `random` in dinov2.data.masking that draws from `rng` as
    vitcli.models.ibot_masks does."""
    class Replay:
        @staticmethod
        def uniform(a, b):
            return a + (b - a) * rng.random()

        @staticmethod
        def randint(a, b):
            return int(rng.integers(a, b + 1))
    return Replay


@pytest.mark.parametrize("grid", [4, 7, 8])
def test_block_masks_are_dinov2s_given_the_same_numbers(monkeypatch, grid):
    from dinov2.data import masking
    size = grid * 8  # train.py's max_num_patches, written as it is there, for patch 8
    gen = MaskingGenerator(input_size=(grid, grid), max_num_patches=0.5 * size // 8 * size // 8)
    assert gen.max_num_patches == ibot_masks.max_num_patches(grid)
    masked = 0
    for seed in range(40):
        n = int(grid * grid * (0.1 + 0.4 * seed / 40))
        monkeypatch.setattr(masking, "random", replaying(np.random.default_rng(seed)))
        theirs = gen(n)
        ours = ibot_masks.block_mask(np.random.default_rng(seed), grid, n)
        np.testing.assert_array_equal(ours, theirs)
        masked += int(ours.sum())
    assert masked > 0


def test_the_masked_patches_per_image_match_dinov2s_collate_in_the_mean():
    """Our per-image draw and dinov2's per-batch draw (int(B * prob) images, ratios on a linspace):
    the same mean number of masked patches per global crop. 600 batches of 2B crops a side; the
    tolerance, 4 standard errors of the difference of the two means."""
    grid, batches = 8, 600
    theirs = torch.cat([collated(seed, grid)["collated_masks"].sum(-1) for seed in range(batches)])
    ours = ibot_masks.masks_for(0, 0, len(theirs), grid, 0.5, (0.1, 0.5)).sum(-1)
    a, b = theirs.double(), ours.double()
    se = math.sqrt(a.var() / len(a) + b.var() / len(b))
    assert abs(a.mean() - b.mean()) < 4 * se
    assert abs((a > 0).double().mean() - (b > 0).double().mean()) < 0.03  # masked images: 1/2 each


def tiny_vit():
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, init_values=1e-5, num_classes=5)


def test_param_groups_are_dinov2s_on_a_timm_vit():
    """dinov2's function run on timm's ViT itself (it asks only for `.blocks` and the names, which
    are DinoVisionTransformer's but for its mask_token, tested below, and timm's head, which dinov2
    keeps in a separate module at lr 1, as the rule's `depth + 1` gives it)."""
    model = tiny_vit()
    theirs = {d["name"]: d for d in get_params_groups_with_decay(model, 0.9, 0.2)}
    for name, _ in model.named_parameters():
        lr_scale, wd_scale = dinov2_scales(name, 2, 0.9, 0.2)
        assert (lr_scale, wd_scale) == pytest.approx(
            (theirs[name]["lr_multiplier"], theirs[name]["wd_multiplier"]), rel=1e-12), name
    ours = {(g["lr_scale"], g["wd_scale"]): {id(p) for p in g["params"]}
            for g in dinov2_param_groups(model.named_parameters(), 2, 0.9, 0.2)}
    fused = {(g["lr_multiplier"], g["wd_multiplier"]): {id(p) for p in g["params"]}
             for g in fuse_params_groups(get_params_groups_with_decay(model, 0.9, 0.2))}
    assert ours == fused


def test_param_groups_name_dinov2s_own_vit_and_head_alike():
    from dinov2.models.vision_transformer import DinoVisionTransformer
    backbone = DinoVisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                     init_values=1e-5, block_chunks=0)
    head = DINOHead(32, K, hidden_dim=24, bottleneck_dim=8)
    for module, depth in ((backbone, 2), (head, 2)):
        for d in get_params_groups_with_decay(module, 0.9, 0.2):
            assert dinov2_scales(d["name"], depth, 0.9, 0.2) == pytest.approx(
                (d["lr_multiplier"], d["wd_multiplier"]), rel=1e-12), d["name"]
    timm_names = {n for n, _ in tiny_vit().named_parameters()}
    assert {n for n, _ in backbone.named_parameters()} - timm_names == {"mask_token"}
