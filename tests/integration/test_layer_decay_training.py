"""optim.layer_decay in a run: the trainer sets every layer's lr to the schedule's times its scale,
FSDP2 trains and resumes its groups as one process does, and a run says at the start how the lr is
spread (the starting-weights table, or a line)."""

from pathlib import Path

import pytest
import torch
from fsdp_ranks import STEPS as FSDP_STEPS
from fsdp_ranks import tiny_model
from layer_decay_ranks import CFG, steps
from safetensors.torch import load_file

from helpers import run_ranks
from vitcli.checkpoints import state
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.transfer import load_init
from vitcli.models.zoo import build_model
from vitcli.recipe.resolve import resolve
from vitcli.runtime import dist as dist_mod
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run
from vitcli.train.optim import build_optimizer
from vitcli.train.schedule import learning_rate

DECAY, DEPTH, STEPS = 0.5, 2, 3
TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", f"model.depth={DEPTH}",
    "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
    "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.synthetic.img_size=32",
    "data.batch_size=16", "data.num_workers=0", "data.eval_batch_size=32", "schedule.warmup_steps=1",
    "run.log_every=1", "run.precision=fp32", "run.device=cpu", f"schedule.steps={STEPS}",
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny pretrained workdir to fine-tune from."""
    workdir = tmp_path_factory.mktemp("pre")
    one_run(resolve("pretrain", None, TINY), workdir)
    return workdir


def finetune(init, *extra):
    return resolve("finetune", None, [*TINY, f"init.checkpoint={init}", "schedule.decay=cosine",
                                      f"optim.layer_decay={DECAY}", *extra], complete=complete)


def test_every_group_trained_at_the_schedules_lr_times_its_layers_scale(pretrained, tmp_path):
    r = finetune(pretrained)
    one_run(r, tmp_path)
    groups = state.load_state(tmp_path / f"state-{STEPS}.pt")["optimizer"]["param_groups"]
    lr = learning_rate(STEPS - 1, peak_lr=r.optim.lr, total_steps=STEPS, warmup_steps=1,
                       decay=r.schedule.decay, end_lr=r.schedule.end_lr)  # the last step's
    assert 0 < lr < r.optim.lr
    assert [g["lr"] for g in groups] == [lr * g["lr_scale"] for g in groups]
    assert sorted({g["lr_scale"] for g in groups}) == [DECAY ** (DEPTH + 1 - i) for i in range(DEPTH + 2)]
    logged_lr = [row["train/lr"] for row in read_metrics(tmp_path / "metrics.jsonl") if "train/lr" in row]
    assert logged_lr[-1] == lr  # the schedule's, which the head trains at


def test_the_starting_weights_table_shows_the_lr_multipliers(pretrained):
    r = finetune(pretrained)
    rows = dict(load_init(build_model(r.model, 4), r, 4, dist_mod.setup("cpu")))
    low = DECAY ** (DEPTH + 1)
    assert rows["layer decay"] == (f"lr x {low:.2g} (embeddings) to 1 (head) over {DEPTH + 2} layers, "
                                   f"{DECAY} per layer")
    off = finetune(pretrained, "optim.layer_decay=1")
    assert "layer decay" not in dict(load_init(build_model(off.model, 4), off, 4, dist_mod.setup("cpu")))


def test_a_run_without_starting_weights_says_it_in_a_line(tmp_path, logged):
    one_run(resolve("pretrain", None, [*TINY, "schedule.steps=2", f"optim.layer_decay={DECAY}"]), tmp_path)
    assert any(m.startswith("layer decay: lr x ") and f"over {DEPTH + 2} layers" in m for m in logged), logged


def test_fsdp_with_layer_decay_trains_what_one_process_trains_and_resumes_bit_exactly(tmp_path, one_thread):
    """2 processes (tests/integration/layer_decay_ranks.py, fused AdamW on the shards) against the
    same steps unsharded here: 1e-5 as in test_fsdp (the same gradients summed in another order,
    ~1e-7 apart)."""
    run_ranks(Path(__file__).with_name("layer_decay_ranks.py"), tmp_path)
    model = tiny_model(0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    steps(model, build_optimizer(model, CFG), 0, FSDP_STEPS)
    expected = model.state_dict()
    straight, resumed = (load_file(tmp_path / f"{run}.safetensors") for run in ("straight", "resumed"))
    assert max((straight[k] - expected[k]).abs().max().item() for k in expected) < 1e-5
    assert all(torch.equal(straight[k], resumed[k]) for k in expected)
    assert min((expected[k] - start[k]).abs().max().item() for k in expected) > 1e-4, "every tensor trained"
