"""`vit export --format hf`'s image processor, loaded by transformers' AutoImageProcessor, against
our eval transform, pixel by pixel.

Tolerances: within 1e-6 on an image already at the model's size (no resampling: only x / 255 and
the normalisation differ in rounding), and where BitImageProcessor is written (a squash whose crop
margin is not 3 mod 4: its torchvision backend resizes as ours does); within 2 / 255 (one 8-bit
level in [-1, 1] units) on resized ones, square or not (TimmWrapperImageProcessor, timm's eval
transform, resizes with PIL, ours with torchvision's tensor resize: they round a level apart). On
photographs whose crop margin is 3 mod 4 (where transformers' own centre crop, flooring the offset,
lands a pixel short of torchvision's, ours and timm's), two levels of the normalised scale (bicubic
rounds two apart at some pixels); the processor the export wrote before, BitImageProcessor, is
shown to miss that by tens of levels.
"""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import run_vit, tiny_vit
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.weights import save_weights
from vitcli.data.augmentation.augment import Normalise, finish
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.decoding.decode import Encoded
from vitcli.models.zoo import model_spec
from vitcli.recipe.schema import DataConfig, ModelConfig

transformers = pytest.importorskip("transformers")

NAMES = ["cat", "dog", "bird"]
TINY = ModelConfig(name="custom", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                   mlp_dim=64)


@pytest.fixture
def ours(tmp_path):
    """Our checkpoint of a tiny ViT whose recipe evaluates uncropped, its classes named."""
    meta = {**model_spec(TINY, 3), "class_names": NAMES}
    save_weights(tmp_path / "model.safetensors", tiny_vit(num_classes=3).state_dict(),
                 {"model": meta, "recipe": {"data": {"eval_crop_pct": 1.0}}})
    return tmp_path / "model.safetensors"


def _export(monkeypatch, capsys, ckpt, fmt, out, *more):
    code, stdout, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", fmt,
                                "--out", out, *more)
    assert code == 0, err
    return stdout


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
    _export(monkeypatch, capsys, ours, "hf", tmp_path / "hf")
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
def test_hf_processor_crops_photographs_where_we_do_when_the_margin_is_odd(monkeypatch, capsys,
                                                                           tmp_path, data):
    """scikit-image's photographs at 640 x 427 (the issue's) and 660 x 427, both ways: at 32 px the
    longer side is 47 and 49 (shorter side 32), 53 and 55 (36, crop 0.875), margins 15 and 23 among
    them, 3 mod 4: transformers' centre crop floors half of it (7, 11), torchvision's rounds it half
    to even (8, 12)."""
    skimage_data = pytest.importorskip("skimage.data")
    model = tiny_vit(num_classes=3)
    keys = ("interpolation", "eval_crop_pct", "mean", "std")
    recipe = {"data": {k: getattr(data, k) for k in keys}}
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
