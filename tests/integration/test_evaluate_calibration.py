"""`vit evaluate`'s calibration, temperature scaling and test-time augmentation on a tiny timm ViT:
each number equals one computed from a plain timm forward over the split's images prepared by hand,
the plain numbers do not move when TTA and scaling are asked for, a sigmoid-loss model reports no
calibration, and bad input is one line, exit 2, with nothing written."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file
from torchvision.transforms.v2 import functional as TF

from helpers import run_vit, tiny_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.data.rows.synthetic import make_synthetic
from vitcli.evaluators.calibration import expected_calibration_error, fit_temperature
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import ModelConfig, Recipe, SyntheticConfig
from vitcli.runtime.run_files import EVALUATE_FILE, RELIABILITY_PLOT

K, TEST, TRAIN = 5, 30, 40
DATA = ["model.num_heads=2", f"data.synthetic.num_classes={K}", f"data.synthetic.test_size={TEST}",
        f"data.synthetic.train_size={TRAIN}", "data.num_workers=0", "data.eval_batch_size=16",
        "run.precision=fp32", "run.device=cpu"]
PLAIN = ("images", "top1", "top5", "loss", "per_class", "ece", "nll")


def eval_pixels(img: Image.Image, size: int) -> torch.Tensor:
    """The eval preprocessing at crop_pct 1 (as test_evaluate writes it): the shorter side to `size`
    (antialiased bilinear), centre crop, x / 127.5 - 1 -> (3, size, size)."""
    x = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)
    return TF.center_crop(TF.resize(x, [size], antialias=True), [size, size]).float() / 127.5 - 1


def split_pixels(split: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images (n, 3, 32, 32), labels (n,)) of a split of the built-in data, as the run's recipe
    makes it."""
    ds = make_synthetic(SyntheticConfig(num_classes=K, test_size=TEST, train_size=TRAIN), split)
    return torch.stack([eval_pixels(img, 32) for img in ds["image"][:n]]), torch.tensor(ds["label"][:n])


def ten_views(x: torch.Tensor) -> list[torch.Tensor]:
    """The centre and corner 28-pixel crops of x (B, 3, 32, 32), upsampled to 32, and their
    mirrors."""
    crops = [x[..., a:a + 28, b:b + 28] for a, b in ((0, 0), (0, 4), (4, 0), (4, 4), (2, 2))]
    up = [F.interpolate(c, size=(32, 32), mode="bilinear", align_corners=False) for c in crops]
    return up + [v.flip(-1) for v in up]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = tiny_vit(img_size=32, num_classes=K)
    path = tmp_path_factory.mktemp("calibration") / "timm.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


def evaluate(monkeypatch, capsys, path, workdir, *args) -> dict:
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", path, "--workdir", workdir, "--json",
                             *args, *DATA)
    assert code == 0, err
    return json.loads(out)


def test_calibration_scaling_and_tta_equal_a_hand_computation(ckpt, tmp_path, monkeypatch, capsys):
    model, path = ckpt
    plain = evaluate(monkeypatch, capsys, path, tmp_path / "plain")
    full = evaluate(monkeypatch, capsys, path, tmp_path / "full", "--tta", "flip", "--tta", "multicrop",
                    "--calibrate-on", f"train[:{TRAIN}]")
    assert {k: plain[k] for k in PLAIN} == {k: full[k] for k in PLAIN}  # identical, not close
    x, y = split_pixels("test", TEST)
    held_x, held_y = split_pixels("train", TRAIN)
    with torch.no_grad():
        logits, held_logits = model(x), model(held_x)  # (30, 5), (40, 5)
        ten = sum(model(v).softmax(-1) for v in ten_views(x)) / 10
    probs = logits.softmax(-1)
    confidence, correct = probs.max(-1).values.numpy(), (probs.argmax(-1) == y).numpy()
    assert 0.2 < confidence.mean() < 0.9  # a spread of confidences, not one bin
    assert full["ece"] == pytest.approx(expected_calibration_error(confidence, correct), abs=1e-5)
    assert full["nll"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-5)
    assert full["tta/views"] == "flip+multicrop"
    assert full["tta/top1"] == pytest.approx((ten.argmax(-1) == y).sum().item() / TEST, abs=1e-12)
    top5 = (ten.topk(5).indices == y[:, None]).any(-1).sum().item() / TEST
    assert full["tta/top5"] == pytest.approx(top5, abs=1e-12)
    temperature = fit_temperature(held_logits.numpy(), held_y.numpy())
    assert (full["ts/split"], full["ts/images"]) == (f"train[:{TRAIN}]", TRAIN)
    assert full["ts/temperature"] == pytest.approx(temperature, rel=1e-4)
    assert full["ts/nll"] == pytest.approx(F.cross_entropy(logits / temperature, y).item(), abs=1e-5)
    scaled = (logits / temperature).softmax(-1).max(-1).values.numpy()
    assert full["ts/ece"] == pytest.approx(expected_calibration_error(scaled, correct), abs=1e-5)
    assert json.loads((tmp_path / "full" / EVALUATE_FILE).read_text()) == full
    assert Image.open(tmp_path / "full" / RELIABILITY_PLOT).size == (600, 720)  # 5 x 6 in at 120 dpi
    assert full["reliability_png"] == str(tmp_path / "full" / RELIABILITY_PLOT)


