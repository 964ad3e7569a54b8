"""A training step on a GPU: what `auto` picks there, pinned and asynchronous input copies, the peak
table against the card, and a step (the input stream included) that never makes the host wait for
the GPU."""

import dataclasses
import math

import pytest
import torch

from vitcli.data.batching import batches
from vitcli.data.rows import sources
from vitcli.models import zoo
from vitcli.objectives import registry
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import micro_batches
from vitcli.runtime.dist import setup
from vitcli.runtime.peak import matmul_flops, peak_flops, table_peak
from vitcli.stages.run import one_run
from vitcli.train import loop, parallelize
from vitcli.train.optim import build_optimizer

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "schedule.warmup_steps=1",
        "data.val_split=", "data.test_split=", "fewshot.every=0", "schedule.epochs=0"]


def test_auto_trains_in_bf16_compiled_with_fused_adamw(tmp_path):
    r = resolve("pretrain", None, [*TINY, "schedule.steps=4", "run.log_every=1", "run.precision=auto",
                                   "run.compile=auto"])
    summary = one_run(r, tmp_path)
    major, _ = torch.cuda.get_device_capability()
    assert summary["run/precision"] == ("bf16" if major >= 8 else "fp32")
    assert summary["run/compile"] is (major >= 7)
    assert math.isfinite(summary["train/loss"])
    model = zoo.build_model(r.model, 4).cuda()
    assert build_optimizer(model, r.optim).param_groups[0]["fused"] is True


# DeiT's augmentation: every part of the one route that draws on the host and works on the device
DEIT = ["data.randaugment=rand-m9-mstd0.5-inc1", "data.erasing=0.25", "data.mixup_alpha=0.8",
        "data.cutmix_alpha=1.0"]


def test_the_loader_ships_pinned_batches(cuda):
    r = resolve("pretrain", None, [*TINY, "schedule.steps=2", *DEIT])
    ds = sources.load_split(r.data, r.data.train_split)
    stream = batches.train_batches(ds, r.data, 32, 8, seed=0, device=cuda)
    pixels, y, _ = next(stream.batches)  # what the DataLoader hands over, before `finish`
    assert all(t.is_pinned() for t in (pixels.pixels, pixels.sizes, pixels.flips, y))
    assert pixels.aug.rand is None and pixels.pixels.shape[-2:] == (32, 32)  # resized, augmented in workers
    assert pixels.aug.erasing.boxes.device.type == "cpu"  # read as host ints by erasing.apply: no sync
    x, _ = next(stream)
    assert x.device == cuda and x.dtype == torch.float32


def test_the_peak_table_is_what_the_card_reaches(cuda):
    name = torch.cuda.get_device_name(cuda)
    listed = table_peak(name, "bf16")
    if listed is None:
        assert peak_flops(cuda, "bf16")[1].startswith("measured")
        pytest.skip(f"{name} is not in the peak table: its MFU is over a measured matmul")
    matmul_flops("bf16", 8192, 3, cuda)  # the clocks ramp up first
    measured = max(matmul_flops("bf16", 8192, 10, cuda) for _ in range(3))
    # a datasheet peak is a little above what cuBLAS reaches (H100 SXM: ~800 of 989 TFLOP/s measured
    # here); far above, and every MFU reads low; below it, and MFU can pass 100%
    assert 0.6 * listed < measured < 1.05 * listed, (name, measured / 1e12, listed / 1e12)


def training_step(device: torch.device, augmentation: list[str]):
    """One training step built as the trainer builds it (train.loop: the criterion, Mixup/CutMix,
    the stream), on `device`: a callable returning the loss."""
    r = resolve("pretrain", None, [*TINY, "schedule.steps=3", "data.crop_min_area=0.3", *augmentation])
    dist = setup(device.type)
    ds = sources.load_split(r.data, r.data.train_split)
    micro, accum = micro_batches(r, 1)
    stream = batches.train_batches(ds, r.data, 32, micro, seed=0, accum=accum, device=dist.device)
    model = zoo.build_model(r.model, 4).to(dist.device)
    parallel = parallelize.apply(model, dataclasses.replace(r.run, compile=False), dist)
    optimizer = build_optimizer(parallel.model, r.optim)
    objective = loop._objective(registry.build(r, 4, dist.device), r, 0, 0)
    precision = "bf16" if device.type == "cuda" else "fp32"

    def step():
        loss, _ = loop._accumulate_grads(parallel, optimizer, stream, accum, objective, precision, dist)
        parallelize.clip_grad_norm(parallel.train, 1.0)
        optimizer.step()
        return loss

    return step


@pytest.mark.anywhere
@pytest.mark.parametrize("augmentation", [[], DEIT], ids=["plain", "deit"])
def test_the_gpu_step_is_built_as_the_trainer_builds_it(augmentation):
    """`make test` builds and runs the step the next test times on a GPU, so that a change to the
    trainer's calls breaks here, on a CPU, and not first on a rare GPU machine (the distillation
    criterion's third argument once did)."""
    step = training_step(torch.device("cpu"), augmentation)
    assert math.isfinite(float(step())) and math.isfinite(float(step()))


@pytest.mark.parametrize("augmentation", [[], DEIT], ids=["plain", "deit"])
def test_a_training_step_and_its_input_never_wait_for_the_gpu(cuda, augmentation):
    step = training_step(cuda, augmentation)
    step()  # the first step allocates, builds cuBLAS handles and the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(loss))
