"""The training loop as a user sees it: loss goes down, files appear, resume continues, failures are
clean."""

import json
import random

import numpy as np
import pytest
import torch
from safetensors import safe_open

from helpers import stopped_at_call
from vitcli.checkpoints import manager, state
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.transfer import load_for_eval
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import CheckpointError, RecipeError, TrainingError
from vitcli.objectives import supervised
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run

TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
    "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=256",
    "data.synthetic.val_size=64", "data.synthetic.test_size=64", "data.synthetic.img_size=32",
    "data.batch_size=32", "data.num_workers=0", "data.eval_batch_size=64", "optim.lr=3e-3",
    "optim.weight_decay=0.0", "schedule.warmup_steps=1", "schedule.decay=cosine", "run.log_every=1",
    "data.crop_min_area=1.0", "data.hflip=false",
    # the thresholds below were measured in fp32: pinned, so an AVX-512 (bf16) machine tests the
    # same
    "run.precision=fp32",
]


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


def test_short_pretrain_lowers_loss_and_writes_outputs(tmp_path):
    # 32 images seen 40 times: a tiny model must fit them (the full synthetic task takes minutes to
    # learn)
    results = one_run(recipe("schedule.steps=40", "data.synthetic.train_size=32"), tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in r]
    first, last = rows[0]["train/loss"], sum(r["train/loss"] for r in rows[-5:]) / 5
    assert last < first - 0.1, (first, last)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert {"train/loss", "train/lr", "train/img_per_s"} <= set(rows[0])
    assert 0.0 <= results["val/top1"] <= 1.0 and "test/top1" in results
    for name in ("recipe.yaml", "metrics.jsonl", "model.safetensors", "state-40.pt", "summary.json",
                 "curves.png"):
        assert (tmp_path / name).is_file(), name
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["recipe"])["schedule"]["steps"] == 40
    assert json.loads(meta["model"])["embed_dim"] == 32
    assert not list(tmp_path.glob(".*.tmp")), "no temporary files left behind"


def test_final_weights_rebuild_the_model_alone(tmp_path):
    """A later stage needs nothing but the file: its metadata resolves to the network, every weight
    loads."""
    one_run(recipe("schedule.steps=3"), tmp_path)
    model = load_for_eval(resolve("eval-fewshot", None, [f"init.checkpoint={tmp_path}"], complete=complete,
                                      inputs=False))
    sd, _ = load_weights(tmp_path / "model.safetensors")
    assert sorted(model.state_dict()) == sorted(k for k in sd if not k.startswith("head."))
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 32)  # pre-logits: eval-fewshot needs no head


