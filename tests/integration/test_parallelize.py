"""train.parallelize on 2 processes (Gloo, CPU): the order a CUDA run gets by default (activation
checkpointing, then DDP or FSDP2, then torch.compile) trains what one eager process trains and
reduces the gradients once per optimizer step, not once per micro-batch; and every optimizer steps
under every strategy.

The 2-process cases run in one torchrun launch (tests/integration/parallel_ranks.py); the tests
below read what rank 0 wrote and compare it with one eager process on the whole global batch.
"""

import json
from pathlib import Path

import pytest
import torch
from fsdp_ranks import OPTIM, STEPS, tiny_model, train
from parallel_ranks import OPTIMIZER_STEPS, OPTIMIZERS, STRATEGIES
from safetensors.torch import load_file

from helpers import run_ranks
from vitcli.train.optim import build_optimizer

HERE = Path(__file__).resolve().parent
ATOL = 1e-5  # test_fsdp's bound for 2 processes against one: 1% of one Adam step (lr 1e-3)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The directory rank 0 of the 2-process run filled, and its cases.json."""
    out = tmp_path_factory.mktemp("parallel")
    run_ranks(HERE / "parallel_ranks.py", out)
    return out, json.loads((out / "cases.json").read_text())


def one_process(cfg, steps: int) -> dict[str, torch.Tensor]:
    """`steps` eager steps of one process on the whole global batch, no checkpointing: the
    reference."""
    model = tiny_model(0)
    train(model, build_optimizer(model, cfg), 0, steps)
    return model.state_dict()


def worst(got: dict, expected: dict) -> float:
    assert sorted(got) == sorted(expected)
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpointed_compiled_training_matches_one_eager_process(ranks, strategy, one_thread):
    """Activation checkpointing, DDP or FSDP2, torch.compile and 2 micro-batches per process train
    what one eager process trains on the whole batch: within ATOL (measured 4.0e-7 for DDP and
    8.7e-7 for FSDP after STEPS steps: inductor fuses and reorders the float sums, where test_fsdp's
    eager FSDP is 1.8e-7 off). The checkpointed blocks' recomputation runs inside the compiled
    backward."""
    out, _ = ranks
    assert worst(load_file(out / f"compiled-{strategy}.safetensors"), one_process(OPTIM, STEPS)) < ATOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_compiled_model_reduces_gradients_only_in_the_last_micro_batch(ranks, strategy):
    """The backward of the first micro-batch only accumulates; the last one reduces: DDP its one
    bucket, FSDP one reduce-scatter per sharded unit (2 blocks and the root). Through
    torch.compile's wrapper FSDP used to reduce-scatter at every micro-batch ([3, 3])."""
    _, cases = ranks
    units = {"ddp": 1, "fsdp": 3}[strategy]
    assert cases[f"compiled-{strategy}"]["reductions"] == [[0, units]] * STEPS


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_steps_under_every_strategy(ranks, name, strategy, one_thread):
    """Each optimizer's kernel runs on FSDP2's DTensors too (fused AdamW has a sharding rule in
    torch, fused SGD has none: foreach there) and updates as one process does: within ATOL (measured
    6.9e-7 for AdamW, 3.7e-9 for SGD, whose largest update here is 9e-4)."""
    out, cases = ranks
    got = load_file(out / f"{name}-{strategy}.safetensors")
    assert worst(got, one_process(OPTIMIZERS[name], OPTIMIZER_STEPS)) < ATOL
    fused = name == "adamw" or (name == "sgd_torch" and strategy == "ddp")
    assert cases[f"{name}-{strategy}"]["kernel"] == ["fused" if fused else "foreach"]
