"""Never lose work: checkpoints survive damage, kills and shared machines; metrics.jsonl survives a
torn line."""

import os
import shutil
import tempfile

import pytest
import torch

from helpers import flipped_bytes, warnings
from vitcli.checkpoints import manager, state
from vitcli.checkpoints.weights import load_weights
from vitcli.errors import CheckpointError, RecipeError, TrainingError
from vitcli.recipe.layers import to_dict
from vitcli.recipe.resolve import resolve
from vitcli.runtime import files
from vitcli.runtime.dist import Dist
from vitcli.runtime.metrics import MetricsLog, read_metrics
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.run import one_run

TINY = [
    "model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
    "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=128",
    "data.synthetic.val_size=64", "data.synthetic.test_size=64", "data.synthetic.img_size=32",
    "data.batch_size=32", "data.num_workers=0", "optim.lr=3e-3", "schedule.warmup_steps=1", "run.log_every=1",
    "data.val_split=", "data.test_split=", "model.dropout=0", "model.drop_path=0",
]


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


def random_bytes(path):
    """Garbage that its checksum vouches for: only reading the bytes can tell."""
    path.write_bytes(os.urandom(path.stat().st_size))
    files.checksum_path(path).write_text(f"{files.sha256_of(path)}  {path.name}\n")


def missing_keys(path):
    state.save_state(path, {"step": 6, "model": {}})


def no_checksum(path):
    """Killed between the checkpoint's rename and its checksum's."""
    files.checksum_path(path).unlink()


DAMAGE = [random_bytes, flipped_bytes, missing_keys, no_checksum]
REASON = {random_bytes: "cannot read training state", flipped_bytes: "sha256 differs",
          missing_keys: "no optimizer, recipe", no_checksum: "no state-6.pt.sha256"}


def finished_then_damaged(workdir, damage):
    """A 6-step run (checkpoints at 4 and 6) whose latest checkpoint is then damaged,
    as if killed at the end."""
    r = recipe("schedule.steps=6", "run.ckpt_every=2")
    one_run(r, workdir)
    shutil.copy(workdir / MODEL_FILE, workdir / "straight.safetensors")
    (workdir / MODEL_FILE).unlink()
    damage(workdir / "state-6.pt")
    return r


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__)
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumes(tmp_path, logged, damage):
    r = finished_then_damaged(tmp_path, damage)
    one_run(r, tmp_path)
    (warning,) = warnings(logged)
    assert "state-6.pt" in warning and REASON[damage] in warning and "resuming from state-4.pt" in warning
    assert "\n" not in warning
    assert any("at step 4" in m for m in logged), logged
    assert (tmp_path / MODEL_FILE).is_file(), "training went on and finished"
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    path, saved = manager.latest_good_state(tmp_path)
    assert path.name == "state-6.pt" and saved["step"] == 6, "step 6 written again, and good this time"


def test_a_checkpoint_cut_short_is_set_aside_and_the_one_before_resumes(tmp_path, logged):
    r = finished_then_damaged(tmp_path, no_checksum)
    (tmp_path / ".state-6.pt.sha256.k1ll3d0n.tmp").write_text("")  # the checksum's write, killed
    one_run(r, tmp_path)
    assert any("resuming from state-4.pt" in w for w in warnings(logged))
    (kept,) = tmp_path.glob("previous-*")
    assert sorted(p.name for p in kept.iterdir()) == ["state-6.pt"]  # set aside, not deleted
    assert not list(tmp_path.glob(".*.tmp")) and (tmp_path / MODEL_FILE).is_file()


def test_a_first_checkpoint_cut_short_starts_over_with_one_line(tmp_path, logged):
    r = recipe("schedule.steps=6", "run.ckpt_every=4")
    one_run(r, tmp_path)
    for name in ("state-6.pt", "state-6.pt.sha256", MODEL_FILE, "summary.json"):
        (tmp_path / name).unlink()  # the run as it was at step 4 ...
    no_checksum(tmp_path / "state-4.pt")  # ... killed between its first checkpoint and that one's checksum
    one_run(r, tmp_path)  # the same command: no refusal, no --no-resume needed
    (warning,) = warnings(logged)
    assert "state-4.pt" in warning and "starting at step 0" in warning and "\n" not in warning
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert list(tmp_path.glob("previous-*/state-4.pt")) and (tmp_path / MODEL_FILE).is_file()


def test_resume_after_a_fallback_ends_bit_identical_to_an_uninterrupted_run(tmp_path):
    r = finished_then_damaged(tmp_path, flipped_bytes)
    one_run(r, tmp_path)
    straight, _ = load_weights(tmp_path / "straight.safetensors")
    resumed, _ = load_weights(tmp_path / MODEL_FILE)
    assert sorted(straight) == sorted(resumed)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "dropout 0: every bit the same"


