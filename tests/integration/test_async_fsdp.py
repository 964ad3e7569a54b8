"""Checkpoints of an FSDP run written with DCP's async_save (run.ckpt_async): on 2 processes
(Gloo, CPU), the same directories and weights as the synchronous writer's; a full disk at one loses
nothing (tests/integration/async_fsdp_ranks.py runs the three)."""

from pathlib import Path

import torch
from async_fsdp_ranks import STEPS

from helpers import run_ranks
from vitcli.checkpoints import state
from vitcli.checkpoints.sharded import verified_extra
from vitcli.checkpoints.weights import load_weights
from vitcli.runtime.run_files import MODEL_FILE


def weights(workdir):
    return load_weights(workdir / MODEL_FILE)[0]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_with_dcp_async_save_writes_what_the_synchronous_writer_writes(tmp_path):
    run_ranks(Path(__file__).with_name("async_fsdp_ranks.py"), tmp_path)
    runs = {name: tmp_path / name for name in ("async", "sync", "enospc")}
    assert same(weights(runs["async"]), weights(runs["sync"]))
    for step in range(1, STEPS + 1):  # every directory sealed, its shards those of its step
        ours, theirs = (sharded_state(runs[name] / f"state-{step}", tmp_path / name)
                        for name in ("async", "sync"))
        assert same(ours, theirs), step
    assert same(weights(runs["enospc"]), weights(runs["sync"])), "a full disk lost nothing"
    assert [p.name for p in state.checkpoints(runs["enospc"])] == ["state-4", "state-3", "state-1"]
    assert not list(runs["enospc"].glob(".*.tmp"))


def sharded_state(path: Path, scratch: Path) -> dict:
    """A sharded checkpoint's tensors by dotted name, once its manifest verifies."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    verified_extra(path)
    whole = scratch / f"{path.name}.pt"
    dcp_to_torch_save(path, whole)
    return dict(flat(torch.load(whole, weights_only=True)))


def flat(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flat(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value
