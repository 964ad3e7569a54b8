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
    """This process's RNG states, every value a tensor, number or string."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def restore(states: dict) -> None:
    """Set this process's RNGs to what `capture` returned (CUDA only where both sides have it)."""
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    n = states["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached"]))
    p = states["python"]
    random.setstate((p["version"], tuple(p["internal"].tolist()), p["gauss_next"]))
