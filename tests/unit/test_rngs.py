"""RNG states as a checkpoint holds them (runtime.rngs): CUDA's for this process's own GPU only, so
that a resume on a host that shows fewer GPUs fits, and a checkpoint of an older run, holding a
state for each GPU its host showed, still restores. The GPUs are stand-ins: torch gets no CUDA call.
"""

import pytest
import torch

from vitcli.runtime import rngs

STATES = [torch.full((16,), i, dtype=torch.uint8) for i in range(3)]  # cuda:0's, cuda:1's, cuda:2's


def gpus(monkeypatch, visible: int, current: int = 0) -> list:
    """A host that shows `visible` GPUs, this process on cuda:`current`. Returns the (device, state)
    pairs set; setting a device the host does not show fails, as CUDA's invalid device ordinal."""
    set_states = []

    def index(device) -> int:
        return device if isinstance(device, int) else current  # "cuda": the current device

    def get(device="cuda"):
        return STATES[index(device)]

    def put(state, device="cuda"):
        if index(device) >= visible:
            raise RuntimeError("CUDA error: invalid device ordinal")
        set_states.append((index(device), state))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    for module in (torch.cuda, torch.cuda.random):  # get_rng_state_all calls the module's own
        monkeypatch.setattr(module, "get_rng_state", get)
        monkeypatch.setattr(module, "set_rng_state", put)
    return set_states


def test_a_process_saves_and_restores_its_own_gpus_state_only(monkeypatch):
    set_states = gpus(monkeypatch, visible=3, current=2)
    saved = rngs.capture()
    assert torch.equal(saved["cuda"], STATES[2])
    rngs.restore(saved)
    assert set_states == [(2, STATES[2])]


def test_an_older_checkpoint_with_a_state_per_gpu_restores_on_a_host_that_shows_one(monkeypatch):
    set_states = gpus(monkeypatch, visible=1)
    rngs.restore({**rngs.capture(), "cuda": STATES})  # written on a host that showed three
    assert set_states == [(0, STATES[0])]


def test_an_older_list_restores_nothing_on_a_cpu_only_host(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call on a CPU-only host")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("set_rng_state", "set_rng_state_all", "get_rng_state", "get_rng_state_all",
                 "current_device"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    saved = rngs.capture()
    assert saved["cuda"] == []
    expected = torch.rand(3)
    rngs.restore({**saved, "cuda": STATES})
    assert torch.equal(torch.rand(3), expected)  # the CPU's state is restored all the same


@pytest.mark.parametrize("saved, index, taken", [
    (STATES[1], 5, 1),  # ours: the saving process's own GPU's, whatever this one's index
    (STATES, 1, 1),  # an older run's, one per GPU: this GPU's
    (STATES, 3, None),  # an older run on a host that showed fewer GPUs than this index
    ([], 0, None),  # a CPU run's
])
def test_the_state_for_this_gpu_is_ours_or_its_entry_in_an_older_list(saved, index, taken):
    got = rngs.own_cuda_state(saved, index)
    assert (got is None) if taken is None else torch.equal(got, STATES[taken])
