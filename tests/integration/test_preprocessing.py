"""Preprocessing follows the weights: what a checkpoint says of its input (timm's pretrained_cfg,
our own recipe) is what `vit predict` and `vit finetune` feed it, and what `vit export` writes for
transformers, against each library's own pipeline on real photographs (scikit-image's samples,
written as PNG here); the user's keys win over the checkpoint, which wins over the defaults; the
fused normalisation is the formula.

Tolerances. Our resize is torchvision's on uint8 tensors (antialiased bicubic or bilinear), timm's
and transformers' PIL's: the two round apart by a level at some pixels (measured: at most 1 level on
these photos, at 32 and at 224 px), so pixels are compared within 2 levels in normalised units (2 /
255 / std). Through the tiny random ViT below those differences move probabilities by ~1e-4
(measured 1.3e-4 against timm on 4 photos); any one of mean/std, interpolation or crop taken wrong
moves them by 0.02 to 0.2, so a tolerance of 2e-3 tells the right pipeline from each wrong one, and
the tests assert that margin too.
"""

import io
import json
import re

import numpy as np
import pytest
import timm
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file
from timm.data import create_transform, resolve_data_config
from timm.models import save_for_hf

from helpers import run_vit, save_photographs
from vitcli.checkpoints.complete import complete, trained_with
from vitcli.checkpoints.weights import save_weights
from vitcli.data.augmentation.augment import Normalise, finish
from vitcli.data.augmentation.transforms import build_transform
from vitcli.data.decoding.decode import Encoded
from vitcli.models.zoo import model_spec
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig, ModelConfig

