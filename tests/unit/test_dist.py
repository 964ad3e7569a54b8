"""Where a process computes and how it joins the job (runtime.dist), checked without a GPU or a second
process: the device count and torch.distributed's calls are stand-ins."""

import pytest
import torch

from vitcli.runtime import dist

CPU = torch.device("cpu")


@pytest.mark.parametrize("local_rank, visible, index", [
    (0, 8, 0), (5, 8, 5),  # torchrun on an 8-GPU node: every process sees them all
    (5, 1, 0), (0, 1, 0),  # srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per process: its own GPU alone
    (5, 2, 1),  # two GPUs per process
])
def test_each_local_rank_takes_a_gpu_it_can_see(local_rank, visible, index):
    for pref in ("cuda", "auto"):
        assert dist.pick_device(pref, local_rank, visible) == torch.device("cuda", index)


def test_auto_without_a_gpu_and_cpu_anywhere_are_the_cpu():
    assert dist.pick_device("auto", 3, visible=0) == CPU
    assert dist.pick_device("cpu", 3, visible=8) == CPU


def test_the_visible_count_is_torchs_by_default(monkeypatch):
    """Local rank 3 of a job whose every process is shown one GPU: its cuda:0, not a cuda:3 it lacks."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dist.pick_device("cuda", 3) == torch.device("cuda", 0)