def test_no_usable_checkpoint_is_one_line_naming_the_files(tmp_path):
    r = finished_then_damaged(tmp_path, flipped_bytes)
    missing_keys(tmp_path / "state-4.pt")
    with pytest.raises(CheckpointError) as err:
        one_run(r, tmp_path)
    message = str(err.value)
    assert "state-6.pt" in message and "state-4.pt" in message and "--no-resume starts over" in message
    assert "\n" not in message and err.value.exit_code == 2


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_only_the_newest_keep_checkpoints_remain(tmp_path, keep):
    one_run(recipe("schedule.steps=5", "run.ckpt_every=1", f"run.keep_checkpoints={keep}"), tmp_path)
    steps = range(5 - keep + 1, 6)
    assert sorted(p.name for p in tmp_path.glob("state*")) == sorted(
        [f"state-{s}.pt" for s in steps] + [f"state-{s}.pt.sha256" for s in steps])
    for s in steps:  # `sha256sum -c state-5.pt.sha256` checks one by hand
        path = tmp_path / f"state-{s}.pt"
        assert files.checksum_path(path).read_text() == f"{files.sha256_of(path)}  {path.name}\n"


def test_remove_stale_temps_removes_killed_writes_and_nothing_else(tmp_path):
    ours = [tmp_path / ".state-3.pt.abcd_123.tmp", tmp_path / ".model.safetensors.x9y8z7w6.tmp"]
    # as atomic_path makes them
    fd, made = tempfile.mkstemp(prefix=".state-4.pt.", suffix=".tmp", dir=tmp_path)
    os.close(fd)
    ours.append(tmp_path / os.path.basename(made))
    others = [tmp_path / n for n in (".hidden.tmp", "notes.tmp", ".state.pt.abc.tmp", ".x.ABCDEFGH.tmp",
                                     ".state-3.pt.abcd1234.tmp.keep", "state-3.pt", ".x.abcdefgh.tmpx")]
    (tmp_path / "sub").mkdir()
    others.append(tmp_path / "sub" / ".a.abcdefgh.tmp")
    for path in ours + others:
        path.write_text("x")
    (tmp_path / ".d.abcdefgh.tmp").mkdir()
    (tmp_path / ".link.abcdefgh.tmp").symlink_to(tmp_path / "state-3.pt")

    assert sorted(files.remove_stale_temps(tmp_path)) == sorted(ours)
    assert not any(p.exists() for p in ours)
    assert all(p.exists() for p in others), "only atomic_path's own temporaries"
    assert (tmp_path / ".d.abcdefgh.tmp").is_dir() and (tmp_path / ".link.abcdefgh.tmp").is_symlink()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664)])
def test_outputs_have_the_modes_the_umask_allows(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert files.current_umask() == umask
        one_run(recipe("schedule.steps=2", "run.ckpt_every=1"), tmp_path)
        assert files.current_umask() == umask, "read, not changed"
    finally:
        os.umask(old)
    outputs = [p for p in tmp_path.iterdir() if p.is_file()]
    assert {"recipe.yaml", "metrics.jsonl", "summary.json", "model.safetensors", "state-2.pt",
            "state-2.pt.sha256"} <= {p.name for p in outputs}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in outputs} == {p.name: oct(mode) for p in outputs}


def test_writes_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or real_replace(a, b))
    files.write_text(tmp_path / "a.txt", "one")
    assert events == ["fsync", "replace", "fsync"], "the file's bytes, then the rename, then the directory"


def test_a_torn_last_metrics_line_is_dropped_and_the_resumed_file_has_each_step_once(tmp_path, logged):
    r = recipe("schedule.steps=6", "run.ckpt_every=4")  # checkpoints at 4 and 6
    one_run(r, tmp_path)
    for path in state.state_files(tmp_path):  # killed while writing step 6's row: no checkpoint of it yet
        if "state-6" in path.name:
            path.unlink()
    (tmp_path / MODEL_FILE).unlink()
    text = (tmp_path / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text[: len(text) - 20])

    one_run(r, tmp_path)
    assert any("torn last line 6" in w for w in warnings(logged)), logged
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_metrics_line_before_the_last_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "tr\n{"step": 3}\n')
    with pytest.raises(TrainingError, match="line 2 is not JSON"):
        MetricsLog(path, resume_step=3)


def test_only_state_step_checkpoints_resume_and_a_key_added_since_counts_as_its_default(tmp_path):
    """A `state.pt` without a checksum is no checkpoint. A checkpoint written before vitcli gained a
    key (the augmentation keys of issue 26, here a whole section) trained with that key's default:
    it resumes when the recipe keeps the default, and is refused, naming the key, when the recipe
    sets another value."""
    r, one = recipe("schedule.steps=6"), Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    torch.save({"step": 3, "model": {}, "optimizer": {}, "rng": [], "recipe": to_dict(r)},
               tmp_path / "state.pt")
    assert state.checkpoints(tmp_path) == []
    with pytest.raises(RecipeError, match="--resume: no checkpoint"):
        manager.resume_point(r, tmp_path, one, resume=True)
    saved = to_dict(r)
    del saved["mpp"], saved["data"]["cutmix_alpha"]
    state.save_state(state.checkpoint_path(tmp_path, 3),
                     {"step": 3, "model": {}, "optimizer": {}, "rng": [], "recipe": saved})
    assert manager.resume_point(r, tmp_path, one)[1]["step"] == 3
    with pytest.raises(RecipeError, match=r"different recipe \(data\.cutmix_alpha: 0\.0 there, 1\.0 now"):
        manager.resume_point(recipe("schedule.steps=6", "data.cutmix_alpha=1.0"), tmp_path, one)