def test_flip_alone_holds_the_plain_view(ckpt, tmp_path, monkeypatch, capsys):
    model, path = ckpt
    got = evaluate(monkeypatch, capsys, path, tmp_path / "flip", "--tta", "flip", "--tta", "flip")
    x, y = split_pixels("test", TEST)
    with torch.no_grad():
        two = (model(x).softmax(-1) + model(x.flip(-1)).softmax(-1)) / 2
    assert got["tta/views"] == "flip"  # a repeated view counts once
    assert got["tta/top1"] == pytest.approx((two.argmax(-1) == y).sum().item() / TEST, abs=1e-12)
    assert "ts/temperature" not in got


def test_a_sigmoid_loss_model_has_no_calibration(tmp_path, monkeypatch, capsys):
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                      head_zero_init=False)
    torch.manual_seed(1)
    model = build_model(cfg, K).eval()
    trained = Recipe(model=cfg)
    trained.optim.loss, trained.data.eval_crop_pct = "sigmoid", 1.0
    path = tmp_path / "sig.safetensors"
    save_weights(path, model.state_dict(), {"recipe": to_dict(trained), "model": model_spec(cfg, K)})
    (tmp_path / "sig").mkdir()
    (tmp_path / "sig" / RELIABILITY_PLOT).write_bytes(b"an earlier run's")  # results.json will not name it
    got = evaluate(monkeypatch, capsys, path, tmp_path / "sig", "--tta", "flip")
    x, y = split_pixels("test", TEST)
    with torch.no_grad():
        two = (model(x).sigmoid() + model(x.flip(-1)).sigmoid()) / 2  # the loss's own probabilities
    assert "ece" not in got and "nll" not in got and not (tmp_path / "sig" / RELIABILITY_PLOT).exists()
    assert got["tta/top1"] == pytest.approx((two.argmax(-1) == y).sum().item() / TEST, abs=1e-12)
    code, _, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", path, "--calibrate-on", "train",
                           "--dry-run", *DATA)
    assert code == 2 and "temperature scaling fits a softmax" in err


@pytest.mark.parametrize("args, message", [
    (["--tta", "flop"], "Invalid value for '--tta': Value error, 'flop' is not one of 'flip', 'multicrop'"),
    (["--calibrate-on", "test"], "--calibrate-on test overlaps the evaluated split 'test'"),
    (["--calibrate-on", "test[:10]"], "--calibrate-on test[:10] overlaps the evaluated split 'test'"),
    (["--split", "train[:20]", "--calibrate-on", "train"], "overlaps the evaluated split 'train[:20]'"),
    (["--calibrate-on", "test", "--dry-run"], "overlaps the evaluated split"),
    (["--calibrate-on", "nope"], "no split 'nope'"),
    (["--calibrate-on"], "Option '--calibrate-on' requires an argument"),
    (["--calibrate-on", " "], "--calibrate-on needs a split name"),
])
def test_bad_input_is_one_line_and_writes_nothing(ckpt, tmp_path, monkeypatch, capsys, args, message):
    code, _, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ckpt[1], "--workdir", tmp_path / "w",
                           *DATA, *args)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert not (tmp_path / "w" / EVALUATE_FILE).exists() and "Traceback" not in err
