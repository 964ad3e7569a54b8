"""One process's random number generators (torch CPU and CUDA, numpy, python) as a checkpoint can hold them.

A checkpoint is read with `torch.load(weights_only=True)`, which admits tensors, numbers, strings and
containers only; numpy's and python's states are tuples of other types, so they are stored as tensors here
and rebuilt on the way back. Written by hand because neither torch nor numpy offers a loadable form.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    """This process's RNG states, every value a tensor, number or string. CUDA's is its own GPU's
    alone (the current device, which runtime.dist.setup set): every GPU's states would not restore
    on a host that shows fewer, and the other GPUs are other processes' to save."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else [],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def restore(states: dict) -> None:
    """Set this process's RNGs to what `capture` returned (its GPU's where both sides have one)."""
    torch.set_rng_state(states["torch"])
    if torch.cuda.is_available():
        cuda = own_cuda_state(states["cuda"], torch.cuda.current_device())
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    p = states["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))


def own_cuda_state(saved: torch.Tensor | list, index: int) -> torch.Tensor | None:
    """The CUDA state to restore on this process's GPU, cuda:`index`, from a checkpoint's: ours is
    one tensor, the saving process's own GPU's; an older run's is a list with one per GPU its host
    showed, cuda:i's at i, of which this GPU's is taken. None where there is none: a CPU run's (an
    empty list), or an older list from a host that showed fewer GPUs (training's draws do not use
    it: checkpoints.manager._restore_rngs)."""
    if isinstance(saved, torch.Tensor):
        return saved
    return saved[index] if index < len(saved) else None
