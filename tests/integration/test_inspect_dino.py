"""`vit inspect` on a DINO run's exported teacher draws DINO's Figure 1 (the class token's
last-layer attention per head) from the first images of the run's own validation split; other
checkpoints are inspected as before; a figure that cannot be drawn is skipped with the reason."""

import json

import pytest
import torch
from PIL import Image

from helpers import run_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import DataConfig, ModelConfig, Recipe, SyntheticConfig
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.inspect import ATTENDED, ATTENTION

TINY = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64}
DATA = DataConfig(synthetic=SyntheticConfig(train_size=8, val_size=8, test_size=8))


def exported(root, objective="dino", data=DATA, dino=None, **model):
    """A workdir holding model.safetensors as a run exports it: headless weights, the recipe and
    the model spec in the metadata (a DINO run's is its teacher's backbone)."""
    cfg = ModelConfig(**{**TINY, **model})
    recipe = to_dict(Recipe(objective=objective, model=cfg, data=data))
    recipe["dino"].update(dino or {})
    torch.manual_seed(0)
    save_weights(root / MODEL_FILE, build_model(cfg, 0).state_dict(),
                 {"recipe": recipe, "model": model_spec(cfg, 0)})
    return root


@pytest.fixture(scope="module")
def dino(tmp_path_factory):
    return exported(tmp_path_factory.mktemp("dino"))


def test_a_dino_run_gets_figure_1_and_says_so(dino, tmp_path, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", dino, "--out", tmp_path,
                             "--images", 1)
    assert code == 0, err
    assert f"wrote {tmp_path / ATTENTION}" in out
    with Image.open(tmp_path / ATTENTION) as image:
        assert image.format == "PNG" and 200 <= min(image.size) <= max(image.size) <= 2000

    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", dino / MODEL_FILE, "--out",
                             tmp_path / "json", "--images", 1, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert str(tmp_path / "json" / ATTENTION) in report["written"] and not report["skipped"]
    shown = report["dino_attention"]
    got = (shown["split"], shown["images"], shown["heads"], shown["grid"])
    assert got == ("validation", ATTENDED, 2, [4, 4])
    assert "synthetic" in shown["data"]


def test_other_checkpoints_are_inspected_as_before(tmp_path, monkeypatch, capsys):
    workdir = exported(tmp_path / "supervised", objective="supervised")
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", workdir, "--out",
                             tmp_path / "o", "--images", 1, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert not (tmp_path / "o" / ATTENTION).exists() and ATTENTION not in report["skipped"]
    # Figure 7 and its numbers
    assert report["dino_attention"] == {} and len(report["written"]) == 4


@pytest.mark.parametrize("change, why", [
    ({"pool": "gap"}, "the model has no class token (pool: gap)"),
    ({"data": DataConfig(source="/nowhere/images")},
     "the run's images cannot be read (dataset path not found: /nowhere/images)"),
    ({"data": DataConfig(val_split="", test_split="")}, "the run has no held-out split"),
    ({"dino": {"bogus": 1}},
     "{workdir}: its recipe does not read today (unknown recipe key 'dino.bogus'"),
])
def test_what_cannot_be_drawn_is_skipped_with_the_reason(tmp_path, monkeypatch, capsys, change,
                                                         why):
    workdir = exported(tmp_path / "dino", **change)
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", workdir, "--out",
                             tmp_path / "o", "--images", 1, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["skipped"][ATTENTION].startswith(why.format(workdir=workdir)), report["skipped"]
    assert not (tmp_path / "o" / ATTENTION).exists() and report["dino_attention"] == {}
    assert (tmp_path / "o" / "attention_distance.png").is_file()  # Figure 7 as for any ViT
