"""Ctrl-C and SIGTERM mean the same on every command and at every moment: exit 130 (143), one line
saying what is kept, nothing half-written, and never success (Typer turned Ctrl-C into a return
value that `vit` exited 0 on, so `vit prepare-data ... && vit pretrain ...` carried on). The
training loop's own stop, with its checkpoint, is test_signals.py's."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, run_vit
from vitcli.cli import commands as cli_commands
from vitcli.errors import Terminated
from vitcli.recipe.resolve import resolve
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.batch_size=32",
        "data.num_workers=0", "schedule.warmup_steps=1", "fewshot.every=0", "schedule.epochs=0"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(REPO / "src")}


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    """A finished tiny run, and an image file, for the commands that read a checkpoint."""
    root = tmp_path_factory.mktemp("done")
    one_run(resolve("pretrain", None, [*TINY, "schedule.steps=2"]), root / "run")
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 10, 10)).save(root / "red.png")
    return root


def commands(root: Path) -> dict:
    """Each command as a user runs it, with the stage function it hands over to (module, name)."""
    run, out = root / "run", root / "out"
    return {
        "pretrain": (["pretrain", "--workdir", out, *TINY, "schedule.steps=2"], ("run", "one_run")),
        "finetune": (["finetune", "--init", run, "--workdir", out, *TINY, "schedule.steps=2"],
                     ("finetune", "finetune")),
        "eval-fewshot": (["eval-fewshot", "--ckpt", run, "--tasks", "synthetic", "--workdir", out,
                          "data.num_workers=0"], ("fewshot", "eval_fewshot")),
        "evaluate": (["evaluate", "--ckpt", run, "--workdir", out], ("evaluate", "evaluate")),
        "predict": (["predict", root / "red.png", "--ckpt", run], ("predict", "predict")),
        "resize-posemb": (["resize-posemb", "--ckpt", run, "--res", "64", "--out", out / "r.safetensors"],
                          ("resize", "run_resize")),
        "inspect": (["inspect", "--ckpt", run, "--out", out, "--images", "4"], ("inspect", "inspect")),
        "plot": (["plot", run, "--out", out / "c.png"], ("plot", "plot")),
        "prepare-data": (["prepare-data", "synthetic", "--out", out], ("prepare", "prepare_data")),
        "export": (["export", "--ckpt", run, "--format", "timm", "--out", out], ("export", "export")),
    }


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("command", sorted(commands(Path("."))))
@pytest.mark.parametrize("signal_name, code", [("Ctrl-C", 130), ("SIGTERM", 143)])
def test_a_stop_inside_any_command_is_one_line_and_its_exit_code(command, signal_name, code, done,
                                                                 monkeypatch, capsys):
    args, (module, name) = commands(done)[command]
    stop = KeyboardInterrupt if signal_name == "Ctrl-C" else Terminated

    def stopped(*a, **k):
        raise stop

    monkeypatch.setattr(f"vitcli.stages.{module}.{name}", stopped)
    before = tree(done)
    exit_code, _, err = run_vit(monkeypatch, capsys, *args)
    assert exit_code == code, (exit_code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert ("interrupted (Ctrl-C)" if code == 130 else "terminated (SIGTERM)") in lines[0]
    assert "what was finished is kept, nothing half-written is left" in lines[0]
    assert tree(done) == before


def test_a_stop_while_the_recipe_is_read_is_the_same(done, monkeypatch, capsys):
    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_commands, "resolve_recipe", stopped)
    code, _, err = run_vit(monkeypatch, capsys, *commands(done)["pretrain"][0])
    assert code == 130 and "interrupted (Ctrl-C)" in err


def launched(args: list) -> subprocess.Popen:
    """`vit ARGS` in a session of its own, so that a signal reaches its whole group as a terminal's
    does."""
    return subprocess.Popen([sys.executable, "-m", "vitcli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)


@pytest.mark.parametrize("moment", [0.3, 4.0])
@pytest.mark.parametrize("command", ["prepare-data", "eval-fewshot"])
def test_a_real_ctrl_c_at_start_up_or_mid_write_leaves_nothing_half_written(done, tmp_path, command, moment):
    """SIGINT to the process group at start-up (a Ctrl-C inside an import once came out as
    ModuleNotFoundError, exit 1) and mid-write (copying or extracting 20,000 built-in images takes
    longer than 4 s here): no --out folder or temporary one beside it; a feature cache holds only
    whole files."""
    out = tmp_path / "out"
    args = (["prepare-data", "synthetic", "--out", out, "data.synthetic.train_size=20000"]
            if command == "prepare-data" else
            ["eval-fewshot", "--ckpt", done / "run", "--tasks", "synthetic", "--workdir", out,
             "data.synthetic.train_size=20000", "data.num_workers=0"])
    proc = launched(args)
    time.sleep(moment)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted (Ctrl-C)" in err and "Traceback" not in err
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    if command == "prepare-data":
        assert left == []  # no --out, no temporary folder beside it
    else:
        assert all(not name.endswith(".tmp") and "results" not in name for name in left), left