def test_interrupted_run_resumes_at_the_right_step_and_matches(tmp_path, monkeypatch):
    r = recipe("schedule.steps=8", "run.ckpt_every=3", "data.val_split=", "data.test_split=")
    one_run(r, tmp_path / "straight")

    stopped_at_call(monkeypatch, r, tmp_path / "resumed", 5)
    assert manager.latest_good_state(tmp_path / "resumed")[1]["step"] == 3
    one_run(r, tmp_path / "resumed")  # automatic: the workdir holds a checkpoint

    steps = [row["step"] for row in read_metrics(tmp_path / "resumed" / "metrics.jsonl")]
    assert steps == list(range(1, 9)), "each step logged once, none lost or repeated"
    a, _ = load_weights(tmp_path / "straight" / "model.safetensors")
    b, _ = load_weights(tmp_path / "resumed" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("change", ["optim.lr=0.1", "run.seed=1", "data.micro_batch_size=8",
                                    "run.precision=bf16"])
def test_resume_refuses_a_change_to_what_is_trained(tmp_path, change):
    one_run(recipe("schedule.steps=3", "run.ckpt_every=1", "data.val_split=", "data.test_split="), tmp_path)
    with pytest.raises(RecipeError, match=change.split("=")[0]):
        one_run(recipe("schedule.steps=3", "run.ckpt_every=1", "data.val_split=", "data.test_split=", change),
                tmp_path)


def test_resume_accepts_changes_to_how_a_run_is_watched(tmp_path, monkeypatch):
    base = ["schedule.steps=4", "run.ckpt_every=2", "data.val_split=", "data.test_split="]
    one_run(recipe(*base), tmp_path / "straight")
    stopped_at_call(monkeypatch, recipe(*base), tmp_path / "resumed", 3)  # Ctrl-C in step 3: state-2 kept
    assert manager.latest_good_state(tmp_path / "resumed")[1]["step"] == 2
    watched = ["run.log_every=2", "run.ckpt_every=3", "run.eval_every=5", "data.eval_batch_size=8",
               "run.ckpt_every_minutes=5", "run.activation_checkpointing=true"]
    summary = one_run(recipe(*base, *watched), tmp_path / "resumed", resume=True)

    assert summary["steps"] == 4
    rows = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2, 4], "2 before, then every 2nd"
    a, _ = load_weights(tmp_path / "straight" / "model.safetensors")
    b, _ = load_weights(tmp_path / "resumed" / "model.safetensors")
    for k in a:  # activation checkpointing recomputes the same forward: the same weights
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    plain = ["schedule.steps=3", "data.inception_crop=false", "data.hflip=false", "data.val_split=",
             "data.test_split="]
    one_run(recipe(*plain), tmp_path / "big")
    one_run(recipe(*plain, "data.micro_batch_size=8"), tmp_path / "accum")
    a, _ = load_weights(tmp_path / "big" / "model.safetensors")
    b, _ = load_weights(tmp_path / "accum" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def test_repeated_augmentation_trains_and_resumes_onto_the_same_weights(tmp_path, monkeypatch):
    """data.repeated_aug=3 (DeiT's sampler, data/sampler.step_rows) in a run of 2 steps; stopped
    after its first checkpoint, it resumes onto the weights of the run that was not stopped."""
    r = recipe("data.repeated_aug=3", "schedule.steps=2", "run.ckpt_every=1", "data.crop_min_area=0.3",
               "data.val_split=", "data.test_split=")
    one_run(r, tmp_path / "straight")
    rows = [row for row in read_metrics(tmp_path / "straight" / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2] and all(np.isfinite(row["train/loss"]) for row in rows)
    stopped_at_call(monkeypatch, r, tmp_path / "resumed", 2)
    one_run(r, tmp_path / "resumed")
    a, _ = load_weights(tmp_path / "straight" / "model.safetensors")
    b, _ = load_weights(tmp_path / "resumed" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)

def poison_third_loss(monkeypatch):
    """The training loss of the third call (step 3 as metrics.jsonl numbers steps) made NaN."""
    real = supervised.loss_fn

    def poisoned(cfg):
        fn, calls = real(cfg), {"n": 0}

        def loss(logits, target):
            calls["n"] += 1
            value = fn(logits, target)
            return value * float("nan") if calls["n"] == 3 else value

        return loss

    monkeypatch.setattr(supervised, "loss_fn", poisoned)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    """With rollback off (run.max_rollbacks=0; on, tests/integration/test_rollback.py): the message
    numbers the step as metrics.jsonl does, names the checkpoint kept, and does not advise the
    clipping the recipe already does (optim.clip_grad_norm=1, the default)."""
    poison_third_loss(monkeypatch)
    with pytest.raises(TrainingError) as e:
        one_run(recipe("schedule.steps=5", "run.ckpt_every=1", "run.max_rollbacks=0"), tmp_path)
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row]
    assert [row["step"] for row in rows] == [1, 2]
    assert "loss became nan at step 3 " in str(e.value)
    assert "the newest checkpoint, state-2.pt, is kept" in str(e.value)
    assert "optim.clip_grad_norm=1 already clips" in str(e.value) and "\n" not in str(e.value)
    _, saved = manager.latest_good_state(tmp_path)
    assert saved["step"] == 2
    assert all(torch.isfinite(v).all() for v in saved["model"].values())
    assert not (tmp_path / "model.safetensors").exists()
    # the advice holds: a lower lr with --no-resume trains here (the same workdir resumed is refused)
    assert "with --no-resume or in a new --workdir" in str(e.value)
    monkeypatch.undo()
    lower = recipe("schedule.steps=5", "run.ckpt_every=1", "run.max_rollbacks=0", "optim.lr=1e-3")
    with pytest.raises(RecipeError, match="different recipe"):
        one_run(lower, tmp_path)
    assert one_run(lower, tmp_path, resume=False)["steps"] == 5


def test_a_divergence_before_any_checkpoint_says_so_and_offers_clipping(tmp_path, monkeypatch):
    poison_third_loss(monkeypatch)
    with pytest.raises(TrainingError) as e:
        one_run(recipe("schedule.steps=5", "run.ckpt_every=4", "optim.clip_grad_norm=0"), tmp_path)
    assert "loss became nan at step 3 " in str(e.value)
    assert "no checkpoint was written before it" in str(e.value)
    assert not manager.latest_good_state(tmp_path)
    assert "try a lower optim.lr, or optim.clip_grad_norm=1" in str(e.value)


def test_bf16_autocast_trains(tmp_path):
    one_run(recipe("schedule.steps=3", "run.precision=bf16", "data.val_split="), tmp_path)
    sd, _ = load_weights(tmp_path / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in sd.values()), "weights stay fp32 under autocast"


def test_sigmoid_loss_with_head_bias_init(tmp_path):
    r = recipe("schedule.steps=2", "optim.loss=sigmoid", "model.head_bias_init=-10", "data.val_split=",
               "data.test_split=")
    one_run(r, tmp_path)
    rows = [row for row in read_metrics(tmp_path / "metrics.jsonl") if "train/loss" in row]
    # sigmoid xent summed over 4 classes with logits near -10: about 1 (the true class) + 3 * e^-10
    assert rows[0]["train/loss"] == pytest.approx(10.0, abs=1.0)


def test_checkpoints_by_the_clock_as_well_as_by_steps(tmp_path):
    base = ["schedule.steps=4", "run.ckpt_every=1000", "run.keep_checkpoints=10", "data.val_split=",
            "data.test_split="]
    one_run(recipe(*base, "run.ckpt_every_minutes=1e-9"), tmp_path / "clock")  # due after every step
    assert [p.name for p in state.checkpoints(tmp_path / "clock")] == [f"state-{s}.pt" for s in (4, 3, 2, 1)]
    one_run(recipe(*base, "run.ckpt_every_minutes=0"), tmp_path / "off")
    assert [p.name for p in state.checkpoints(tmp_path / "off")] == ["state-4.pt"]  # the last step only


def test_a_checkpoint_holds_each_ranks_train_stream_state_and_no_rng_state(tmp_path):
    one_run(recipe("schedule.steps=2", "data.val_split=", "data.test_split="), tmp_path)
    _, saved = manager.latest_good_state(tmp_path)
    assert "rng" not in saved  # every draw of training comes from (seed, step, micro-batch)
    assert saved["data"] == {"step": 2, "examples": 64, "world_size": 1,
                             "streams": [{"kind": "mapped", "world_size": 1, "micro_batches": 2}],
                             "skips": []}


def _older_rng_states() -> dict:
    """One process's RNG states as checkpoints held them before (runtime.rngs.capture, now gone):
    every value a tensor, number or string, so that they load with weights_only."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "cuda": [],
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next}}


def _rewritten(src, workdir, step: int, change) -> None:
    """`workdir` holding only the checkpoint of `step` from `src`, its contents changed by
    `change`."""
    saved = state.load_state(state.checkpoint_path(src, step))
    workdir.mkdir()
    state.save_state(state.checkpoint_path(workdir, step), change(saved))


def test_an_older_checkpoint_with_rng_states_and_no_stream_state_resumes_bit_identical(tmp_path):
    """Checkpoints once held every rank's RNG states (`rng`) and, for a map-style split, no train
    stream state: such a checkpoint resumes, its `rng` unread and its data placed by the step alone,
    and the run ends with the weights of the run never stopped (torch.equal; dropout on, so a draw
    left to the global RNGs would show)."""
    r = recipe("schedule.steps=4", "run.ckpt_every=2", "run.keep_checkpoints=2", "model.dropout=0.1",
               "data.val_split=", "data.test_split=")
    one_run(r, tmp_path / "straight")
    _rewritten(tmp_path / "straight", tmp_path / "older", 2, lambda saved: {
        **saved, "rng": [_older_rng_states()],
        "data": {k: v for k, v in saved["data"].items() if k != "streams"}})
    one_run(r, tmp_path / "older")
    a, b = (load_weights(tmp_path / w / "model.safetensors")[0] for w in ("straight", "older"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_train_stream_state_at_odds_with_the_step_is_refused(tmp_path):
    r = recipe("schedule.steps=4", "run.ckpt_every=2", "run.keep_checkpoints=2", "data.val_split=",
               "data.test_split=")
    one_run(r, tmp_path / "straight")
    _rewritten(tmp_path / "straight", tmp_path / "odd", 2, lambda saved: {
        **saved, "data": {**saved["data"], "streams": [{**saved["data"]["streams"][0], "micro_batches": 3}]}})
    with pytest.raises(CheckpointError, match="micro-batch 3, not 2: its data position and step disagree"):
        one_run(r, tmp_path / "odd")
