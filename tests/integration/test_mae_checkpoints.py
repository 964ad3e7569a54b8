"""MAE's checkpoints in and out: facebookresearch/mae's `.pth` files as starting weights (the
encoder kept, the decoder, mask token and training state dropped and said so), and an MAE encoder
exported for timm's MAE ViT and transformers' ViTMAEModel.

The `.pth` files are made here as MAE's util/misc.py save_model writes them (tests/helpers.py
mae_pth: a run's checkpoint-N.pth with optimizer, epoch, scaler and a pickled argparse.Namespace;
the releases' {'model': ...}), around a tiny encoder with MAE's own fixed sin-cos table. A vit MAE
run is stood in for by its model.safetensors as such a run writes it: the headless encoder, the
recipe's objective `mae` in metadata.

Tolerances: timm's and vit's forward of the same weights agree within 1e-6 (the same module code);
transformers' ViTMAEModel within 1e-5 (float32 through another attention implementation).
"""

import json
import re

import pytest
import timm
import torch
import yaml

from helpers import HEADS, MLP, PATCH, D, mae_encoder, mae_pth, run_vit
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.transfer import load_for_eval, load_init
from vitcli.checkpoints.weights import save_weights
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig
from vitcli.runtime import dist as dist_mod

transformers = pytest.importorskip("transformers")

TINY = ModelConfig(name="custom", img_size=32, patch_size=PATCH, embed_dim=D, depth=2, num_heads=HEADS,
                   mlp_dim=MLP)
RUN = ["--workdir", "WORKDIR", "model.img_size=32", f"model.num_heads={HEADS}", "schedule.steps=2",
       "schedule.warmup_steps=1", "data.batch_size=8", "data.eval_batch_size=8", "data.num_workers=0",
       "data.synthetic.train_size=16", "data.synthetic.val_size=8", "data.synthetic.test_size=8",
       "run.precision=fp32", "run.device=cpu"]
TIMM_MAE = {"img_size": 32, "patch_size": PATCH, "embed_dim": D, "depth": 2, "num_heads": HEADS,
            "mlp_ratio": MLP / D}


def _rows(out: str) -> str:
    """The tables' rows, unwrapped: one line of words."""
    return " ".join(re.sub("[│┃]", " ", out).split())


def _vit_mae_run(tmp_path, encoder):
    """model.safetensors as a vit run of objective mae writes it: the encoder, headless, ImageNet's
    pixels."""
    recipe = {"objective": "mae", "data": {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                                           "interpolation": "bicubic", "eval_crop_pct": 1.0}}
    path = tmp_path / "mae_run" / "model.safetensors"
    save_weights(path, encoder.state_dict(), {"model": model_spec(TINY, 0), "recipe": recipe})
    return path


def _unshuffled(output) -> torch.Tensor:
    """ViTMAEModel's last_hidden_state (B, 1 + N, D) with its patch tokens put back in the image's
    order."""
    tokens, restore = output.last_hidden_state, output.ids_restore  # restore: (B, N)
    patches = tokens[:, 1:].gather(1, restore[..., None].expand(-1, -1, tokens.shape[-1]))
    return torch.cat([tokens[:, :1], patches], dim=1)


# ---------------------------------------------------------------- in: --init and --ckpt


def test_finetune_from_maes_run_checkpoint_keeps_the_encoder_and_says_what_it_dropped(monkeypatch, capsys,
                                                                                        tmp_path):
    encoder = mae_encoder()
    ckpt = mae_pth(tmp_path / "checkpoint-799.pth", encoder, "run")
    args = [a.replace("WORKDIR", str(tmp_path / "ft")) for a in RUN]
    code, out, err = run_vit(monkeypatch, capsys, "finetune", "--init", ckpt, *args)
    assert code == 0, err
    said = _rows(out + err)
    assert "checkpoint-799.pth (mae)" in said  # the source row (a long path folds in the table)
    assert ("dropped decoder (31 tensors); mask_token; not used: optimizer, epoch, "
            "args (argparse.Namespace), loss scaler") in said
    assert ("mean 0.485,0.456,0.406, std 0.229,0.224,0.225, interpolation bicubic (from MAE's .pth: ImageNet "
            "mean and std, bicubic") in said
    recorded = yaml.safe_load((tmp_path / "ft" / "recipe.yaml").read_text())
    assert recorded["data"]["interpolation"] == "bicubic" and recorded["model"]["pos_embed"] == "learned_1d"

    r = resolve("finetune", None, [f"init.checkpoint={ckpt}", *args[2:]], complete=complete)
    model = build_model(r.model, 3)
    rows = dict(load_init(model, r, 3, dist_mod.setup("cpu")))
    # all but the new head's weight and bias
    assert rows["loaded"] == f"{len(encoder.state_dict())} of {len(model.state_dict())}" \
        " tensors from the checkpoint"
    for name, weight in encoder.state_dict().items():  # MAE's sin-cos table too: loaded as it is
        assert torch.equal(model.state_dict()[name], weight), name


