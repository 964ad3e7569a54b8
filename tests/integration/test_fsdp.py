"""run.strategy: fsdp. FSDP2 on 2 processes (Gloo, CPU) trains what one process trains; its sharded
checkpoints resume bit-exactly, reshard, refuse damage, and live beside the .pt checkpoints in one
discovery and rotation.

The 2-process scenarios run once, in one torchrun launch (tests/integration/fsdp_ranks.py, ~15 s,
most of it importing torch in three processes); the tests below read what rank 0 wrote and compare
it with a one-process run.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from fsdp_ranks import EMA, OPTIM, SAVE_AT, STEPS, TINY, global_batch, tiny_model, train, train_with_ema
from safetensors.torch import load_file

from helpers import flipped_bytes, run_ranks, warnings
from vitcli.checkpoints import manager, sharded, state
from vitcli.checkpoints.weights import FORMAT, load_weights
from vitcli.errors import CheckpointError, ModelError, RecipeError
from vitcli.models.mpp import MppModel
from vitcli.models.t2t import T2TViT
from vitcli.recipe.checks import check
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig, MppConfig
from vitcli.runtime import files
from vitcli.runtime.dist import Dist
from vitcli.train import parallelize
from vitcli.train.ema import WeightEma
from vitcli.train.optim import build_optimizer

HERE = Path(__file__).resolve().parent
ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
# FSDP reduce-scatters the two processes' gradients (each a mean of 2 micro-batch means) where one
# process takes one mean over all 8 images: the same sum in another order, ~1e-7 apart in float32
# (measured 1.8e-7 on the weights after 4 steps). Adam's update is at most ~lr = 1e-3 per step, so
# 1e-5 is 1% of one step: a wrong average (a sum, or one process's gradient) or a missed clip moves
# weights by far more.
ATOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The directory rank 0 of the 2-process run filled."""
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(HERE / "fsdp_ranks.py", out)
    return out


@pytest.fixture(scope="module")
def one_process(one_thread):
    """The same STEPS on the whole global batch, unsharded, in this process: (final state, gradient
    norms)."""
    model = tiny_model(0)
    norms = train(model, build_optimizer(model, OPTIM), 0, STEPS)
    return model.state_dict(), norms


def test_fsdp_on_two_processes_trains_the_weights_one_process_trains_on_the_global_batch(ranks, one_process):
    expected, norms = one_process
    fsdp = load_file(ranks / "straight.safetensors")
    assert sorted(fsdp) == sorted(expected)
    worst = {k: (fsdp[k] - expected[k]).abs().max().item() for k in expected}
    assert max(worst.values()) < ATOL, worst
    start = tiny_model(0).state_dict()
    moved = {k: (expected[k] - start[k]).abs().max().item() for k in expected}
    assert min(moved.values()) > 100 * ATOL, "every tensor trained, far beyond the tolerance"
    fsdp_norms = json.loads((ranks / "norms.json").read_text())
    assert fsdp_norms == pytest.approx(norms, rel=1e-5), "the global gradient norm, gathered from the shards"
    assert min(norms) > OPTIM.clip_grad_norm, "the clip bound at every step, so clipping was compared too"


def test_resuming_a_sharded_checkpoint_ends_bit_identical_to_an_uninterrupted_run(ranks):
    straight, resumed = load_file(ranks / "straight.safetensors"), load_file(ranks / "resumed.safetensors")
    assert sorted(straight) == sorted(resumed)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), (
        "the same shards, the same Adam slots and step counts: every bit the same")
    at_save = load_file(ranks / "at_save.safetensors")
    assert not all(torch.equal(straight[k], at_save[k]) for k in straight), "and the resumed steps did train"


def test_a_sharded_ema_resumes_bit_identical_and_averages_what_one_process_averages(ranks, one_thread):
    """The EMA of 2 FSDP processes, sharded like the model: saved in the checkpoint's shards and
    loaded into a fresh EMA, it ends bit-identical to the run never stopped; and it is the EMA one
    process keeps of the same training, within the weights' 1-vs-2-process tolerance (ATOL)."""
    straight, resumed = (load_file(ranks / f"ema_{run}.safetensors") for run in ("straight", "resumed"))
    assert sorted(straight) == sorted(resumed) == sorted(tiny_model(0).state_dict())
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    model = tiny_model(0)
    optimizer, ema = build_optimizer(model, OPTIM), WeightEma(model, EMA)
    train_with_ema(model, optimizer, ema, 0, STEPS)
    assert max((straight[k] - v).abs().max().item() for k, v in ema.state_dict().items()) < ATOL
    assert max((straight[k] - v).abs().max().item() for k, v in model.state_dict().items()) > 100 * ATOL, (
        "an average: far from the weights themselves")


