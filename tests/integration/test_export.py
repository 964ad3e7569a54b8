"""`vit export`: each folder is loaded back by the library it is for (transformers, onnxruntime,
timm) and gives our logits; what a format cannot hold is one line, exit 2, nothing written. Also
`python -m vitcli` and `vit --version`, the shell conventions of the same issue. The hf folder's image
processor against our eval pixels: test_hf_processor.py.

Tolerances: logits within 1e-4 (float32 through a different attention implementation).
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch

from helpers import REPO, run_vit, tiny_vit
from vitcli.checkpoints.export_hf import check_hf
from vitcli.checkpoints.export_timm import check_timm
from vitcli.checkpoints.weights import save_weights
from vitcli.cli.options import ExportFormat
from vitcli.errors import CheckpointError
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.schema import ModelConfig
from vitcli.stages.export import FILES

transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

NAMES = ["cat", "dog", "bird"]
TINY = ModelConfig(name="custom", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)


def _save(path, model, cfg: ModelConfig, num_classes: int, names=NAMES):
    """Our checkpoint of `model`, its metadata holding the head's class names
    (model.class_names)."""
    meta = {**model_spec(cfg, num_classes), "class_names": names}
    save_weights(path, model.state_dict(), {"model": meta, "recipe": {"data": {"eval_crop_pct": 1.0}}})
    return path


@pytest.fixture
def ours(tmp_path):
    """(checkpoint path, the timm model it holds)."""
    model = tiny_vit(num_classes=3)
    return _save(tmp_path / "model.safetensors", model, TINY, 3), model


def _export(monkeypatch, capsys, ckpt, fmt, out, *more):
    code, stdout, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", fmt, "--out", out,
                                *more)
    assert code == 0, err
    return stdout


def test_hf_export_is_our_network_in_transformers(monkeypatch, capsys, tmp_path, ours):
    ckpt, model = ours
    _export(monkeypatch, capsys, ckpt, "hf", tmp_path / "hf")
    theirs = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        diff = (theirs(pixel_values=x).logits - model(x)).abs().max().item()
    assert diff < 1e-4, diff
    assert theirs.config.id2label == dict(enumerate(NAMES))
    assert theirs.config.layer_norm_eps == 1e-6 and theirs.config.hidden_act == "gelu"
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "ViTForImageClassification" in card and "3 classes" in card


def test_onnx_export_runs_in_onnxruntime_at_any_batch(monkeypatch, capsys, tmp_path, ours):
    ckpt, model = ours
    _export(monkeypatch, capsys, ckpt, "onnx", tmp_path / "onnx")
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pixel_values"]
    for batch in (1, 3):  # the batch axis is dynamic: the file was traced at another batch size
        x = torch.randn(batch, 3, 32, 32)
        (logits,) = session.run(["logits"], {"pixel_values": x.numpy()})
        with torch.no_grad():
            diff = np.abs(logits - model(x).numpy()).max()
        assert logits.shape == (batch, 3) and diff < 1e-4, diff
    about = json.loads((tmp_path / "onnx" / "preprocessing.json").read_text())
    assert about["class_names"] == NAMES and (about["size"], about["mean"], about["std"]) == (32, [0.5] * 3,
                                                                                             [0.5] * 3)


def test_timm_export_loads_through_local_dir(monkeypatch, capsys, tmp_path, ours):
    ckpt, model = ours
    _export(monkeypatch, capsys, ckpt, "timm", tmp_path / "timm")
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(theirs(x), model(x), atol=1e-6, rtol=0)
    assert theirs.pretrained_cfg["label_names"] == NAMES
    assert list(theirs.pretrained_cfg["mean"]) == [0.5] * 3


def test_a_gap_model_is_exported_to_timm_and_onnx_but_refused_by_hf(monkeypatch, capsys, tmp_path):
    cfg = dataclasses.replace(TINY, pool="gap")
    model = build_model(cfg, 3).eval()
    ckpt = _save(tmp_path / "gap.safetensors", model, cfg, 3)
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", "hf", "--out",
                           tmp_path / "hf")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "gap-pooled" in err, err
    assert not (tmp_path / "hf").exists()
    _export(monkeypatch, capsys, ckpt, "timm", tmp_path / "timm")
    theirs = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(theirs(x), model(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("change, fmt, named", [
    ({"representation_size": 16}, "hf", "pre-logits"),
    ({"representation_size": 16}, "timm", "pre-logits"),
    ({"pos_embed": "learned_2d"}, "hf", "learned_2d"),
    ({"pos_embed": "learned_2d"}, "timm", "learned_2d"),
    ({"pos_embed": "none"}, "hf", "none position embedding"),
    ({"pos_embed": "sincos_2d"}, "hf", "sincos_2d position embedding"),
])
def test_what_a_format_cannot_hold_is_one_line(monkeypatch, capsys, tmp_path, change, fmt, named):
    cfg = dataclasses.replace(TINY, **change)
    ckpt = _save(tmp_path / "m.safetensors", build_model(cfg, 3), cfg, 3)
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", fmt, "--out",
                           tmp_path / "o")
    assert code == 2 and len(err.strip().splitlines()) == 1 and named in err, err
    assert not (tmp_path / "o").exists()


def test_a_headless_checkpoint_is_refused_by_hf_and_gives_features_in_onnx(monkeypatch, capsys, tmp_path):
    """transformers would attach a random classifier to it without a word; ONNX returns its
    pre-logits."""
    model = build_model(TINY, 0).eval()
    ckpt = _save(tmp_path / "mpp.safetensors", model, TINY, 0, names=None)
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", "hf", "--out",
                           tmp_path / "o")
    assert code == 2 and "no classification head" in err, err
    _export(monkeypatch, capsys, ckpt, "onnx", tmp_path / "onnx")
    session = ort.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 3, 32, 32)
    (features,) = session.run(["features"], {"pixel_values": x.numpy()})
    with torch.no_grad():
        assert np.abs(features - model(x).numpy()).max() < 1e-4 and features.shape == (2, TINY.embed_dim)


@pytest.mark.parametrize("name, named", [("T2T-ViT-7", "Tokens-to-Token"), ("R50+ViT-B/16", "hybrid")])
def test_t2t_and_the_hybrid_are_refused_by_hf_and_timm(name, named):
    with pytest.raises(CheckpointError, match=named):
        check_hf(ModelConfig(name=name), 10, "x.safetensors")
    with pytest.raises(CheckpointError, match="timm does not build"):
        check_timm(ModelConfig(name=name), "x.safetensors")


@pytest.mark.parametrize("cfg", [ModelConfig(name="T2T-ViT-7"), ModelConfig(name="R50+ViT-B/16"),
                                 dataclasses.replace(TINY, pos_embed="learned_2d"),
                                 dataclasses.replace(TINY, representation_size=16),
                                 dataclasses.replace(TINY, pos_embed="sincos_2d")])
def test_hf_refuses_naming_only_formats_that_take_the_model(cfg):
    with pytest.raises(CheckpointError) as e:
        check_hf(cfg, 10, "x.safetensors")
    offered = str(e.value).rsplit("--format ", 1)[1].split(" or ")
    assert offered[0] == "onnx"
    for fmt in offered[1:]:  # the advice, followed: timm takes what it is offered
        assert fmt == "timm"
        check_timm(cfg, "x.safetensors")


def test_the_command_line_offers_exactly_the_formats_the_stage_writes():
    assert [f.value for f in ExportFormat] == list(FILES)


def test_bad_input_is_one_line_and_nothing_is_written(monkeypatch, capsys, tmp_path, ours):
    ckpt = ours[0]
    (tmp_path / "file").write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [
        (["--ckpt", tmp_path / "gone.safetensors", "--format", "hf", "--out", tmp_path / "a"], "not found"),
        (["--ckpt", ckpt, "--format", "tflite", "--out", tmp_path / "a"], "--format"),
        (["--ckpt", ckpt, "--format", "hf", "--out", tmp_path / "file"], "is a file"),
        (["--ckpt", ckpt, "--format", "hf", "--out", full], "not empty"),
    ]
    for args, named in cases:
        code, _, err = run_vit(monkeypatch, capsys, "export", *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and named in err, (args, err)
    assert not (tmp_path / "a").exists() and (full / "keep.txt").read_text() == "mine"


def test_overwrite_sets_the_old_folder_aside_and_dry_run_writes_nothing(monkeypatch, capsys, tmp_path, ours):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    stdout = _export(monkeypatch, capsys, ours[0], "onnx", out, "--dry-run", "--overwrite", "--json")
    assert json.loads(stdout)["dry_run"] is True and sorted(os.listdir(out)) == ["keep.txt"]
    _export(monkeypatch, capsys, ours[0], "onnx", out, "--overwrite")
    (aside,) = tmp_path.glob("out.previous-*")
    assert (aside / "keep.txt").read_text() == "mine" and (out / "model.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("ckpt, out, how", [
    ("wd", "wd", "is the folder"), ("wd", "wd/hf", "is inside the folder"),
    ("wd/model.safetensors", "wd", "holds the path"), ("wd", ".", "holds the path"),
    ("./wd/../wd", "wd", "is the folder"), ("link", "wd", "is the folder"), ("wd", "link/hf", "is inside"),
], ids=["same", "out inside", "ckpt file inside", "out holds it", "relative", "symlink", "out via symlink"])
def test_an_out_that_is_or_holds_the_checkpoint_is_refused_and_nothing_moves(monkeypatch, capsys, tmp_path,
                                                                             ckpt, out, how):
    """--overwrite would set the training workdir aside and put the export in its place (or nest it
    in the run): refused before anything is read or written, --dry-run as the run."""
    wd = tmp_path / "wd"
    wd.mkdir()
    _save(wd / "model.safetensors", tiny_vit(num_classes=3), TINY, 3)
    (wd / "recipe.yaml").write_text("stage: pretrain\n")
    (tmp_path / "link").symlink_to(wd)
    before, listing = _files(wd), sorted(os.listdir(tmp_path))
    monkeypatch.chdir(tmp_path)
    for dry in ([], ["--dry-run"]):
        code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", "timm",
                               "--out", out, "--overwrite", *dry)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and how in err and f"--out {out} " in err, err
        assert f"--ckpt {ckpt}:" in err and "-export" in err, err
    assert _files(wd) == before and sorted(os.listdir(tmp_path)) == listing


# ---------------------------------------------------------------- python -m vitcli, vit --version


def _python_m(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "vitcli", *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False)


def test_python_m_vitcli_runs_the_command_line():
    """What `torchrun -m vitcli` runs: the package's __main__ with the command's arguments."""
    done = _python_m("--help")
    assert done.returncode == 0 and "export" in done.stdout, done.stderr
    done = _python_m("pretrain", "--dry-run", "model.name=ViT-Ti/16", "schedule.steps=10",
                     "schedule.warmup_steps=1")
    assert done.returncode == 0 and "name: ViT-Ti/16" in done.stdout, done.stderr


def test_version_names_vitcli_torch_timm_and_the_device(monkeypatch, capsys):
    code, stdout, err = run_vit(monkeypatch, capsys, "--version")
    assert code == 0, err
    lines = dict(line.split(" ", 1) for line in stdout.strip().splitlines())
    # read from the installed metadata, without importing torch: no local tag such as +cu130
    assert torch.__version__.split("+")[0] == lines["torch"] and lines["timm"] == timm.__version__
    device = "cuda (" if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores"
    assert lines["device"].startswith(device)
    assert "vitcli" in lines


def test_onnx_without_its_extra_names_the_install(monkeypatch, capsys, tmp_path, ours):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else
                        real(name, *a))
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ours[0], "--format", "onnx", "--out",
                           tmp_path / "o", "--dry-run")
    assert code == 2 and "pip install 'vitcli[export]'" in err and "onnxscript" in err, err
