"""Where a process computes and how it joins the job (runtime.dist), checked without a GPU or a
second process: the device count and torch.distributed's calls are stand-ins."""

from datetime import timedelta

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from vitcli.checkpoints import manager
from vitcli.runtime import dist

CPU = torch.device("cpu")
CONTROL = "the control group"  # a stand-in for the Gloo group that setup makes beside NCCL's


@pytest.mark.parametrize("local_rank, visible, index", [
    (0, 8, 0), (5, 8, 5),  # torchrun on an 8-GPU node: every process sees them all
    # srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per process: its own GPU alone
    (5, 1, 0), (0, 1, 0),
    (5, 2, 1),  # two GPUs per process
])
def test_each_local_rank_takes_a_gpu_it_can_see(local_rank, visible, index):
    for pref in ("cuda", "auto"):
        assert dist.pick_device(pref, local_rank, visible) == torch.device("cuda", index)


def test_auto_without_a_gpu_and_cpu_anywhere_are_the_cpu():
    assert dist.pick_device("auto", 3, visible=0) == CPU
    assert dist.pick_device("cpu", 3, visible=8) == CPU


def test_the_visible_count_is_torchs_by_default(monkeypatch):
    """Local rank 3 of a job that shows each process one GPU: its cuda:0, not a cuda:3 it lacks."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dist.pick_device("cuda", 3) == torch.device("cuda", 0)


@pytest.mark.parametrize("visible, joined", [
    (2, {"backend": "nccl", "device_id": torch.device("cuda", 1)}),
    (0, {"backend": "gloo"}),
])
def test_a_gpu_process_binds_nccl_to_its_own_gpu(monkeypatch, visible, joined):
    """Local rank 1 of 2: NCCL gets the device it computes on (its communicator made at once,
    there); a CPU process joins Gloo with no device. The group that computes is NCCL; the small CPU
    agreements get their own Gloo group."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "enable_tf32", lambda: None)
    monkeypatch.setattr(dist.console, "quiet", False)  # restored after the test: setup sets it
    monkeypatch.setattr(dist.stdout, "quiet", False)
    monkeypatch.setattr(dist.torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.torch_dist, "init_process_group",
                        lambda backend=None, **kwargs: calls.append({"backend": backend, **kwargs}))
    monkeypatch.setattr(dist.torch_dist, "new_group", lambda **kwargs: kwargs)
    joined_as = dist.setup("auto")
    assert calls == [joined]
    assert joined_as.control == ({"backend": "gloo"} if visible else None)


def test_checkpoint_waits_are_gloo_waits_with_a_long_timeout(monkeypatch, tmp_path):
    """Rank 1 of 2 saving a checkpoint waits while rank 0 writes it (whole) or seals it (sharded,
    after DCP's own waits for the slowest shard): each wait goes through the Gloo control group,
    with a timeout of hours, never as an NCCL collective under the watchdog's 10 minutes."""
    waits = []
    monkeypatch.setattr(dist.torch_dist, "barrier",
                        lambda group=None, **kw: waits.append((group, "barrier")))
    monkeypatch.setattr(dist.torch_dist, "monitored_barrier",
                        lambda group=None, timeout=None: waits.append((group, timeout)))

    def broadcast(box, src, group=None):
        waits.append((group, "broadcast"))
        box[0] = str(tmp_path / "rank0-tmp")

    monkeypatch.setattr(dist.torch_dist, "broadcast_object_list", broadcast)
    # sharded imports DCP as it writes (a sharded run's cost alone): patched where it is looked up
    monkeypatch.setattr(dcp, "save",
                        lambda state, checkpoint_id, process_group=None, no_dist=False:
                        waits.append((process_group, "dcp.save")))
    monkeypatch.setattr(dcp_state_dict, "get_state_dict", lambda model, optimizer: ({}, {}))
    rank1 = dist.Dist(rank=1, world_size=2, local_rank=1, device=CPU, control=CONTROL)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    manager.save(tmp_path, {"step": 1}, model, optimizer, rank1, keep=2, sharded=False)
    assert [group for group, _ in waits] == [CONTROL], waits
    assert waits == [(CONTROL, dist.BARRIER_TIMEOUT)] and dist.BARRIER_TIMEOUT >= timedelta(hours=1)
    waits.clear()
    manager.save(tmp_path, {"step": 2}, model, optimizer, rank1, keep=2, sharded=True)
    assert waits == [(CONTROL, "broadcast"), (CONTROL, "dcp.save"), (CONTROL, dist.BARRIER_TIMEOUT),
                     (CONTROL, dist.BARRIER_TIMEOUT)]


@pytest.mark.parametrize("threads, processes, cores", [(2, 2, 2), (16, 1, 8), (4, 3, 8), (2, 1, 1)])
def test_threads_beyond_the_cores_are_named_and_the_advice_fits(threads, processes, cores):
    warning = dist.oversubscription(threads, processes, cores)
    assert f"{threads} threads on {cores} cores" in warning
    fits = int(warning.rsplit("OMP_NUM_THREADS=", 1)[1].split()[0])
    assert dist.oversubscription(fits, processes, cores) is None  # the advice, followed
    assert dist.oversubscription(threads, processes, threads * processes) is None


def test_a_cpu_process_says_so_once_at_setup(monkeypatch, logged):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's, with OMP_NUM_THREADS=2 set by the user
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # no group to join in this test
    dist.setup("cpu")
    assert [m for m in logged if "OMP_NUM_THREADS=1" in m and "2 processes x 2 threads" in m]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    logged.clear()
    dist.setup("cpu")
    assert not [m for m in logged if "OMP_NUM_THREADS" in m]
