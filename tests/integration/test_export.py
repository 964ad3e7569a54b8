"""`vit export`: each folder is loaded back by the library it is for (transformers, onnxruntime,
timm) and gives our logits; what a format cannot hold is one line, exit 2, nothing written. Also
`python -m vitcli` and `vit --version`, the shell conventions of the same issue.

Tolerances: logits within 1e-4 (float32 through a different attention implementation); the
transformers processor's pixels within 1e-6 of our eval transform on an image already at the model's
size (no resampling: only x / 255 and the normalisation differ in rounding), and within 2 / 255 (one
8-bit level in [-1, 1] units) on resized ones, square or not (the processor, timm's eval transform,
resizes with PIL, ours with torchvision's tensor resize: they round a level apart). On photographs
whose crop margin is 3 mod 4 (where transformers' own centre crop, flooring the offset, lands a
pixel short of torchvision's, ours and timm's), two levels of the normalised scale (bicubic rounds
two apart at some pixels); the processor the export wrote before, BitImageProcessor, is shown
to miss that by tens of levels.
"""

import dataclasses
import importlib.util
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from helpers import REPO, run_vit, tiny_vit
from vitcli.checkpoints.export_hf import check_hf
from vitcli.checkpoints.export_timm import check_timm
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.weights import save_weights
from vitcli.cli.options import ExportFormat
from vitcli.data.augmentation.augment import Normalise, finish
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.decoding.decode import Encoded
from vitcli.errors import CheckpointError
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.schema import DataConfig, ModelConfig
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


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


LEVEL = 2 / 255 + 1e-6  # one 8-bit level in [-1, 1] units, plus float32 rounding