def test_the_encoder_of_a_vit_mae_run_is_what_finetuning_starts_from(tmp_path):
    encoder = mae_encoder(seed=1)
    ckpt = _vit_mae_run(tmp_path, encoder)
    r = resolve("finetune", None, [f"init.checkpoint={ckpt}", "model.img_size=32", "schedule.steps=2",
                                   "schedule.warmup_steps=1", "run.device=cpu"], complete=complete)
    model = build_model(r.model, 4)
    rows = dict(load_init(model, r, 4, dist_mod.setup("cpu")))
    assert "dropped" not in rows and not model.head.weight.any()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in encoder.state_dict().items())


@pytest.mark.parametrize("command", ["eval-fewshot", "inspect", "export"])
def test_other_commands_read_maes_pth_as_its_encoder(monkeypatch, capsys, tmp_path, command):
    ckpt = mae_pth(tmp_path / "mae_pretrain_vit_tiny_full.pth", mae_encoder(), "full")
    extra = {"eval-fewshot": ["--tasks", "synthetic", "--workdir", tmp_path / "fs", "--dry-run"],
             "inspect": ["--out", tmp_path / "in", "--images", "4", "--json", "data.num_workers=0"],
             "export": ["--format", "timm", "--out", tmp_path / "timm", "--dry-run"]}[command]
    code, out, err = run_vit(monkeypatch, capsys, command, "--ckpt", ckpt, *extra, f"model.num_heads={HEADS}")
    assert code == 0, err
    shown = {"eval-fewshot": "embed_dim: 32", "inspect": '"attention_distance', "export": "width 32"}
    assert shown[command] in _rows(out)


def test_evaluate_refuses_maes_pth_in_one_line_saying_what_was_left_out(monkeypatch, capsys, tmp_path):
    ckpt = mae_pth(tmp_path / "mae_visualize_vit_tiny.pth", mae_encoder(), "full")
    code, _, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ckpt, f"model.num_heads={HEADS}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(ckpt) in err and "no classification head" in err and "decoder (31 tensors); mask_token" in err
    assert "fine-tune it first" in err


def test_finetune_with_pool_gap_fc_norm_builds_maes_fine_tune_network(monkeypatch, capsys, tmp_path):
    """model.pool=gap_fc_norm over MAE's encoder, as main_finetune.py with global_pool: the class
    token and blocks loaded, the encoder's final norm dropped, a fresh fc_norm after the mean of the
    patch tokens; it trains its steps and the run records the pooling."""
    encoder = mae_encoder()
    ckpt = mae_pth(tmp_path / "mae_pretrain_vit_tiny.pth", encoder)
    args = [a.replace("WORKDIR", str(tmp_path / "ft")) for a in RUN] + ["model.pool=gap_fc_norm"]
    code, out, err = run_vit(monkeypatch, capsys, "finetune", "--init", ckpt, *args)
    assert code == 0, err
    assert "final norm the checkpoint's dropped; a new fc_norm (weight 1, bias 0)" in _rows(out + err)
    assert yaml.safe_load((tmp_path / "ft" / "recipe.yaml").read_text())["model"]["pool"] == "gap_fc_norm"

    r = resolve("finetune", None, [f"init.checkpoint={ckpt}", *args[2:]], complete=complete)
    model = build_model(r.model, 3)
    load_init(model, r, 3, dist_mod.setup("cpu"))
    sd = model.state_dict()
    assert torch.equal(sd["fc_norm.weight"], torch.ones(D)) and not sd["fc_norm.bias"].any()
    assert all(torch.equal(sd[k], v) for k, v in encoder.state_dict().items() if not k.startswith("norm."))
    assert "norm.weight" not in sd and "cls_token" in sd