def test_a_sharded_model_evaluates_and_exports_its_ema_inside_swapped(ranks, one_thread):
    """With the EMA swapped in, the gathered state (what model.safetensors gets) is the EMA and a
    forward under `gathered` (the evaluators' path) computes the EMA's logits; after it, the model
    has its own weights back, bit for bit."""
    ema = load_file(ranks / "ema_straight.safetensors")
    assert all(torch.equal(v, ema[k]) for k, v in load_file(ranks / "ema_swapped.safetensors").items())
    params, after = load_file(ranks / "ema_params.safetensors"), load_file(ranks / "ema_after.safetensors")
    assert all(torch.equal(after[k], v) for k, v in params.items())
    plain = tiny_model(5)
    plain.load_state_dict(ema)
    with torch.no_grad():
        expected = plain(global_batch(0)[0])
    torch.testing.assert_close(load_file(ranks / "ema_logits.safetensors")["logits"], expected,
                               rtol=1e-5, atol=1e-6)


def test_full_model_state_has_the_plain_models_keys_and_loads_strictly(ranks):
    weights, meta = load_weights(ranks / "straight.safetensors")
    plain = tiny_model(0)
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in plain.state_dict().items()}
    params = load_file(ranks / "params.safetensors")  # gathered from the parameters, not a state dict
    assert all(torch.equal(weights[k], params[k]) for k in params)
    plain.load_state_dict(weights, strict=True)
    assert meta == {"format": FORMAT, "model": "tiny"}


def test_a_sharded_checkpoint_of_two_processes_loads_into_one_unsharded_process(ranks, one_process, tmp_path):
    """DCP reshards: the run may resume on another process count (here 1, without a process
    group)."""
    model = tiny_model(5)
    optimizer = build_optimizer(model, OPTIM)
    extra = sharded.load(ranks / "run" / f"state-{SAVE_AT}", model, optimizer)
    at_save = load_file(ranks / "at_save.safetensors")
    assert all(torch.equal(model.state_dict()[k], at_save[k]) for k in at_save)
    train(model, optimizer, extra["step"], STEPS)
    expected, _ = one_process
    assert max((model.state_dict()[k] - expected[k]).abs().max().item() for k in expected) < ATOL


def test_the_extra_part_comes_back_as_saved_without_pickle(ranks):
    path = ranks / "run" / f"state-{SAVE_AT}"
    extra = sharded.verified_extra(path)
    assert extra["step"] == SAVE_AT and extra["data"] == {"position": SAVE_AT * 4}
    assert extra["recipe"] == {"run": {"strategy": "fsdp"}}
    assert [r.tolist() for r in extra["rng"]] == [[0, 0, 0], [1, 1, 1]]
    listed = files.verify_manifest(path)
    assert sorted(listed) == sorted(p.name for p in path.iterdir() if p.name != files.MANIFEST)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(listed), "one shard file per process"


def damaged_copy(ranks, workdir) -> Path:
    """The 2-process checkpoint at SAVE_AT copied into `workdir`, with one byte of rank 1's shard
    flipped."""
    path = state.checkpoint_dir(workdir, SAVE_AT)
    shutil.copytree(ranks / "run" / path.name, path)
    flipped_bytes(path / "__1_0.distcp")
    return path


def test_a_flipped_byte_in_a_shard_is_a_checkpoint_error_naming_it(ranks, tmp_path):
    path = damaged_copy(ranks, tmp_path)
    model = tiny_model(0)
    with pytest.raises(CheckpointError) as err:
        sharded.load(path, model, build_optimizer(model, OPTIM))
    message = str(err.value)
    assert "__1_0.distcp" in message and "sha256 differs" in message and "\n" not in message


def test_a_damaged_sharded_checkpoint_falls_back_to_the_previous_one(ranks, tmp_path, logged):
    older = fake_sharded(tmp_path, 1)
    damaged_copy(ranks, tmp_path)
    path, extra = manager.latest_good_state(tmp_path)
    assert path == older and extra["step"] == 1
    (warning,) = warnings(logged)
    assert "__1_0.distcp" in warning and f"resuming from {older.name} instead" in warning


def test_a_leftover_temporary_directory_is_never_taken_for_a_checkpoint(ranks, tmp_path):
    shutil.copytree(ranks / "run" / f"state-{SAVE_AT}", tmp_path / f"state-{SAVE_AT}")
    leftover = tmp_path / ".state-9.abcd1234.tmp"  # a whole, verifiable copy, but a save that never finished
    shutil.copytree(tmp_path / f"state-{SAVE_AT}", leftover)
    assert state.checkpoints(tmp_path) == [tmp_path / f"state-{SAVE_AT}"]
    assert manager.latest_good_state(tmp_path)[1]["step"] == SAVE_AT
    assert leftover in state.state_files(tmp_path), "a fresh run sets it aside with the rest"
    assert state.remove_stale_dirs(tmp_path) == [leftover] and not leftover.exists()
    assert (tmp_path / f"state-{SAVE_AT}").is_dir()