def _our_eval(img: Image.Image, cfg: DataConfig) -> torch.Tensor:
    """Our eval preprocessing of one image at 32 px, as a loader worker and the model's device run
    it."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    pixels = build_transform(cfg, 32, train=False)([Encoded(buf.getvalue())], None)
    return finish(pixels, torch.device("cpu"), normalise=Normalise(cfg.mean, cfg.std))[0]


# (H, W): at the model's size, larger, and non-square both ways (40 x 56 -> 32 x 44, margins 6)
@pytest.mark.parametrize("shape, tolerance", [((32, 32), 1e-6), ((48, 48), LEVEL), ((40, 56), LEVEL),
                                              ((56, 40), LEVEL)])
def test_hf_processor_gives_our_eval_pixels(monkeypatch, capsys, tmp_path, ours, shape, tolerance):
    _export(monkeypatch, capsys, ours[0], "hf", tmp_path / "hf")
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    img = _image(*shape)
    theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]  # (3, 32, 32)
    mine = _our_eval(img, DataConfig())  # (3, 32, 32)
    assert theirs.shape == mine.shape
    diff = (theirs - mine).abs().max().item()
    assert diff <= tolerance, diff


def test_hf_processor_follows_the_runs_eval_crop(monkeypatch, capsys, tmp_path):
    """data.eval_crop_pct 0.875 in the checkpoint's recipe: shorter side floor(32 / 0.875) = 36,
    crop 32."""
    model = tiny_vit(num_classes=3)
    meta = {**model_spec(TINY, 3), "class_names": NAMES}
    save_weights(tmp_path / "m.safetensors", model.state_dict(),
                 {"model": meta, "recipe": {"data": {"eval_crop_pct": 0.875}}})
    _export(monkeypatch, capsys, tmp_path / "m.safetensors", "hf", tmp_path / "hf")
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    img = _image(48, 64)
    theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]
    mine = _our_eval(img, DataConfig(eval_crop_pct=0.875))
    assert (theirs - mine).abs().max().item() <= LEVEL


def test_hf_processor_squashes_as_the_run_did(monkeypatch, capsys, tmp_path):
    """data.eval_crop_mode squash, 0.875: both sides to 36 (aspect not kept), crop 32; margins 4,
    where transformers' floored crop offset is ours, so BitImageProcessor, whose torchvision
    backend resizes as ours does: the same pixels. Read back the same."""
    model = tiny_vit(num_classes=3)
    meta = {**model_spec(TINY, 3), "class_names": NAMES}
    data = {"eval_crop_pct": 0.875, "eval_crop_mode": "squash"}
    save_weights(tmp_path / "m.safetensors", model.state_dict(), {"model": meta, "recipe": {"data": data}})
    _export(monkeypatch, capsys, tmp_path / "m.safetensors", "hf", tmp_path / "hf")
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    img = _image(40, 64)
    theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]
    assert type(processor).__name__ == "BitImageProcessor"
    assert (theirs - _our_eval(img, DataConfig(**data))).abs().max().item() <= 1e-6
    centre = _our_eval(img, DataConfig(eval_crop_pct=0.875))
    assert (theirs - centre).abs().max().item() > 0.1
    said = read_checkpoint(str(tmp_path / "hf")).pretrained_cfg
    assert (said["crop_mode"], said["crop_pct"]) == ("squash", 32 / 36)


@pytest.mark.parametrize("data, processor, warned", [
    # squash, floor(32 / 0.9) = 35: margins 3, transformers' crop a pixel short: timm's processor
    ({"eval_crop_mode": "squash", "eval_crop_pct": 0.9}, "TimmWrapperImageProcessor", False),
    # nearest: PIL's (timm's processor) is not torchvision's nearest-exact; Bit's crop floors
    ({"interpolation": "nearest"}, "BitImageProcessor", True)])
def test_the_processor_is_chosen_by_where_each_gives_our_pixels(monkeypatch, capsys, tmp_path,
                                                                 data, processor, warned):
    """The export says in one line, before writing, the setting no transformers processor gives
    our pixels for, and the model card says it too."""
    model = tiny_vit(num_classes=3)
    save_weights(tmp_path / "m.safetensors", model.state_dict(),
                 {"model": {**model_spec(TINY, 3), "class_names": NAMES}, "recipe": {"data": data}})
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", tmp_path / "m.safetensors",
                           "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    said = [line for line in err.splitlines() if "warning:" in line]
    assert len(said) == warned and all("data.interpolation nearest" in line for line in said), err
    loaded = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    assert type(loaded).__name__ == processor
    card = (tmp_path / "hf" / "README.md").read_text()
    assert ("3 mod 4" in card) == warned
    img = _image(40, 56)  # squashed to 35 x 35, cropped at 2 (ours) where transformers' crops at 1
    theirs = loaded(images=img, return_tensors="pt")["pixel_values"][0]
    if not warned:
        assert (theirs - _our_eval(img, DataConfig(**data))).abs().max().item() <= LEVEL


def _before(data: DataConfig) -> dict:
    """The BitImageProcessor config `vit export --format hf` wrote before TimmWrapperImageProcessor
    (transformers' centre crop floors the offset)."""
    return {"size": {"shortest_edge": math.floor(32 / data.eval_crop_pct)}, "do_center_crop": True,
            "crop_size": {"height": 32, "width": 32},
            "resample": {"bilinear": 2, "bicubic": 3}[data.interpolation],
            "image_mean": list(data.mean), "image_std": list(data.std)}


DEIT = DataConfig(interpolation="bicubic", eval_crop_pct=0.875, mean=[0.485, 0.456, 0.406],
                  std=[0.229, 0.224, 0.225])


@pytest.mark.parametrize("data", [DataConfig(), DEIT])
def test_hf_processor_crops_photographs_where_we_do_when_the_margin_is_odd(monkeypatch, capsys, tmp_path,
                                                                           data):
    """scikit-image's photographs at 640 x 427 (the issue's) and 660 x 427, both ways: at 32 px the
    longer side is 47 and 49 (shorter side 32), 53 and 55 (36, crop 0.875), margins 15 and 23 among
    them, 3 mod 4: transformers' centre crop floors half of it (7, 11), torchvision's rounds it half
    to even (8, 12)."""
    skimage_data = pytest.importorskip("skimage.data")
    model = tiny_vit(num_classes=3)
    recipe = {"data": {k: getattr(data, k) for k in ("interpolation", "eval_crop_pct", "mean", "std")}}
    save_weights(tmp_path / "m.safetensors", model.state_dict(),
                 {"model": {**model_spec(TINY, 3), "class_names": NAMES}, "recipe": recipe})
    _export(monkeypatch, capsys, tmp_path / "m.safetensors", "hf", tmp_path / "hf")
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    before = transformers.BitImageProcessor(**_before(data))
    levels = 2 / 255 / min(data.std) + 1e-6  # two 8-bit levels, normalised
    worst, worst_before = 0.0, 0.0
    for name in ("astronaut", "chelsea", "coffee", "rocket"):
        photo = Image.fromarray(getattr(skimage_data, name)()).convert("RGB")
        for size in ((640, 427), (427, 640), (660, 427), (427, 660)):
            img = photo.resize(size, Image.BICUBIC)
            mine = _our_eval(img, data)
            theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]
            old = before(images=img, return_tensors="pt")["pixel_values"][0]
            worst = max(worst, (theirs - mine).abs().max().item())
            worst_before = max(worst_before, (old - mine).abs().max().item())
    assert type(processor).__name__ == "TimmWrapperImageProcessor"
    assert worst <= levels, worst * 255 * min(data.std)
    assert worst_before > 10 * levels, worst_before * 255 * min(data.std)


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
