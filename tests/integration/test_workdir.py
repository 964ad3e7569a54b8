"""A workdir with someone's work in it: a fresh run replaces a finished one only when told, and
keeps it."""

import shutil
from pathlib import Path

import pytest

from helpers import run_vit
from vitcli.checkpoints import state, weights
from vitcli.errors import OutputError
from vitcli.recipe.resolve import resolve
from vitcli.runtime import metrics, run_files
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.runtime.workdir import RUN_OUTPUTS, set_aside
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.batch_size=32",
        "data.num_workers=0", "schedule.steps=3", "schedule.warmup_steps=1", "run.ckpt_every=1",
        "run.log_every=1"]


def recipe(*extra):
    return resolve("pretrain", None, TINY + list(extra))


def test_overwrite_keeps_the_finished_run_in_previous(tmp_path):
    one_run(recipe("run.loggers=jsonl,tensorboard"), tmp_path)
    events = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    finished = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    with pytest.raises(OutputError, match="holds a finished run"):
        one_run(recipe("run.seed=1"), tmp_path, resume=False)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == finished

    one_run(recipe("run.seed=1"), tmp_path, resume=False, overwrite=True)
    (kept,) = tmp_path.glob("previous-*")
    assert {p.name: p.read_bytes() for p in kept.iterdir() if p.is_file()} == finished, (
        "moved whole, byte for byte")
    assert (tmp_path / MODEL_FILE).read_bytes() != finished[MODEL_FILE]  # the new run's
    assert sorted(p.name for p in (kept / "tensorboard").iterdir()) == events  # tracker folders move too


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root`, by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_same_command_again_reports_the_finished_run_and_changes_no_file(monkeypatch, capsys, tmp_path):
    args = ["pretrain", "--workdir", tmp_path / "w", *TINY, "data.synthetic.train_size=96", "--json"]
    code, first, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    finished = tree(tmp_path / "w")
    code, again, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    assert again == first  # --json: the summary it wrote, with its train/loss, img_per_s and mfu
    assert "finished at step 3: nothing to do" in " ".join(err.split())
    assert tree(tmp_path / "w") == finished


def test_a_changed_recipe_in_a_finished_workdir_gets_advice_that_works(monkeypatch, capsys, tmp_path):
    one_run(recipe(), tmp_path / "w")
    args = ["pretrain", "--workdir", tmp_path / "w", *TINY, "optim.lr=0.01"]
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 2 and "optim.lr" in err and "--overwrite" in err and "--no-resume" not in err
    code, _, err = run_vit(monkeypatch, capsys, *args, "--overwrite")  # the advice, followed
    assert code == 0, err


def test_no_resume_sets_an_unfinished_run_aside_and_starts_at_step_0(tmp_path):
    one_run(recipe(), tmp_path)
    (tmp_path / MODEL_FILE).unlink()  # as if killed before the end: only checkpoints remain
    old = sorted(p.name for p in state.state_files(tmp_path))
    one_run(recipe(), tmp_path, resume=False)
    (kept,) = tmp_path.glob("previous-*")
    assert old and sorted(p.name for p in kept.iterdir() if p.name.startswith("state")) == old
    rows = [r for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if "train/loss" in r]
    assert len(rows) == 3, "a fresh run logs from step 1"


def test_overwrite_alone_starts_over_where_the_run_could_resume(monkeypatch, capsys, tmp_path):
    # the same command with --overwrite: a fresh run from step 0, not a resume of the finished one
    one_run(recipe(), tmp_path)
    one_run(recipe(), tmp_path, overwrite=True)
    (kept,) = tmp_path.glob("previous-*")
    assert (kept / MODEL_FILE).is_file()
    rows = [r for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if "train/loss" in r]
    assert len(rows) == 3, "trained again from step 1"
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--workdir", tmp_path, "--overwrite",
                           "--resume", *TINY)
    assert code == 2 and "--overwrite starts over and --resume continues the run there" in err
    # the dry run refuses the pair with the same line
    for command in (["pretrain"], ["finetune", "schedule.steps=10", "schedule.warmup_steps=1"]):
        code, _, dry = run_vit(monkeypatch, capsys, *command, "--dry-run", "--overwrite", "--resume", *TINY)
        assert code == 2 and dry.strip() == err.strip().splitlines()[-1]


def test_killed_writes_are_cleared_at_start_and_nothing_else(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    stale = tmp_path / ".state-2.pt.abcd1234.tmp"
    stale.write_bytes(b"half a checkpoint")
    mine = tmp_path / "notes.tmp"
    mine.write_text("the user's")
    one_run(recipe(), tmp_path)
    assert not stale.exists() and mine.read_text() == "the user's"


def test_two_replacements_in_the_same_second_keep_both(tmp_path):
    kept = []
    for content in ("first", "second"):
        (tmp_path / MODEL_FILE).write_text(content)
        kept.append(set_aside(tmp_path))
    assert kept[0] != kept[1]
    assert [(k / MODEL_FILE).read_text() for k in kept] == ["first", "second"]


def test_too_little_free_space_is_named_before_anything_is_written(tmp_path, monkeypatch):
    """The estimate is (keep_checkpoints + 1) states of weights and Adam's two slots, plus the
    model."""
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(OutputError, match=r"needs about .* GiB, but only 0.00 GiB is free"):
        one_run(recipe(), tmp_path / "w")
    assert not (tmp_path / "w").exists()


def test_run_file_names_are_written_once_in_run_files():
    """Every file name of a run directory is a run_files constant: no other module spells it, or
    defines it."""
    names = {v for k, v in vars(run_files).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert {"recipe.yaml", "metrics.jsonl", "summary.json", "model.safetensors", "curves.png", "sweep.json",
            "vtab.json", "results.json"} <= names
    src = Path(run_files.__file__).parents[1]
    for path in src.rglob("*.py"):
        if path.name != "run_files.py":
            text = path.read_text()
            assert not [n for n in names if f'"{n}"' in text or f"'{n}'" in text], path
    assert not hasattr(weights, "MODEL_FILE") and not hasattr(metrics, "METRICS_FILE")
    assert set(RUN_OUTPUTS) >= {run_files.MODEL_FILE, run_files.METRICS_FILE, run_files.WANDB_ID_FILE}