def test_activation_checkpointing_on_two_processes_gives_the_same_gradients(ranks):
    """Exactly the same (tolerance 0): the recomputation runs the same kernels on the same inputs,
    and the dropout and drop-path draws are replayed from the restored RNG state."""
    plain, checkpointed = (load_file(ranks / "grads_ac_False.safetensors"),
                           load_file(ranks / "grads_ac_True.safetensors"))
    assert sorted(plain) == sorted(checkpointed) and len(plain) == len(list(tiny_model(0).parameters()))
    assert all(torch.equal(plain[k], checkpointed[k]) for k in plain)
    assert all(v.abs().max() > 0 for v in plain.values())


# ---------------------------------------------------------------- one process, no process group


def grads(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    x, y = global_batch(0)
    torch.manual_seed(seed)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_alone_keeps_names_and_gradients(one_thread):
    cfg = ModelConfig(**{**TINY.__dict__, "dropout": 0.1, "drop_path": 0.1})
    plain = tiny_model(0, cfg)
    checkpointed = parallelize.shard(tiny_model(0, cfg), ONE, activation_checkpointing=True)
    assert list(checkpointed.state_dict()) == list(plain.state_dict()), "hooks, not wrappers: the same keys"
    expected, got = grads(plain, 3), grads(checkpointed, 3)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "tolerance 0, as on two processes"
    assert not torch.equal(grads(tiny_model(0, cfg), 4)["blocks.0.mlp.fc1.weight"],
                           expected["blocks.0.mlp.fc1.weight"]), (
        "another dropout draw changes them: the test sees the draws")


def test_the_blocks_are_found_in_every_model_family(one_thread):
    vit = tiny_model(0)
    assert parallelize.transformer_blocks(vit) == list(vit.blocks)
    mpp = MppModel(tiny_model(0), MppConfig(), TINY.patch_size)
    assert parallelize.transformer_blocks(mpp) == list(mpp.backbone.blocks)
    t2t = T2TViT(img_size=32, num_classes=4, embed_dim=32, depth=2, num_heads=2, token_dim=8,
                 mixer="transformer")
    assert parallelize.transformer_blocks(t2t) == list(t2t.blocks) and len(t2t.blocks) == 2
    with pytest.raises(ModelError, match="run.activation_checkpointing"):
        parallelize.checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def fake_sharded(workdir: Path, step: int) -> Path:
    """A sealed checkpoint directory as manager.save leaves it, with a stand-in for DCP's files."""
    with files.atomic_dir(state.checkpoint_dir(workdir, step)) as tmp:
        sharded.write_extra(tmp, {"step": step, "recipe": {}, "rng": [torch.arange(4, dtype=torch.uint8)]})
        (tmp / sharded.DCP_METADATA).write_bytes(b"index")
        (tmp / "__0_0.distcp").write_bytes(os.urandom(64))
    return state.checkpoint_dir(workdir, step)


def pt(workdir: Path, step: int) -> Path:
    path = state.checkpoint_path(workdir, step)
    state.save_state(path, {"step": step, "model": {}, "optimizer": {}, "rng": [], "recipe": {}})
    return path


def test_directories_and_files_are_found_together_newest_first(tmp_path):
    for step in (1, 3):
        pt(tmp_path, step)
    for step in (2, 10):
        fake_sharded(tmp_path, step)
    (tmp_path / "state-7").write_text("a file named like a directory checkpoint is not one")
    assert [p.name for p in state.checkpoints(tmp_path)] == [
        "state-10", "state-3.pt", "state-2", "state-1.pt"]
    path, extra = manager.latest_good_state(tmp_path)
    assert path == tmp_path / "state-10" and extra["step"] == 10
    assert torch.equal(extra["rng"][0], torch.arange(4, dtype=torch.uint8))


def no_manifest(path):
    (path / files.MANIFEST).unlink()


def flipped_extra(path):
    flipped_bytes(path / sharded.EXTRA_JSON)


def no_metadata(path):  # a manifest that vouches for a directory without DCP's index
    (path / sharded.DCP_METADATA).unlink()
    files.write_manifest(path)


def no_recipe(path):
    sharded.write_extra(path, {"step": 6})
    files.write_manifest(path)


DAMAGE = {no_manifest: "no SHA256SUMS", flipped_extra: "extra.json: damaged", no_metadata: "no .metadata",
          no_recipe: "no recipe in extra.json"}


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_directory_is_named_and_the_previous_checkpoint_resumes(tmp_path, logged, damage):
    pt(tmp_path, 4)
    damage(fake_sharded(tmp_path, 6))
    path, saved = manager.latest_good_state(tmp_path)
    assert path.name == "state-4.pt" and saved["step"] == 4
    (warning,) = warnings(logged)
    assert "state-6" in warning and DAMAGE[damage] in warning and "\n" not in warning


def test_no_usable_checkpoint_names_the_directories(tmp_path):
    flipped_extra(fake_sharded(tmp_path, 2))
    no_manifest(fake_sharded(tmp_path, 4))
    with pytest.raises(CheckpointError, match="state-4.*state-2.*--no-resume"):
        manager.latest_good_state(tmp_path)


def tiny_linear():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.parametrize("keep", [1, 2])
def test_sharded_saves_rotate_files_and_directories_alike(tmp_path, keep):
    """manager.save of a sharded model in one process (no process group: DCP writes one shard) keeps
    the `keep` newest steps."""
    model, optimizer = tiny_linear()
    pt(tmp_path, 1)
    for step in (2, 3, 4):
        manager.save(tmp_path, {"step": step, "recipe": {}}, model, optimizer, ONE, keep, sharded=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"state-{s}" for s in range(5 - keep, 5)]


def test_a_sharded_save_first_removes_checkpoints_of_later_steps(tmp_path):
    """An abandoned run's later checkpoints go, whatever their kind, so the newest one is from this
    run."""
    model, optimizer = tiny_linear()
    pt(tmp_path, 5)
    fake_sharded(tmp_path, 6)
    manager.save(tmp_path, {"step": 3, "recipe": {}}, model, optimizer, ONE, keep=5, sharded=True)
    assert [p.name for p in state.checkpoints(tmp_path)] == ["state-3"]


def test_one_process_save_and_load_round_trip_model_and_adam(tmp_path):
    model, optimizer = tiny_linear()
    x = torch.randn(4, 3)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step()
    path = manager.save(tmp_path, {"step": 2, "recipe": {"a": 1}}, model, optimizer, ONE, keep=1,
                        sharded=True)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert sharded.load(path, fresh, fresh_optimizer) == {"step": 2, "recipe": {"a": 1}}
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i][k], loaded[i][k]) for i in saved for k in saved[i])
    assert parallelize.full_model_state(fresh).keys() == model.state_dict().keys()


