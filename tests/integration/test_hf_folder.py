"""`vit predict --ckpt DIR` on a folder transformers' ViT wrote gives transformers' own pipeline's
probabilities on real photographs (scikit-image's samples, square and not, one greyscale), with the
class names of its id2label; a config timm's ViT cannot be is one line, exit 2; and what `vit export
--format hf` writes is read back as the same network.

The folder's preprocessor is ViTImageProcessor's (google/vit-*'s): both sides squashed to the
model's size, bilinear, [-1, 1], which the reader turns into data.eval_crop_mode squash.
torchvision's antialiased bilinear resize of uint8 is PIL's, so the pixels agree to float rounding
(1e-5 of a level, measured), and the probabilities are held to 1e-5 at fp32 (run.precision=fp32:
`auto` may run bf16 on a CPU, 1e-2 apart); with the shorter side resized and cropped instead, the
two non-square photos differed by 0.17.
"""

import json

import pytest
import torch

from helpers import run_vit, save_photographs, tiny_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.models.zoo import model_spec
from vitcli.recipe.schema import ModelConfig

transformers = pytest.importorskip("transformers")
skimage_data = pytest.importorskip("skimage.data")
Image = pytest.importorskip("PIL.Image")

NAMES = {0: "cat", 1: "rocket", 2: "coffee"}
PHOTOS = ("astronaut", "chelsea", "coffee", "camera")  # 512x512, 451x300, 600x400, 512x512 greyscale
FP32 = ("--set", "run.precision=fp32")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return save_photographs(tmp_path_factory.mktemp("photos"), PHOTOS)


def _folder(path, **config):
    """A tiny ViTForImageClassification with random weights (its head scaled up, so the
    probabilities are far from uniform) and google/vit-*'s image processor, as save_pretrained
    writes them."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=32, patch_size=8, id2label=NAMES,
                                 label2id={v: k for k, v in NAMES.items()}, **config)
    model = transformers.ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0, 2)
    model.save_pretrained(path)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    return path


def _predict(monkeypatch, capsys, ckpt, photos, *more) -> tuple[dict[str, dict[str, float]], str]:
    """({photo path: {class name: probability}} as `vit predict --json` prints them, the log)."""
    code, out, err = run_vit(monkeypatch, capsys, "predict", "--ckpt", ckpt, *photos, "--json",
                             "--top-k", "3", *more)
    assert code == 0, err
    return {r["path"]: {t["class_name"]: t["probability"] for t in r["top"]} for r in json.loads(out)}, err


@pytest.mark.parametrize("eps", [1e-12, 1e-6])
def test_predict_gives_the_transformers_pipelines_probabilities(monkeypatch, capsys, tmp_path, photos, eps):
    folder = _folder(tmp_path / "hf", layer_norm_eps=eps)
    ours, log = _predict(monkeypatch, capsys, folder, photos, *FP32)
    pipe = transformers.pipeline("image-classification", model=str(folder), top_k=3)
    for photo in photos:
        theirs = {g["label"]: g["score"] for g in pipe(str(photo))}
        assert set(ours[str(photo)]) == set(NAMES.values())  # id2label's names
        diff = max(abs(ours[str(photo)][k] - theirs[k]) for k in theirs)
        assert diff < 1e-5, (photo.name, diff)
    assert f"LayerNorm eps {eps:g} (layer_norm_eps" in " ".join(log.split())
    assert "eval_crop_mode squash" in " ".join(log.split())  # what ViTImageProcessor does, said


def test_a_config_timms_vit_cannot_be_is_one_line_naming_the_file_and_key(monkeypatch, capsys, tmp_path,
                                                                          photos):
    folder = _folder(tmp_path / "hf", hidden_act="relu")
    capsys.readouterr()  # transformers' own progress bars
    code, _, err = run_vit(monkeypatch, capsys, "predict", "--ckpt", folder, photos[0])
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f'{folder / "config.json"}: hidden_act "relu": timm\'s ViT has exact GELU' in " ".join(err.split())


def test_an_hf_export_is_read_back_as_the_same_network(monkeypatch, capsys, tmp_path, photos):
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
    model = tiny_vit(num_classes=3)
    with torch.no_grad():
        model.head.weight.normal_(0, 2)
    meta = {**model_spec(cfg, 3), "class_names": list(NAMES.values())}
    save_weights(tmp_path / "model.safetensors", model.state_dict(), {"model": meta, "recipe": {}})
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", tmp_path / "model.safetensors",
                           "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    ours, _ = _predict(monkeypatch, capsys, tmp_path / "model.safetensors", photos, *FP32)
    back, _ = _predict(monkeypatch, capsys, tmp_path / "hf", photos, *FP32)
    assert ours.keys() == back.keys()
    for photo, probs in ours.items():
        assert probs == back[photo]  # the same weights, eps and preprocessing: identical


def test_a_sharded_folder_predicts_as_the_whole_one(monkeypatch, capsys, tmp_path, photos):
    """save_pretrained(max_shard_size=...) splits the weights over an index and its shards."""
    whole = _folder(tmp_path / "whole")
    transformers.ViTForImageClassification.from_pretrained(whole).save_pretrained(
        tmp_path / "sharded", max_shard_size="20KB")
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    ours, _ = _predict(monkeypatch, capsys, whole, photos[:1], *FP32)
    sharded, _ = _predict(monkeypatch, capsys, tmp_path / "sharded", photos[:1], *FP32)
    assert sharded == ours