skimage_data = pytest.importorskip("skimage.data")

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket")  # 300-640 px, three of them not square
IMAGENET = {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
THEIRS = {**IMAGENET, "interpolation": "bicubic", "crop_pct": 0.875}  # DeiT's, as timm states it
OURS = {"interpolation": "bicubic", "eval_crop_pct": 0.875}  # the same, as our recipe keys say it
NUM_CLASSES, HEADS = 10, 2
TINY = ModelConfig(name="custom", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=HEADS,
                   mlp_dim=64)
PROBS = 2e-3  # see the module's docstring
FP32 = ["--set", "run.precision=fp32", "--set", f"model.num_heads={HEADS}"]  # a foreign file: heads unknown


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    save_photographs(folder, PHOTOS)
    return folder


@pytest.fixture(scope="module")
def timm_dir(tmp_path_factory):
    """(a folder timm wrote with save_for_hf, the model): a 2-block ViT at 32 px, every weight
    random, whose pretrained_cfg says ImageNet mean and std, bicubic, crop 0.875."""
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                              num_heads=HEADS, mlp_ratio=2, num_classes=NUM_CLASSES,
                              pretrained_cfg_overlay={**THEIRS, "input_size": (3, 32, 32)}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # timm zero-inits the head: its logits would hide any input
    folder = tmp_path_factory.mktemp("timm")
    save_for_hf(model, str(folder), safe_serialization=True)
    return folder, model


def _timm_probs(model, photos) -> np.ndarray:
    """timm's own inference: resolve_data_config + create_transform (PIL), softmax, in file
    order."""
    transform = create_transform(**resolve_data_config({}, model=model))
    x = torch.stack([transform(Image.open(p).convert("RGB")) for p in sorted(photos.iterdir())])
    with torch.no_grad():
        return model(x).softmax(-1).numpy()


def _predict(monkeypatch, capsys, photos, ckpt, *more) -> tuple[np.ndarray, str]:
    """(`vit predict`'s probabilities (N, K) in file order, its log)."""
    code, out, err = run_vit(monkeypatch, capsys, "predict", photos, "--ckpt", ckpt, "--top-k", NUM_CLASSES,
                             "--json", *FP32, *more)
    assert code == 0, err
    records = sorted(json.loads(out), key=lambda r: r["path"])
    probs = np.zeros((len(records), NUM_CLASSES))
    for i, record in enumerate(records):
        for guess in record["top"]:
            probs[i, guess["class_index"]] = guess["probability"]
    return probs, err


def test_predict_on_a_timm_folder_is_timms_inference(monkeypatch, capsys, photos, timm_dir):
    folder, model = timm_dir
    theirs = _timm_probs(model, photos)
    ours, log = _predict(monkeypatch, capsys, photos, folder)
    assert np.abs(ours - theirs).max() < PROBS, np.abs(ours - theirs).max()
    said = " ".join(log.split())
    assert "mean 0.485,0.456,0.406, std 0.229,0.224,0.225, interpolation bicubic, eval_crop_pct 0.875" in said
    assert "(from its config.json (timm))" in said
    # the margin: the ViT paper's [-1, 1] (what every checkpoint was fed before) is far off
    wrong, log = _predict(monkeypatch, capsys, photos, folder, "--set", "data.mean=0.5,0.5,0.5",
                          "--set", "data.std=0.5,0.5,0.5")
    assert np.abs(wrong - theirs).max() > 10 * PROBS
    assert "the recipe's mean, std over its config.json (timm)" in " ".join(log.split())


def _photo_bytes(name: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(getattr(skimage_data, name)()).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_eval_pixels_are_timms_within_two_levels(interpolation):
    """Our eval transform and normalisation against timm's eval transform, pixel by pixel, per
    setting."""
    cfg = DataConfig(**IMAGENET, interpolation=interpolation, eval_crop_pct=0.875)
    transform = create_transform(32, interpolation=interpolation, crop_pct=0.875, **IMAGENET)
    tolerance = 2 / 255 / min(IMAGENET["std"]) + 1e-6
    for name in PHOTOS:
        pixels = build_transform(cfg, 32, train=False)([Encoded(_photo_bytes(name))], None)
        ours = finish(pixels, torch.device("cpu"), normalise=Normalise(cfg.mean, cfg.std))[0]
        theirs = transform(Image.open(io.BytesIO(_photo_bytes(name))).convert("RGB"))
        assert (ours - theirs).abs().max().item() <= tolerance, name


def test_normalise_is_the_formula_and_keeps_the_papers_bits():
    x = torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(2, 3, 16, 16)
    mean, std = (torch.tensor(IMAGENET[k], dtype=torch.float64).view(1, 3, 1, 1) for k in ("mean", "std"))
    want = (x.double() / 255 - mean) / std
    got = Normalise(IMAGENET["mean"], IMAGENET["std"])(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)  # float32 of values up to 2.6
    paper = Normalise()(x)
    assert torch.equal(paper, x.float() / 127.5 - 1)  # bit for bit as before data.mean and data.std
    assert paper.min() == -1 and paper.max() == 1


def _resolved(stage, ckpt, *overrides, model_name="custom"):
    flags = {"init.checkpoint": str(ckpt)}
    more = [f"model.num_heads={HEADS}"] if model_name == "custom" else []
    return resolve(stage, None, [*more, f"model.name={model_name}", *overrides], flags, complete=complete,
                   base=trained_with).data


def test_the_users_keys_win_over_the_checkpoint_which_wins_over_the_defaults(tmp_path, timm_dir):
    folder, _ = timm_dir
    data = _resolved("predict", folder)
    assert (data.mean, data.std, data.interpolation, data.eval_crop_pct) == (*IMAGENET.values(), "bicubic",
                                                                             0.875)
    data = _resolved("predict", folder, "data.mean=0.5,0.5,0.5", "data.interpolation=bilinear")
    assert (data.mean, data.std, data.interpolation, data.eval_crop_pct) == ([0.5] * 3, IMAGENET["std"],
                                                                             "bilinear", 0.875)
    # fine-tuning takes what the weights were fed, not the eval crop (a protocol's choice)
    data = _resolved("finetune", folder, "schedule.steps=10", "schedule.warmup_steps=1")
    assert (data.mean, data.interpolation, data.eval_crop_pct) == (IMAGENET["mean"], "bicubic", 1.0)
    # a file that says nothing: the defaults, the ViT paper's [-1, 1]
    bare = tmp_path / "weights.safetensors"  # the same weights without the folder's config.json
    bare.write_bytes((folder / "model.safetensors").read_bytes())
    data = _resolved("predict", bare)
    assert (data.mean, data.std, data.interpolation, data.eval_crop_pct) == ([0.5] * 3, [0.5] * 3, "bilinear",
                                                                             1.0)


def test_a_bare_timm_file_takes_the_pretrained_cfg_of_the_named_model(tmp_path):
    """The issue's case: a DeiT-Ti file with model.name=deit_tiny_patch16_224 is fed as timm
    registers it."""
    torch.manual_seed(0)
    path = tmp_path / "deit_tiny.safetensors"
    save_file(timm.create_model("deit_tiny_patch16_224").state_dict(), str(path))  # timm's, no metadata
    data = _resolved("predict", path, model_name="deit_tiny_patch16_224")
    cfg = timm.models.get_pretrained_cfg("deit_tiny_patch16_224")
    assert data.mean == list(cfg.mean) and data.std == list(cfg.std)
    assert (data.interpolation, data.eval_crop_pct) == (cfg.interpolation, cfg.crop_pct)


def test_our_checkpoint_is_fed_as_its_recipe_says_and_an_old_one_as_the_paper(tmp_path, timm_dir):
    _, model = timm_dir
    for name, data in (("new", {**IMAGENET, **OURS}),
                       ("old", {"eval_crop_pct": 1.0})):  # before data.mean: fed [-1, 1], bilinear
        save_weights(tmp_path / f"{name}.safetensors", model.state_dict(),
                     {"model": model_spec(TINY, NUM_CLASSES), "recipe": {"data": data}})
    new, old = (_resolved("predict", tmp_path / f"{n}.safetensors") for n in ("new", "old"))
    assert (new.mean, new.std, new.interpolation, new.eval_crop_pct) == (*IMAGENET.values(), "bicubic", 0.875)
    assert (old.mean, old.std, old.interpolation) == ([0.5] * 3, [0.5] * 3, "bilinear")


def test_exports_carry_the_runs_preprocessing_to_transformers_and_timm(monkeypatch, capsys, tmp_path, photos,
                                                                        timm_dir):
    """Our checkpoint trained on ImageNet-normalised, bicubic, 0.875-cropped inputs, exported:
    transformers' own processor and classifier (AutoImageProcessor: the TimmWrapperImageProcessor our
    export names, which crops where we do; transformers' own processors floor the crop's offset)
    give vit predict's probabilities; timm's config.json states the same preprocessing."""
    transformers = pytest.importorskip("transformers")
    _, model = timm_dir
    ckpt = tmp_path / "ours.safetensors"
    save_weights(ckpt, model.state_dict(), {"model": model_spec(TINY, NUM_CLASSES),
                                            "recipe": {"data": {**IMAGENET, **OURS}}})
    for fmt in ("hf", "timm"):
        code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", fmt,
                               "--out", tmp_path / fmt)
        assert code == 0, err
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    classifier = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    images = [Image.open(p).convert("RGB") for p in sorted(photos.iterdir())]
    x = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        theirs = classifier(pixel_values=x).logits.softmax(-1).numpy()
    ours, _ = _predict(monkeypatch, capsys, photos, ckpt)
    assert np.abs(ours - theirs).max() < PROBS, np.abs(ours - theirs).max()
    stated = json.loads((tmp_path / "timm" / "config.json").read_text())["pretrained_cfg"]
    assert {k: stated[k] for k in ("mean", "std", "interpolation", "crop_pct")} == {**IMAGENET, **THEIRS}


def test_a_transformers_preprocessor_config_beside_the_weights_is_read(tmp_path, timm_dir):
    """A preprocessor_config.json transformers' BitImageProcessor writes (resample 3, shortest edge
    36, crop 32), beside timm-named weights: bicubic, its mean and std, crop 32 / 36."""
    transformers = pytest.importorskip("transformers")
    folder, _ = timm_dir
    beside = tmp_path / "beside"
    beside.mkdir()
    (beside / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    transformers.BitImageProcessor(size={"shortest_edge": 36}, crop_size={"height": 32, "width": 32},
                                   resample=3, image_mean=IMAGENET["mean"],
                                   image_std=IMAGENET["std"]).save_pretrained(beside)
    data = _resolved("predict", beside)
    assert (data.mean, data.std, data.interpolation) == (*IMAGENET.values(), "bicubic")
    assert data.eval_crop_pct == pytest.approx(32 / 36)  # the same resize: floor(32 / (32 / 36)) = 36


def test_finetune_records_the_checkpoints_preprocessing_and_says_where_it_came_from(
        monkeypatch, capsys, tmp_path, timm_dir):
    folder, _ = timm_dir
    code, out, err = run_vit(monkeypatch, capsys, "finetune", "--init", folder, "--workdir", tmp_path / "ft",
                             "model.img_size=32", f"model.num_heads={HEADS}", "schedule.steps=2",
                             "schedule.warmup_steps=1", "data.batch_size=8", "data.eval_batch_size=8",
                             "data.num_workers=0", "data.synthetic.train_size=16",
                             "data.synthetic.val_size=8", "data.synthetic.test_size=8", "run.precision=fp32",
                             "run.device=cpu")
    assert code == 0, err
    recorded = yaml.safe_load((tmp_path / "ft" / "recipe.yaml").read_text())["data"]
    assert (recorded["mean"], recorded["std"], recorded["interpolation"]) == (*IMAGENET.values(), "bicubic")
    assert recorded["eval_crop_pct"] == 1.0
    said = " ".join(re.sub("[│┃]", " ", out + err).split())  # the table's rows, unwrapped
    assert "preprocessing mean 0.485,0.456,0.406, std 0.229,0.224,0.225, interpolation bicubic (from its " \
           "config.json (timm))" in said


@pytest.mark.parametrize("override, named", [("data.mean=0.5,0.5", "data.mean"),
                                             ("data.std=0.2,0.2,0.2,0.2", "data.std"),
                                             ("data.interpolation=bicubc", "data.interpolation"),
                                             ("data.std=0,0.2,0.2", "data.std")])
def test_a_bad_preprocessing_key_is_one_line_naming_it(monkeypatch, capsys, photos, timm_dir, override,
                                                       named):
    code, _, err = run_vit(monkeypatch, capsys, "predict", photos, "--ckpt", timm_dir[0], "--set", override)
    assert code == 2 and err.startswith(f"error: {named}") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