def test_a_checkpoint_of_another_model_is_one_line_naming_it(tmp_path):
    model, optimizer = tiny_linear()
    path = manager.save(tmp_path, {"step": 1, "recipe": {}}, model, optimizer, ONE, keep=1, sharded=True)
    other = torch.nn.Linear(3, 5)
    with pytest.raises(CheckpointError) as err:
        sharded.load(path, other, torch.optim.AdamW(other.parameters()))
    message = str(err.value)
    assert message.startswith(f"{path}: does not fit") and "\n" not in message
    assert "torch.Size([2, 3])" in message and "torch.Size([5, 3])" in message and "model.weight" in message


def test_a_checkpoint_directory_has_the_modes_the_umask_allows(tmp_path):
    old = os.umask(0o022)
    try:
        path = fake_sharded(tmp_path, 1)
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)
    assert {oct(p.stat().st_mode & 0o777) for p in path.iterdir()} == {oct(0o644)}


def test_a_fresh_run_sets_sharded_checkpoints_aside(tmp_path):
    fake_sharded(tmp_path, 2)
    pt(tmp_path, 3)
    kept = manager.prepare_workdir(tmp_path, fresh=True)
    assert sorted(p.name for p in kept.iterdir()) == ["state-2", "state-3.pt", "state-3.pt.sha256"]
    assert state.checkpoints(tmp_path) == []


@pytest.mark.parametrize("world_size", [1, 2])
def test_fsdp_is_a_strategy_for_any_process_count(world_size):
    """With one process fsdp runs unsharded (nothing to shard over) and writes the same
    directories."""
    r = resolve("pretrain", None, ["run.strategy=fsdp", "run.activation_checkpointing=true",
                                   "data.batch_size=8"], inputs=False)  # a recipe, not a run: no length
    check(r, world_size, inputs=False)
    assert (r.run.strategy, r.run.activation_checkpointing) == ("fsdp", True)
    with pytest.raises(RecipeError, match="run.strategy: 'zero' is not one of ddp, fsdp"):
        check(resolve("pretrain", None, ["run.strategy=zero"]), world_size)
