"""`vit inspect` on an MAE run draws MAE's Figure 2 from the decoder in its training state: the
original, the masked input, the decoder's output on every patch and that output with the visible
patches pasted (tests/unit/test_figure2.py checks the drawing's arithmetic); without the decoder it
says why."""

import json

import numpy as np
import pytest
import torch

from helpers import run_vit
from vitcli.figures import figure2
from vitcli.models import mae
from vitcli.recipe.resolve import resolve
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.inspect import RECONSTRUCTED, RECONSTRUCTION, mae_run, reconstruct
from vitcli.stages.run import one_run

IMAGENET = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
TINY = ["objective=mae", "mae.mask_ratio=0.5", "mae.decoder_embed_dim=16", "mae.decoder_depth=1",
        "mae.decoder_num_heads=2", "model.img_size=32", "model.patch_size=8", "model.embed_dim=32",
        "model.depth=1", "model.num_heads=2", "model.mlp_dim=64", "data.synthetic.train_size=64",
        "data.synthetic.val_size=8", "data.synthetic.test_size=8", "data.batch_size=32", "data.num_workers=0",
        f"data.mean={IMAGENET[0]}", f"data.std={IMAGENET[1]}", "schedule.steps=4", "schedule.warmup_steps=1",
        "run.eval_every=0", "run.ckpt_every=4", "run.precision=fp32"]


@pytest.fixture(scope="module")
def mae_workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mae")
    one_run(resolve("pretrain", None, TINY), workdir)
    return workdir


def test_inspect_draws_the_four_columns(mae_workdir, tmp_path, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", mae_workdir, "--out", tmp_path,
                             "--images", 4, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert str(tmp_path / RECONSTRUCTION) in report["written"] and (tmp_path / RECONSTRUCTION).stat().st_size
    drawn = report["mae_reconstruction"]
    assert drawn["step"] == 4 and drawn["split"] == "validation" and drawn["norm_pix_loss"]
    assert drawn["grey"] is False  # the synthetic images are in colour
    assert (tmp_path / "attention_distance.png").is_file()  # Figure 7 as for any ViT


def test_the_figure_is_the_runs_own_output_with_a_fixed_mask(mae_workdir):
    run, why = mae_run(str(mae_workdir / MODEL_FILE))
    assert run is not None, why
    images, pred, mask, _ = reconstruct(run, RECONSTRUCTED, torch.device("cpu"))
    assert mask.shape == (RECONSTRUCTED, 16) and (mask.sum(dim=1) == 8).all()  # 0.5 of 16 patches
    again = reconstruct(run, RECONSTRUCTED, torch.device("cpu"))
    assert torch.equal(again[1], pred) and torch.equal(again[2], mask)  # a fixed seed: the same figure
    tiles = figure2.panels(images, pred, mask, 8, True, *IMAGENET)  # (B, 4, H, W, 3)
    assert tiles.shape == (RECONSTRUCTED, 4, 32, 32, 3) and tiles.min() >= 0 and tiles.max() <= 1
    shown = 0.5 + mae.unpatchify(pred, 8, (4, 4)).permute(0, 2, 3, 1) / (2 * figure2.NORM_PIX_RANGE)
    # norm-pix units, nothing else
    assert np.allclose(tiles[:, 2], shown.clamp(0, 1).numpy(), atol=1e-6)

    fig = figure2.reconstruction_figure(tiles, "mask ratio 0.5, step 4")
    assert sum(len(ax.get_images()) for ax in fig.axes) == 4 * RECONSTRUCTED
    assert [ax.get_title() for ax in fig.axes[:4]] == list(figure2.COLUMNS)
    assert "mask ratio 0.5" in fig._suptitle.get_text()


def test_without_the_training_state_the_figure_is_skipped_with_the_reason(mae_workdir, tmp_path, monkeypatch,
                                                                           capsys):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / MODEL_FILE).write_bytes((mae_workdir / MODEL_FILE).read_bytes())
    code, out, err = run_vit(monkeypatch, capsys, "inspect", "--ckpt", lone, "--out", tmp_path / "figs",
                             "--images", 2, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["skipped"][RECONSTRUCTION] == (f"{lone} holds no whole training state (state-<step>.pt), "
                                                 "where an MAE run keeps its decoder")
    assert not (tmp_path / "figs" / RECONSTRUCTION).exists() and not report["mae_reconstruction"]