def test_maes_fine_tuned_pth_evaluates_as_mae_runs_it(monkeypatch, capsys, tmp_path):
    """mae_finetuned_vit_*.pth (class token, fc_norm, head, no final norm) is read whole: `vit
    evaluate` scores it, and the network it builds gives timm's global_pool='avg', fc_norm=True
    logits (1e-5)."""
    finetuned = timm.create_model("vit_base_patch16_224", pretrained=False, **TIMM_MAE, num_classes=4,
                                  global_pool="avg", fc_norm=True).eval()
    with torch.no_grad():
        for p in finetuned.parameters():
            p.normal_(0, 0.3)
    ckpt = tmp_path / "mae_finetuned_vit_tiny.pth"
    torch.save({"model": finetuned.state_dict()}, ckpt)
    args = [a.replace("WORKDIR", str(tmp_path / "ev")) for a in RUN if "schedule" not in a]
    code, _, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ckpt, *args,
                           "data.synthetic.num_classes=4")
    assert code == 0, err
    r = resolve("evaluate", None, [f"init.checkpoint={ckpt}", *args[2:]], complete=complete)
    assert (r.model.pool, r.model.num_classes) == ("gap_fc_norm", 4)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(load_for_eval(r, 4)(images), finetuned(images), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- out: timm's MAE ViT,
# transformers' ViTMAE


@pytest.mark.parametrize("source", ["vit run", "mae .pth"])
def test_an_mae_encoder_exports_strictly_into_timms_mae_vit(monkeypatch, capsys, tmp_path, source):
    """timm's `vit_base_patch16_224.mae` is a token-pooled, headless VisionTransformer (num_classes
    0, no fc_norm): at tiny sizes the exported weights load into it strictly and give the encoder's
    features."""
    encoder = mae_encoder()
    ckpt = (_vit_mae_run(tmp_path, encoder) if source == "vit run"
            else mae_pth(tmp_path / "checkpoint-799.pth", encoder, "run"))
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", "timm", "--out",
                           tmp_path / "timm", f"model.num_heads={HEADS}")
    assert code == 0, err
    theirs = timm.create_model("vit_base_patch16_224.mae", pretrained=False, **TIMM_MAE).eval()
    assert theirs.num_classes == 0 and theirs.global_pool == "token"
    weights = timm.models.load_checkpoint(theirs, str(tmp_path / "timm" / "model.safetensors"), strict=True)
    assert weights.missing_keys == weights.unexpected_keys == []
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert config["num_classes"] == 0 and config["pretrained_cfg"]["interpolation"] == "bicubic"
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (theirs.forward_features(x) - encoder.forward_features(x)).abs().max() < 1e-6


@pytest.mark.parametrize("source", ["vit run", "mae .pth"])
def test_an_mae_encoder_exports_to_transformers_vitmae_without_masking(monkeypatch, capsys, tmp_path, source):
    """--format hf writes a headless MAE encoder as ViTMAEModel: eps 1e-6 (MAE's, not transformers'
    1e-12), mask_ratio 0.0, and its hidden states, put back in order, are timm's forward_features of
    the same weights within 1e-5; with `noise` ascending they come in order as they are."""
    encoder = mae_encoder()
    ckpt = (_vit_mae_run(tmp_path, encoder) if source == "vit run"
            else mae_pth(tmp_path / "mae_pretrain_vit_tiny.pth", encoder))
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", ckpt, "--format", "hf", "--out",
                           tmp_path / "hf", f"model.num_heads={HEADS}")
    assert code == 0, err
    theirs, info = transformers.ViTMAEModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # every tensor has its place, none is left to a random init
    assert theirs.config.layer_norm_eps == 1e-6 and theirs.config.mask_ratio == 0.0
    x, patches = torch.randn(3, 3, 32, 32), (32 // PATCH) ** 2
    with torch.no_grad():
        ours = encoder.forward_features(x)  # (B, 1 + N, D)
        shuffled = theirs.eval()(pixel_values=x)
        ordered = theirs(pixel_values=x, noise=torch.arange(patches).expand(3, patches).float())
    assert shuffled.last_hidden_state.shape == ours.shape
    assert (_unshuffled(shuffled) - ours).abs().max() < 1e-5
    assert (ordered.last_hidden_state - ours).abs().max() < 1e-5
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "ViTMAEModel" in card and "mask_ratio" in card and "image-feature-extraction" in card

    masked = transformers.ViTMAEModel.from_pretrained(tmp_path / "hf", mask_ratio=0.75).eval()
    with torch.no_grad():  # transformers' default: three patches in four dropped, at inference too
        assert masked(pixel_values=x).last_hidden_state.shape == (3, 1 + patches // 4, D)


def test_a_headless_checkpoint_of_another_objective_is_still_refused_by_hf(monkeypatch, capsys, tmp_path):
    """Only an MAE encoder goes to ViTMAEModel: a masked-patch-prediction run's headless ViT is
    refused as before (transformers would attach a random classifier to it)."""
    path = tmp_path / "mpp" / "model.safetensors"
    save_weights(path, mae_encoder().state_dict(), {"model": model_spec(TINY, 0),
                                                    "recipe": {"objective": "mpp"}})
    code, _, err = run_vit(monkeypatch, capsys, "export", "--ckpt", path, "--format", "hf", "--out",
                           tmp_path / "hf")
    assert code == 2 and "no classification head" in err and "ViTForImageClassification" in err, err
