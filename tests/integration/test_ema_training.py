"""Weight EMA in the trainer, as a user sees it: evaluated beside the weights, in every checkpoint,
resumed bit-identically (whole and sharded checkpoints), exported as `ema.save` says; a checkpoint
without one resumes only with EMA off."""

import pytest
import test_train
import torch
import torch.distributed.checkpoint as dcp

from helpers import run_vit, stopped_at_call
from vitcli.checkpoints import manager, state
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.transfer import load_for_eval
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run

# test_train's tiny run, smaller still, with dropout: a resume that drew other dropout masks would
# show
TINY = [*test_train.TINY, "model.dropout=0.1", "data.batch_size=16", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32"]
EMA = ["ema.decay=0.9", "ema.warmup=true"]
NO_EVAL = ["data.val_split=", "data.test_split="]


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_ema_is_evaluated_beside_the_weights_and_exported_as_ema_save_says(tmp_path):
    ema_run, plain = tmp_path / "ema", tmp_path / "plain"
    summary = one_run(recipe("schedule.steps=4", "run.eval_every=2", *EMA, "ema.save=ema"), ema_run)
    rows = read_metrics(ema_run / "metrics.jsonl")
    assert [r["step"] for r in rows if "val_ema/top1" in r] == [2, 4], "each evaluation, on both weights"
    assert {"val_ema/top1", "val_ema/loss", "test_ema/top1", "test_ema/loss", "val/top1"} <= set(summary)
    saved = state.load_state(state.checkpoint_path(ema_run, 4))
    assert saved["ema"].keys() == saved["model"].keys()  # every weight of this model is a float
    assert not equal(saved["ema"], saved["model"]), "an average, not a copy of the weights"
    weights, meta = load_weights(ema_run / "model.safetensors")
    assert meta["weights"] == "ema" and equal(weights, saved["ema"])
    # a later stage reads it as it reads any other: every tensor of the network it rebuilds is the
    # EMA's
    model = load_for_eval(resolve("eval-fewshot", None, [f"init.checkpoint={ema_run}"], complete=complete,
                                  inputs=False))
    assert all(torch.equal(v, saved["ema"][k]) for k, v in model.state_dict().items())

    # the same run without EMA: no EMA anywhere, and the same trained weights, so the EMA (updated,
    # and swapped in and out of the model for each evaluation) only watched
    summary = one_run(recipe("schedule.steps=4", "run.eval_every=2"), plain)
    assert not any("_ema" in k for k in summary)
    assert "ema" not in state.load_state(state.checkpoint_path(plain, 4))
    weights, meta = load_weights(plain / "model.safetensors")
    assert meta["weights"] == "live" and equal(weights, saved["model"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resumed_run_ends_with_the_ema_of_the_run_never_stopped(tmp_path, monkeypatch, strategy):
    """Bit for bit (torch.equal), dropout on; with fsdp (one process: the checkpoints are DCP
    directories) the EMA comes back from its shards. ema.save may change on resume: it picks what
    the end writes."""
    steps = ["schedule.steps=6", "run.ckpt_every=3", f"run.strategy={strategy}", *EMA, *NO_EVAL]
    one_run(recipe(*steps), tmp_path / "straight")
    stopped_at_call(monkeypatch, recipe(*steps), tmp_path / "resumed", 5)
    assert manager.latest_good_state(tmp_path / "resumed")[1]["step"] == 3
    one_run(recipe(*steps, "ema.save=ema"), tmp_path / "resumed")
    straight, meta = load_weights(tmp_path / "straight" / "model.safetensors")
    resumed, meta_resumed = load_weights(tmp_path / "resumed" / "model.safetensors")
    assert (meta["weights"], meta_resumed["weights"]) == ("live", "ema")
    ema = saved_ema(tmp_path / "straight", 6, straight)
    assert equal(saved_ema(tmp_path / "resumed", 6, straight), ema)
    assert equal(resumed, ema) and not equal(straight, ema)


def saved_ema(workdir, step: int, like: dict) -> dict:
    """The EMA in the checkpoint of `step`: a whole file's, or read from a directory's shards into
    tensors shaped as `like`."""
    path = state.checkpoint_dir(workdir, step)
    if not path.is_dir():
        return state.load_state(state.checkpoint_path(workdir, step))["ema"]
    ema = {k: torch.empty_like(v) for k, v in like.items()}
    dcp.load({"ema": ema}, checkpoint_id=path, no_dist=True)
    return ema


def test_a_checkpoint_without_an_ema_resumes_only_with_ema_off(tmp_path):
    """A checkpoint of a run without EMA (or of a vitcli before it: its recipe has no `ema` section,
    read as off) does not resume into a run that turns EMA on: one line naming ema.decay."""
    plain = ["schedule.steps=4", "run.ckpt_every=2", *NO_EVAL]
    r = recipe(*plain)
    one_run(r, tmp_path / "plain")
    path = state.checkpoint_path(tmp_path / "plain", 2)
    saved = state.load_state(path)
    older = tmp_path / "older"
    older.mkdir()
    state.save_state(state.checkpoint_path(older, 2), {**saved, "recipe": {
        k: v for k, v in saved["recipe"].items() if k != "ema"}})
    with pytest.raises(RecipeError, match=r"\(ema\.decay: 0\.0 there, 0\.9 now") as e:
        one_run(recipe(*plain, *EMA), older)
    assert "\n" not in str(e.value)
    one_run(r, older)  # with EMA off it resumes, and ends as the run never stopped
    assert equal(load_weights(older / "model.safetensors")[0], load_weights(tmp_path / "plain" /
                                                                             "model.safetensors")[0])


def test_a_bad_ema_key_is_one_line_and_exit_2(monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", "schedule.steps=3",
                             "schedule.warmup_steps=1", "ema.decay=0.9", "ema.min_decay=0.99")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "ema.min_decay=0.99 is above ema.decay=0.9" in err
