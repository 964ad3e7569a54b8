"""The checkpoint layer: reading every source into timm names, describing the network a checkpoint
holds, fitting it to a model, and position-embedding surgery on files.

Google .npz files are made here by exporting a tiny timm ViT with the inverse of the mapping under
test (vit_jax and big_vision layouts), so reading them back must give the original weights. The
ViT-H/14 file is written directly in vit_jax's key layout, the one place a real width is needed:
1280 wide with 16 heads is where the old width // 64 guess went wrong.
"""

import argparse
import dataclasses
import os
import pickle
import re
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from helpers import HEADS, MLP, PATCH, D, export_npz, mae_encoder, mae_pth, mae_sincos_reference, tiny_vit
from vitcli.checkpoints import preprocessing
from vitcli.checkpoints.describe import PAPER_HEADS, describe
from vitcli.checkpoints.fit import adapt_state_dict
from vitcli.checkpoints.pth import is_mae
from vitcli.checkpoints.read import Loaded, read_checkpoint
from vitcli.checkpoints.resize import resize_checkpoint
from vitcli.checkpoints.state import load_state, save_state
from vitcli.checkpoints.transfer import architecture_row
from vitcli.checkpoints.weights import load_weights, save_weights
from vitcli.errors import CheckpointError, VitcliError
from vitcli.models.mae import sincos_table
from vitcli.models.posemb import resample_axis, resample_posemb, sincos_2d
from vitcli.models.zoo import zero_head
from vitcli.runtime.files import atomic_path, checksum_path, sha256_of, write_text
from vitcli.runtime.run_files import MODEL_FILE
from vitcli.stages.resize import parse_grid, run_resize


def gap_vit(**kw) -> VisionTransformer:
    """The paper's GAP variant: no class token, LayerNorm before the average (as big_vision)."""
    return tiny_vit(class_token=False, global_pool="avg", fc_norm=False, **kw)


def vit_h14_npz(path, classes=10):
    """ViT-H/14 at 224 px, one block, random values in vit_jax's key layout: (D, H, D/H) query
    kernels."""
    width, heads, mlp, patch, grid = 1280, 16, 5120, 14, 16
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    b, a = "Transformer/encoderblock_0/", "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/"
    w = {
        "cls": rand(1, 1, width),
        "embedding/kernel": rand(patch, patch, 3, width),
        "embedding/bias": rand(width),
        "Transformer/posembed_input/pos_embedding": rand(1, 1 + grid * grid, width),
        "Transformer/encoder_norm/scale": rand(width),
        "Transformer/encoder_norm/bias": rand(width),
        "head/kernel": rand(width, classes),
        "head/bias": rand(classes),
        b + "LayerNorm_0/scale": rand(width),
        b + "LayerNorm_0/bias": rand(width),
        b + "LayerNorm_2/scale": rand(width),
        b + "LayerNorm_2/bias": rand(width),
        a + "out/kernel": rand(heads, width // heads, width),
        a + "out/bias": rand(width),
        b + "MlpBlock_3/Dense_0/kernel": rand(width, mlp),
        b + "MlpBlock_3/Dense_0/bias": rand(mlp),
        b + "MlpBlock_3/Dense_1/kernel": rand(mlp, width),
        b + "MlpBlock_3/Dense_1/bias": rand(width),
    }
    for name in ("query", "key", "value"):
        w[f"{a}{name}/kernel"] = rand(width, heads, width // heads)
        w[f"{a}{name}/bias"] = rand(heads, width // heads)
    np.savez(path, **w)
    return path, w


def assert_same(sd, ref):
    assert sorted(sd) == sorted(ref)
    for k in ref:
        assert sd[k].shape == ref[k].shape, k
        assert torch.equal(sd[k], ref[k]), k


def timm_file(path, model) -> str:
    """`model` as a timm safetensors file: no metadata of ours."""
    save_file(model.state_dict(), str(path), metadata={"format": "pt"})
    return str(path)


def our_meta(**spec):
    """Metadata as the trainer writes it: the resolved ModelConfig fields plus num_classes."""
    model = {
        "name": "custom", "img_size": 32, "patch_size": PATCH, "embed_dim": D, "depth": 2, "num_heads": HEADS,
        "mlp_dim": MLP, "pool": "token", "pos_embed": "learned_1d", "representation_size": 0, "dropout": 0.0,
        "drop_path": 0.0, "num_classes": 5, "head_bias_init": 0.0, **spec,
    }
    return {"recipe": {"model": {"img_size": model["img_size"]}}, "model": model}


def spec_of(sd, **changes):
    """What `describe` says of a foreign state dict, with `changes` applied."""
    return dataclasses.replace(describe(Loaded(sd, {}, "timm", "mem")), **changes)


# ---------------------------------------------------------------- our files


def test_our_files_are_written_atomically_and_read_back(tmp_path):
    sd = {"w": torch.randn(3, 2)}
    save_weights(tmp_path / "m.safetensors", sd, {"model": {"img_size": 32}})
    back, meta = load_weights(tmp_path / "m.safetensors")
    assert torch.equal(back["w"], sd["w"]) and meta == {"format": "vitcli/1", "model": {"img_size": 32}}
    save_state(tmp_path / "state.pt", {"step": 7, "w": sd["w"]})
    assert load_state(tmp_path / "state.pt")["step"] == 7
    write_text(tmp_path / "a.txt", "one")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert (tmp_path / "a.txt").read_text() == "one" and sorted(os.listdir(tmp_path)) == [
        "a.txt", "m.safetensors", "state.pt", "state.pt.sha256"]
    torch.save({"evil": _Payload(str(tmp_path / "x"))}, tmp_path / "bad.pt")
    # intact: only the pickle is bad
    checksum_path(tmp_path / "bad.pt").write_text(sha256_of(tmp_path / "bad.pt"))
    with pytest.raises(CheckpointError, match="cannot read training state"):
        load_state(tmp_path / "bad.pt")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- reading


def test_vit_jax_npz_reads_back_to_the_timm_weights(tmp_path):
    model = tiny_vit()
    loaded = read_checkpoint(str(export_npz(model, tmp_path / "vit.npz")))
    assert (loaded.kind, loaded.meta, loaded.num_heads) == ("npz", {}, HEADS)
    assert_same(loaded.state_dict, model.state_dict())


@pytest.mark.parametrize("prefix,scan", [("", False), ("params/", False), ("params/img/", True)])
def test_big_vision_gap_npz_reads_back(tmp_path, prefix, scan):
    model = gap_vit()
    path = export_npz(model, tmp_path / "bv.npz", layout="big_vision", prefix=prefix, scan=scan)
    loaded = read_checkpoint(str(path))
    assert_same(loaded.state_dict, model.state_dict())
    assert loaded.num_heads == HEADS


def test_big_vision_token_npz_gives_the_same_network(tmp_path):
    """big_vision adds posemb before prepending [cls]: read back as a zero class row, same
    outputs."""
    model = tiny_vit()
    loaded = read_checkpoint(str(export_npz(model, tmp_path / "bv.npz", layout="big_vision")))
    assert torch.equal(loaded.state_dict["pos_embed"][:, 0], torch.zeros(1, D))
    twin = tiny_vit(seed=1)
    twin.load_state_dict(loaded.state_dict, strict=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (twin(x) - model(x)).abs().max() < 1e-5


def test_npz_representation_layer_becomes_pre_logits_fc(tmp_path):
    kernel, bias = np.random.randn(D, 16).astype(np.float32), np.random.randn(16).astype(np.float32)
    path = export_npz(
        tiny_vit(), tmp_path / "r.npz", extra={"pre_logits/kernel": kernel, "pre_logits/bias": bias}
    )
    loaded = read_checkpoint(str(path))
    assert torch.equal(loaded.state_dict["pre_logits.fc.weight"], torch.from_numpy(kernel.T))
    assert torch.equal(loaded.state_dict["pre_logits.fc.bias"], torch.from_numpy(bias))
    assert describe(loaded).representation_size == 16


def test_npz_with_arrays_a_plain_vit_lacks_is_refused(tmp_path):
    path = export_npz(tiny_vit(), tmp_path / "map.npz", extra={"MAPHead_0/probe": np.zeros((1, 1, D))})
    with pytest.raises(CheckpointError, match="MAPHead_0/probe"):
        read_checkpoint(str(path))
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    with pytest.raises(CheckpointError, match="no embedding/kernel array"):
        read_checkpoint(str(tmp_path / "other.npz"))


def test_our_workdir_and_timm_safetensors(tmp_path):
    sd = tiny_vit().state_dict()
    meta = our_meta()
    save_weights(tmp_path / "run" / MODEL_FILE, sd, meta)
    ours = read_checkpoint(str(tmp_path / "run"))
    assert ours.kind == "vitcli" and ours.meta["model"] == meta["model"] and ours.num_heads == 0
    assert ours.path == str(tmp_path / "run" / MODEL_FILE)
    assert_same(ours.state_dict, sd)
    theirs = read_checkpoint(timm_file(tmp_path / "timm.safetensors", tiny_vit()))
    assert (theirs.kind, theirs.meta, theirs.num_heads) == ("timm", {}, 0)
    assert_same(theirs.state_dict, sd)


def test_reads_are_cached_until_the_file_changes(tmp_path):
    path = timm_file(tmp_path / "vit.safetensors", tiny_vit(num_classes=5))
    first = read_checkpoint(path)
    assert read_checkpoint(path) is first
    timm_file(path, tiny_vit(num_classes=7))  # rewritten in place: read again
    again = read_checkpoint(path)
    assert again is not first and again.state_dict["head.weight"].shape[0] == 7
    # an atomic rewrite of the same size within one clock tick: only the inode tells
    ours = tmp_path / "run" / MODEL_FILE
    save_weights(ours, tiny_vit(seed=0).state_dict(), our_meta())
    first, stat = read_checkpoint(str(ours)), os.stat(ours)
    save_weights(ours, tiny_vit(seed=1).state_dict(), our_meta())
    os.utime(ours, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(ours).st_size == stat.st_size
    again = read_checkpoint(str(ours))
    assert not torch.equal(again.state_dict["head.weight"], first.state_dict["head.weight"])


class _Payload:
    """Unpickling this creates a file: proof that a refused pickle was never unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize(
    "name,how",
    [
        ("w.pt", "torch"),
        ("weights", "torch"),
        ("legacy", "torch_legacy"),
        ("evil.safetensors", "pickle"),
        ("x.bin", "pickle"),
    ],
)
def test_pickles_are_refused_without_unpickling(tmp_path, name, how):
    """torch.save files are read with weights_only=True, which refuses the payload's global before
    building it; a bare pickle is not read at all. Either way one line naming the file, and nothing
    ran."""
    path, marker = tmp_path / name, tmp_path / "unpickled"
    payload = {"w": torch.zeros(2), "evil": _Payload(str(marker))}
    if how == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=4))
    else:
        torch.save(payload, path, _use_new_zipfile_serialization=how == "torch")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "safetensors" in msg
    assert ("a pickled io.open" in msg and "weights_only=True" in msg and "argparse.Namespace only" in msg
            if how != "pickle" else "torch.save did not write" in msg)
    assert not marker.exists()


# ---------------------------------------------------------------- MAE's .pth files


@pytest.mark.parametrize("layout,dropped", [
    ("run", ("decoder (31 tensors)", "mask_token",
             "not used: optimizer, epoch, args (argparse.Namespace), loss scaler")),
    ("full", ("decoder (31 tensors)", "mask_token")),
    ("pretrain", ()),
])
def test_mae_checkpoints_give_their_encoder_and_say_what_was_dropped(tmp_path, layout, dropped):
    """A run's checkpoint-N.pth (args a pickled argparse.Namespace), the _full release with its
    decoder, and the encoder-only release: each is the encoder, tensor for tensor, sin-cos table as
    it is; a 2-block decoder has 2 x 12 block tensors + embed, norm and pred (2 each) +
    decoder_pos_embed = 31."""
    encoder = mae_encoder()
    loaded = read_checkpoint(str(mae_pth(tmp_path / f"mae_{layout}.pth", encoder, layout)))
    assert loaded.kind == "mae" and loaded.dropped == dropped
    assert set(loaded.state_dict) == set(encoder.state_dict())
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in encoder.state_dict().items())
    spec = describe(loaded, num_heads=HEADS)
    assert (spec.name, spec.pool, spec.grid, spec.num_classes, spec.num_prefix_tokens) == \
        ("custom", "token", (4, 4), 0, 1)


def test_mae_sincos_table_is_maes_own():
    """The fingerprint of MAE's encoder-only release: its get_2d_sincos_pos_embed, restated from
    MAE's code in the helpers, equals ours to the bit; a learned table of the same shape is not
    taken for it."""
    for side, dim in ((4, 32), (14, 768), (16, 1024)):
        reference = torch.from_numpy(mae_sincos_reference(dim, side)).float()[None]
        assert torch.equal(sincos_table((side, side), dim), reference)
    learned = tiny_vit(num_classes=0).state_dict()
    assert not is_mae(learned)
    assert is_mae({**learned, "pos_embed": sincos_table((4, 4), D)})


def test_another_torch_file_is_read_as_its_state_dict(tmp_path):
    """DeiT's and timm's training files keep their weights under 'model' or 'state_dict_ema' (EMA
    first), with DDP's module. prefix: read as a plain ViT, kind torch, the rest said unused."""
    model = tiny_vit()
    sd = {f"module.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": sd, "epoch": 3, "args": argparse.Namespace(lr=5e-4)}, tmp_path / "deit.pth")
    torch.save({"state_dict": {k: v * 0 for k, v in model.state_dict().items()},
                "state_dict_ema": model.state_dict()}, tmp_path / "timm.pth.tar")
    for name in ("deit.pth", "timm.pth.tar"):
        loaded = read_checkpoint(str(tmp_path / name))
        assert loaded.kind == "torch" and describe(loaded, HEADS).num_classes == 5
        assert all(torch.equal(loaded.state_dict[k], v) for k, v in model.state_dict().items())
    unused = read_checkpoint(str(tmp_path / "deit.pth")).dropped
    assert unused == ("not used: epoch, args (argparse.Namespace)",)


def test_a_torch_file_pickling_another_class_is_refused_naming_it(tmp_path):
    """argparse.Namespace is allowed by name and nothing else: an MAE run file that also pickles a
    Path (a harmless class, but not allowed) is refused in one line naming the file and the
    class."""
    path = mae_pth(tmp_path / "checkpoint-799.pth", mae_encoder(), "run", extra={"where": tmp_path})
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(path))
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "pathlib" in msg and "argparse.Namespace only" in msg


def test_mae_finetuned_checkpoint_is_read_whole_as_pool_gap_fc_norm(tmp_path):
    """MAE's global-pool fine-tune (fc_norm after the mean of the patch tokens, head, no final norm)
    is read whole: describe calls its network pool gap_fc_norm, which builds it, so it loads with
    its head."""
    finetuned = tiny_vit(num_classes=7, global_pool="avg")  # timm's avg pool: fc_norm, norm = Identity
    sd = finetuned.state_dict()
    assert "fc_norm.weight" in sd and "norm.weight" not in sd
    torch.save({"model": sd}, tmp_path / "mae_finetuned_vit_tiny.pth")
    loaded = read_checkpoint(str(tmp_path / "mae_finetuned_vit_tiny.pth"))
    assert loaded.kind == "mae" and loaded.dropped == ()
    assert len(loaded.state_dict) == len(sd)
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in sd.items())
    spec = describe(loaded, HEADS)
    assert (spec.pool, spec.num_classes, spec.num_prefix_tokens) == ("gap_fc_norm", 7, 1)
    torch.save({"state_dict": sd}, tmp_path / "timm_avg_pool.pth.tar")  # timm's train.py: not MAE's layout
    assert read_checkpoint(str(tmp_path / "timm_avg_pool.pth.tar")).kind == "torch"


def test_mae_checkpoints_say_maes_preprocessing(tmp_path):
    loaded = read_checkpoint(str(mae_pth(tmp_path / "mae.pth", mae_encoder())))
    said = preprocessing.said_by(loaded, "custom")
    assert said.values == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                           "interpolation": "bicubic", "eval_crop_pct": 0.875}
    assert "MAE" in said.source


def test_other_files_are_an_unknown_format(tmp_path):
    with zipfile.ZipFile(tmp_path / "notes.zip", "w") as z:
        z.writestr("readme.txt", "hello")
    (tmp_path / "weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
    for name in ("notes.zip", "weights.h5"):
        with pytest.raises(CheckpointError, match="unknown weights format"):
            read_checkpoint(str(tmp_path / name))
    np.savez(tmp_path / "obj.npz", a=np.array([{"x": 1}], dtype=object))  # object arrays need pickle
    with pytest.raises(CheckpointError, match="without pickle"):
        read_checkpoint(str(tmp_path / "obj.npz"))


def test_missing_sources_name_the_file(tmp_path):
    for src in (tmp_path / "nope.safetensors", tmp_path / "runs" / "exp1"):
        with pytest.raises(CheckpointError, match=f"not found: {src}"):
            read_checkpoint(str(src))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'empty'} has no {MODEL_FILE}"):
        read_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="write hf-hub:google/vit"):
        read_checkpoint("google/vit")


def test_a_mistyped_local_path_is_told_its_neighbour_not_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "fm_pre").mkdir(parents=True)
    save_weights(tmp_path / "runs" / "fm_pre" / MODEL_FILE, tiny_vit().state_dict(), our_meta())
    with pytest.raises(CheckpointError) as e:
        read_checkpoint("runs/fm_pree")
    assert "did you mean runs/fm_pre?" in str(e.value) and "hf-hub" not in str(e.value)
    read_checkpoint("runs/fm_pre")  # the advice, followed


def test_hub_names_fail_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "timm/vit_tiny_patch16_224.augreg_in21k"
    with pytest.raises(CheckpointError, match=f"cannot download {name}: offline; pass a local file"):
        read_checkpoint(name)
    with pytest.raises(CheckpointError, match="not a file, a workdir or a timm model name"):
        read_checkpoint("no_such_model_anywhere")


def test_a_hub_models_heads_are_evidence(monkeypatch):
    """The Hub path builds the model, so its attn.num_heads is known even where Table 1 would
    differ."""
    built = []

    def create_model(name, pretrained):
        built.append((name, pretrained))
        return tiny_vit(embed_dim=192, num_heads=4, depth=1)

    monkeypatch.setattr(timm, "create_model", create_model)
    loaded = read_checkpoint("timm/fake_vit_for_the_hub_test")
    assert built == [("hf-hub:timm/fake_vit_for_the_hub_test", True)]
    assert (loaded.kind, loaded.num_heads) == ("hub", 4)
    spec = describe(loaded)
    assert (spec.num_heads, spec.heads_from, spec.embed_dim) == (4, "Hub model", 192)  # Table 1 says 3


# ---------------------------------------------------------------- describing


@pytest.fixture(scope="module")
def vit_h14(tmp_path_factory):
    return vit_h14_npz(tmp_path_factory.mktemp("vith") / "ViT-H_14.npz")


def test_vit_h14_npz_heads_come_from_its_attention_kernels(vit_h14):
    path, arrays = vit_h14
    loaded = read_checkpoint(str(path))
    spec = describe(loaded)
    assert (spec.num_heads, spec.heads_from) == (16, "attention kernels")  # width // 64 would say 20
    assert spec.architecture() == {
        "name": "custom", "patch_size": 14, "embed_dim": 1280, "depth": 1, "num_heads": 16, "mlp_dim": 5120,
        "pool": "token", "pos_embed": "learned_1d", "representation_size": 0, "layer_norm_eps": 1e-6,
    }
    assert (spec.grid, spec.num_prefix_tokens, spec.img_size, spec.num_classes) == ((16, 16), 1, 224, 10)
    query = arrays["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"]  # (D, H, D/H)
    qkv = loaded.state_dict["blocks.0.attn.qkv.weight"]  # (3D, D)
    assert torch.equal(qkv[:1280], torch.from_numpy(query.reshape(1280, 1280).T))
    with torch.device("meta"):
        timm_h14 = VisionTransformer(img_size=224, patch_size=14, embed_dim=1280, depth=1, num_heads=16,
                                     mlp_ratio=4.0, num_classes=10)
    assert {k: v.shape for k, v in loaded.state_dict.items()} == {
        k: v.shape for k, v in timm_h14.state_dict().items()}


def test_heads_evidence_and_the_recipe_must_agree(vit_h14):
    loaded = read_checkpoint(str(vit_h14[0]))
    assert describe(loaded, num_heads=16).heads_from == "attention kernels"
    with pytest.raises(CheckpointError) as e:
        describe(loaded, num_heads=20)
    msg = str(e.value)
    assert "model.num_heads=20" in msg and "16 attention heads (attention kernels)" in msg and "\n" not in msg


def test_paper_heads_are_table_1():
    assert PAPER_HEADS == {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}


def test_a_paper_width_without_metadata_takes_table_1(tmp_path):
    ti = tiny_vit(embed_dim=192, num_heads=3, depth=1, mlp_ratio=4.0)
    path = timm_file(tmp_path / "ti.safetensors", ti)
    spec = describe(read_checkpoint(path))
    assert (spec.num_heads, spec.heads_from) == (3, "paper Table 1 (width 192)")
    assert (spec.embed_dim, spec.depth, spec.mlp_dim, spec.patch_size) == (192, 1, 768, PATCH)


def test_an_unknown_width_needs_the_recipes_heads(tmp_path):
    path = timm_file(tmp_path / "odd.safetensors", tiny_vit(embed_dim=96, num_heads=4, depth=1))
    loaded = read_checkpoint(path)
    spec = describe(loaded)
    assert (spec.num_heads, spec.heads_from) == (0, "unknown")
    with pytest.raises(CheckpointError) as e:
        spec.architecture()
    msg = str(e.value)
    assert "\n" not in msg and "model.num_heads" in msg and "width 96" in msg and "odd.safetensors" in msg
    spec = describe(loaded, num_heads=4)
    assert (spec.num_heads, spec.heads_from) == (4, "recipe (model.num_heads)")
    assert spec.architecture()["num_heads"] == 4


def test_our_checkpoint_is_described_by_its_metadata(tmp_path):
    meta = our_meta(num_heads=4, representation_size=0)  # 4 heads: the tensors alone could not tell
    save_weights(tmp_path / "run" / MODEL_FILE, tiny_vit().state_dict(), meta)
    spec = describe(read_checkpoint(str(tmp_path / "run")))
    model = meta["model"]
    for field in ("name", "patch_size", "embed_dim", "depth", "num_heads", "mlp_dim", "pool", "pos_embed",
                  "representation_size", "num_classes", "img_size"):
        assert getattr(spec, field) == model[field], field
    assert (spec.heads_from, spec.grid, spec.num_prefix_tokens) == ("metadata", (4, 4), 1)
    with pytest.raises(CheckpointError, match="model.num_heads=2 in the recipe.*4 attention heads"):
        describe(read_checkpoint(str(tmp_path / "run")), num_heads=2)


def test_our_metadata_wins_over_the_tensors(tmp_path):
    """A hybrid's 1x1 kernel sits on a stride-16 ResNet map: the recorded patch size is the one to
    use."""
    sd = tiny_vit().state_dict()
    sd["patch_embed.proj.weight"] = torch.randn(D, 3, 1, 1)
    save_weights(tmp_path / "h" / MODEL_FILE, sd, our_meta(name="R50+ViT-B/16"))
    spec = describe(read_checkpoint(str(tmp_path / "h")))
    assert (spec.name, spec.patch_size, spec.grid, spec.img_size) == ("R50+ViT-B/16", PATCH, (4, 4), 32)


def test_our_sincos_2d_checkpoint(tmp_path):
    sd = tiny_vit().state_dict()
    sd["pos_embed"] = torch.cat([torch.zeros(1, 1, D), sincos_2d((4, 4), D)], 1)
    save_weights(tmp_path / "s" / MODEL_FILE, sd, our_meta(pos_embed="sincos_2d"))
    spec = describe(read_checkpoint(str(tmp_path / "s")))
    assert (spec.pos_embed, spec.grid, spec.num_prefix_tokens) == ("sincos_2d", (4, 4), 1)


def test_learned_2d_tables_tell_a_non_square_grid(tmp_path):
    sd = tiny_vit().state_dict()
    del sd["pos_embed"]
    sd["pos_embed_row"], sd["pos_embed_col"] = torch.randn(1, 6, D // 2), torch.randn(1, 4, D // 2)
    save_file(sd, str(tmp_path / "t.safetensors"))
    spec = describe(read_checkpoint(str(tmp_path / "t.safetensors")))
    assert (spec.pos_embed, spec.grid, spec.num_prefix_tokens) == ("learned_2d", (6, 4), 0)
    assert spec.img_size is None  # 48x32 px: no single img_size


@pytest.mark.parametrize(
    "kw,prefix",
    [
        ({}, 1),
        ({"reg_tokens": 4}, 5),
        ({"no_embed_class": True}, 0),
        ({"reg_tokens": 4, "no_embed_class": True}, 0),
        ({"class_token": False, "global_pool": "avg"}, 0),
    ],
)
def test_prefix_tokens_of_timm_models(tmp_path, kw, prefix):
    spec = describe(read_checkpoint(timm_file(tmp_path / "v.safetensors", tiny_vit(**kw))))
    assert (spec.num_prefix_tokens, spec.grid, spec.img_size) == (prefix, (4, 4), 32)
    assert spec.pool == ("gap" if kw.get("class_token") is False else "token")
    # and the transfer resize keeps those rows and fits timm's own model at the new size
    src, model = tiny_vit(**kw).state_dict(), tiny_vit(img_size=48, seed=1, **kw)
    out, rows = _fit(src, model, spec)
    assert torch.equal(out["pos_embed"][:, :prefix], src["pos_embed"][:, :prefix])
    assert "grid 4x4 -> 6x6" in rows["position embedding"]


def test_a_non_square_1d_table_without_metadata_has_no_grid_until_old_grid_tells_it(tmp_path):
    path = timm_file(tmp_path / "w.safetensors", tiny_vit(img_size=(40, 32)))  # 5x4 patches + [cls]
    spec = describe(read_checkpoint(path))
    assert (spec.grid, spec.img_size, spec.num_prefix_tokens, spec.pos_embed) == (None, None, 1, "learned_1d")
    with pytest.raises(CheckpointError, match="20 grid positions after its class-token row, not a square.*"
                                              "set --old-grid=HxW.*5x4"):
        resize_checkpoint(path, res=48, out=str(tmp_path / "o.safetensors"))
    rows = dict(resize_checkpoint(path, res=48, old_grid="5x4", out=str(tmp_path / "o.safetensors")))
    assert rows["grid"].startswith("5x4 -> 6x6") and rows["pos_embed"] == "(1, 21, 32) -> (1, 37, 32)"
    assert torch.equal(load_file(tmp_path / "o.safetensors")["pos_embed"],
                       resample_posemb(read_checkpoint(path).state_dict["pos_embed"], (5, 4), (6, 6), 1))


def test_what_is_not_a_plain_vit_is_described_but_cannot_be_rebuilt():
    sd = tiny_vit().state_dict()
    spec = spec_of({k: v for k, v in sd.items() if not k.startswith("patch_embed")})
    assert (spec.name, spec.pos_embed) == ("", "learned_1d")  # its tables still fit a model the recipe names
    with pytest.raises(CheckpointError, match="cannot infer the architecture.*set model.name"):
        spec.architecture()
    with pytest.raises(CheckpointError, match="only square patches"):
        spec_of({**sd, "patch_embed.proj.weight": torch.randn(D, 3, 8, 4)})


def test_gap_npz_and_heads_and_classes(tmp_path):
    path = export_npz(gap_vit(num_classes=7), tmp_path / "g.npz", "big_vision")
    spec = describe(read_checkpoint(str(path)))
    assert (spec.pool, spec.num_prefix_tokens, spec.grid, spec.num_classes) == ("gap", 0, (4, 4), 7)
    assert (spec.num_heads, spec.heads_from) == (HEADS, "attention kernels")


# ---------------------------------------------------------------- fitting to a model


def _fit(sd, model, spec=None, **kw):
    args = {"keep_head": False, "keep_representation": False, "method": "bilinear", **kw}
    out, rows = adapt_state_dict(sd, model, spec or spec_of(sd), **args)
    model.load_state_dict(out, strict=True)
    return out, dict(rows)


@pytest.mark.parametrize("timm_name, row", [
    ("vit_tiny_patch16_224", "ViT-Ti/16 (DeiT-Ti / AugReg Ti), grid 14x14"),
    ("vit_small_patch32_224", "ViT-S/32 (DeiT-S / AugReg S), grid 7x7"),
    ("vit_base_patch16_384", "ViT-B/16 (paper Table 1), grid 24x24"),
])
def test_a_file_of_a_known_size_is_named_by_it(timm_name, row):
    """A foreign file with a paper or DeiT/AugReg geometry is named by that size, not as `custom
    patch 16, width 192, depth 12, 3 heads`. describe reads shapes only, so timm's model is built on
    the meta device."""
    with torch.device("meta"):
        sd = timm.create_model(timm_name, pretrained=False).state_dict()
    assert architecture_row(describe(Loaded(sd, {}, "timm", "x.safetensors"))) == row


def test_other_geometries_keep_their_sizes_in_the_row():
    spec = describe(Loaded(tiny_vit().state_dict(), {}, "timm", "x.safetensors"), num_heads=HEADS)
    assert architecture_row(spec) == f"custom patch {PATCH}, width {D}, depth 2, {HEADS} heads " \
                                     "(recipe (model.num_heads)), grid 4x4"


def test_the_head_row_says_zero_initialised_only_when_it_is():
    src, model = tiny_vit(num_classes=5).state_dict(), tiny_vit(num_classes=3, seed=1)
    zero_head(model, 3)  # what transfer.load_init does before fitting
    _, rows = _fit(src, model)
    assert rows["head"] == "a new zero-initialised head for 3 classes (the checkpoint's 5-class head dropped)"
    assert not model.head.weight.any() and not model.head.bias.any()


def test_transfer_drops_head_and_resizes_posemb():
    src, model = (
        tiny_vit(img_size=32, num_classes=5).state_dict(),
        tiny_vit(img_size=48, num_classes=3, seed=1),
    )
    own_head = model.state_dict()["head.weight"].clone()
    before = {k: v.clone() for k, v in src.items()}
    out, rows = _fit(src, model)
    assert torch.equal(out["head.weight"], own_head)
    assert torch.equal(out["pos_embed"], resample_posemb(src["pos_embed"], (4, 4), (6, 6), 1, "bilinear"))
    assert torch.equal(out["blocks.1.attn.qkv.weight"], src["blocks.1.attn.qkv.weight"])
    # tiny_vit's head is random, not zero: the row says a new head, and only that
    assert rows["head"] == "a new head for 3 classes (the checkpoint's 5-class head dropped)"
    assert rows["position embedding"] == "(1, 17, 32) -> (1, 37, 32), grid 4x4 -> 6x6 (bilinear)"
    assert rows["loaded"] == f"{len(src) - 2} of {len(src)} tensors from the checkpoint"
    assert_same(src, before)  # the (cached, shared) input is not changed


def test_keeping_a_head_of_another_size_is_an_error():
    with pytest.raises(CheckpointError, match="dataset has 3 classes and the checkpoint head has 5"):
        _fit(tiny_vit(num_classes=5).state_dict(), tiny_vit(num_classes=3), keep_head=True)
    src = tiny_vit(num_classes=5).state_dict()
    out, rows = _fit(src, tiny_vit(num_classes=5, seed=1), keep_head=True)
    assert torch.equal(out["head.weight"], src["head.weight"]) and rows["head"] == "kept (5 classes)"


def test_architecture_mismatch_lists_keys_and_shapes():
    with pytest.raises(CheckpointError) as e:
        _fit(tiny_vit().state_dict(), tiny_vit(mlp_ratio=4.0))  # MLP 64 wide in the checkpoint, 128 here
    msg = str(e.value)
    assert "\n" not in msg
    assert (
        "blocks.0.mlp.fc1.weight (64, 32) in checkpoint vs (128, 32) in model" in msg and "(+3 more)" in msg
    )
    with pytest.raises(CheckpointError, match=r"missing: blocks\.2\.norm1\.weight"):
        _fit(tiny_vit().state_dict(), tiny_vit(depth=3))


def _with_representation(model, width=16):
    model.pre_logits = nn.Sequential(OrderedDict(fc=nn.Linear(D, width), act=nn.Tanh()))
    return model


def test_representation_dropped_or_kept():
    src = _with_representation(tiny_vit()).state_dict()
    out, rows = _fit(src, tiny_vit(seed=1))
    assert (
        not any(k.startswith("pre_logits") for k in out)
        and rows["representation"] == "dropped pre_logits 32 -> 16"
    )
    out, rows = _fit(src, _with_representation(tiny_vit(seed=1)), keep_representation=True)
    assert torch.equal(out["pre_logits.fc.weight"], src["pre_logits.fc.weight"])
    assert rows["representation"] == "kept pre_logits 32 -> 16"
    with pytest.raises(CheckpointError, match="no pre_logits layer"):
        _fit(tiny_vit().state_dict(), _with_representation(tiny_vit()), keep_representation=True)


def test_sincos_and_learned_2d_embeddings():
    model = tiny_vit(img_size=48)
    with torch.no_grad():
        model.pos_embed.copy_(torch.cat([torch.zeros(1, 1, D), sincos_2d((6, 6), D)], 1))
    src = tiny_vit().state_dict()
    out, rows = _fit(src, model, spec_of(src, pos_embed="sincos_2d"))
    assert torch.equal(out["pos_embed"][:, 1:], sincos_2d((6, 6), D))
    assert rows["position embedding"] == "sincos_2d for grid 6x6"

    def two_tables(gh, gw):
        m = tiny_vit(img_size=(8 * gh, 8 * gw), pos_embed="none")
        m.pos_embed_row, m.pos_embed_col = (
            nn.Parameter(torch.randn(1, gh, D // 2)),
            nn.Parameter(torch.randn(1, gw, D // 2)),
        )
        return m

    src = two_tables(4, 4).state_dict()
    out, rows = _fit(src, two_tables(6, 4))
    assert torch.equal(out["pos_embed_row"], resample_axis(src["pos_embed_row"], 6))
    assert torch.equal(out["pos_embed_col"], src["pos_embed_col"])
    assert rows["pos_embed_row"] == "(1, 4, 16) -> (1, 6, 16) (bilinear)" and "pos_embed_col" not in rows


def test_the_checkpoints_own_grid_is_used():
    """A 4x4 table that the spec says spans 2x8 is resampled as 2x8, not guessed square."""
    src = tiny_vit().state_dict()
    out, rows = _fit(src, tiny_vit(img_size=32, seed=1), spec_of(src, grid=(2, 8)))
    assert torch.equal(out["pos_embed"], resample_posemb(src["pos_embed"], (2, 8), (4, 4), 1, "bilinear"))
    assert "grid 2x8 -> 4x4" in rows["position embedding"]


# ---------------------------------------------------------------- surgery


def test_resize_timm_file_loads_in_timm_at_the_new_size(tmp_path):
    src = timm_file(tmp_path / "vit.safetensors", tiny_vit())
    rows = dict(resize_checkpoint(src, res=48, out=str(tmp_path / "vit48.safetensors")))
    assert rows["grid"] == "4x4 -> 6x6 (patch 8, learned_1d, bilinear)"
    assert rows["img_size"] == "32x32 -> 48x48" and rows["pos_embed"] == "(1, 17, 32) -> (1, 37, 32)"
    sd = read_checkpoint(str(tmp_path / "vit48.safetensors")).state_dict
    tiny_vit(img_size=48).load_state_dict(sd, strict=True)
    # a non-square grid, and bicubic
    resize_checkpoint(src, new_grid=(6, 4), method="bicubic", out=str(tmp_path / "wide.safetensors"))
    tiny_vit(img_size=(48, 32)).load_state_dict(load_weights(tmp_path / "wide.safetensors")[0], strict=True)


def test_resize_round_trip(tmp_path):
    src = tmp_path / "vit.safetensors"
    original = tiny_vit().state_dict()
    save_file(original, str(src))
    resize_checkpoint(str(src), res=32, out=str(tmp_path / "same.safetensors"))
    assert_same(load_weights(tmp_path / "same.safetensors")[0], original)  # A -> A changes nothing
    # 6x6, not 7x7: with corners aligned, 4 -> 7 -> 4 is exact (7 - 1 is a multiple of 4 - 1)
    resize_checkpoint(str(src), res=48, out=str(tmp_path / "b.safetensors"))
    resize_checkpoint(str(tmp_path / "b.safetensors"), res=32, out=str(tmp_path / "back.safetensors"))
    back = load_weights(tmp_path / "back.safetensors")[0]["pos_embed"]
    assert back.shape == original["pos_embed"].shape
    assert torch.equal(back[:, 0], original["pos_embed"][:, 0])
    assert (back - original["pos_embed"]).abs().max() > 1e-2  # 4x4 -> 6x6 -> 4x4 is not the identity


def test_resize_npz_writes_timm_safetensors(tmp_path):
    npz = export_npz(tiny_vit(), tmp_path / "bv.npz", layout="big_vision")
    resize_checkpoint(str(npz), res=48, out=None)
    out = tmp_path / "bv_6x6.safetensors"
    assert read_checkpoint(str(out)).kind == "timm"
    tiny_vit(img_size=48).load_state_dict(load_weights(out)[0], strict=True)


@pytest.mark.parametrize("kind", ["learned_1d", "sincos_2d", "learned_2d"])
def test_resize_our_checkpoint_updates_its_metadata(tmp_path, kind):
    sd = tiny_vit().state_dict()
    if kind == "sincos_2d":
        sd["pos_embed"] = torch.cat([torch.zeros(1, 1, D), sincos_2d((4, 4), D)], 1)
    if kind == "learned_2d":
        del sd["pos_embed"]
        sd["pos_embed_row"], sd["pos_embed_col"] = torch.randn(1, 4, D // 2), torch.randn(1, 4, D // 2)
    save_weights(tmp_path / "run" / MODEL_FILE, sd, our_meta(pos_embed=kind))
    resize_checkpoint(str(tmp_path / "run"), res=48, out=str(tmp_path / "r48.safetensors"))
    loaded = read_checkpoint(str(tmp_path / "r48.safetensors"))
    assert loaded.kind == "vitcli"
    assert loaded.meta["model"]["img_size"] == 48 and loaded.meta["recipe"]["model"]["img_size"] == 48
    out = loaded.state_dict
    if kind == "sincos_2d":
        assert torch.equal(out["pos_embed"][:, 1:], sincos_2d((6, 6), D)) and not out["pos_embed"][:, 0].any()
    elif kind == "learned_2d":
        assert out["pos_embed_row"].shape == out["pos_embed_col"].shape == (1, 6, D // 2)
    else:
        assert out["pos_embed"].shape == (1, 37, D)
    with pytest.raises(CheckpointError, match="pick a square grid"):
        resize_checkpoint(str(tmp_path / "run"), new_grid=(6, 4), out=str(tmp_path / "wide.safetensors"))


def test_resize_needs_no_heads(tmp_path):
    path = timm_file(tmp_path / "odd.safetensors", tiny_vit(embed_dim=96, num_heads=4, depth=1))
    assert describe(read_checkpoint(path)).num_heads == 0
    rows = dict(resize_checkpoint(path, res=48, out=str(tmp_path / "odd48.safetensors")))
    assert rows["pos_embed"] == "(1, 17, 96) -> (1, 37, 96)"
    tiny_vit(img_size=48, embed_dim=96, num_heads=4, depth=1).load_state_dict(
        load_weights(tmp_path / "odd48.safetensors")[0], strict=True)


def test_dry_run_writes_nothing(tmp_path):
    src = tmp_path / "vit.safetensors"
    save_file(tiny_vit().state_dict(), str(src))
    rows = dict(resize_checkpoint(str(src), res=48, out=None, dry_run=True))
    assert rows["output"] == f"{tmp_path / 'vit_6x6.safetensors'} (dry run, not written)"
    assert sorted(os.listdir(tmp_path)) == ["vit.safetensors"]
    with pytest.raises(CheckpointError, match="exactly one"):
        resize_checkpoint(str(src), res=48, new_grid=(6, 6), out=None)


def test_resize_checks_the_request_before_reading(tmp_path):
    """Each bad request names itself, though the source does not even exist."""
    missing = str(tmp_path / "missing.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    bad = [
        ({"res": 48, "method": "nearest"}, "--method 'nearest': expected one of bilinear, bicubic"),
        ({"res": 48, "out": str(tmp_path / "o.pt")}, "name it \\*.safetensors"),
        ({"res": 48, "out": str(tmp_path / "dir.safetensors")}, "is a directory"),
        ({"new_grid": (0, 4)}, "two positive sides"),
        ({"res": -32}, "positive number of pixels"),
    ]
    for kw, match in bad:
        with pytest.raises(VitcliError, match=match):  # CheckpointError, or OutputError for --out
            resize_checkpoint(missing, **kw)
    with pytest.raises(CheckpointError, match="not found"):
        resize_checkpoint(missing, res=48)
    src = timm_file(tmp_path / "vit.safetensors", tiny_vit())
    with pytest.raises(CheckpointError, match="patch size 16 given.*8x8; .*drop --patch"):
        resize_checkpoint(src, res=48, patch_size=16)
    assert sorted(os.listdir(tmp_path)) == ["dir.safetensors", "vit.safetensors"]


def test_run_resize_shows_a_table(tmp_path, capsys):
    src = timm_file(tmp_path / "vit.safetensors", tiny_vit())
    rows = run_resize(src, out=None, res=None, grid="6x4", patch=None, method="bicubic", dry_run=False)
    shown = capsys.readouterr().out
    assert "resize-posemb" in shown and "4x4 -> 6x4" in shown and dict(rows)["pos_embed"] in shown
    assert (tmp_path / "vit_6x4.safetensors").is_file()
    assert parse_grid("24X16") == (24, 16)
    for text in ("24", "0x4", "ax4", "4x4x4"):
        with pytest.raises(CheckpointError, match="expected HxW"):
            parse_grid(text)
    with pytest.raises(CheckpointError, match="--method 'nearest'"):
        run_resize(src, out=None, res=48, grid=None, patch=None, method="nearest", dry_run=False)


def test_a_safetensors_file_cut_short_says_how_much_of_it_is_there(tmp_path):
    """Past its header: the bytes there and the bytes its header describes; within it: the bytes."""
    save_weights(tmp_path / "whole.safetensors", tiny_vit().state_dict(), our_meta())
    whole = (tmp_path / "whole.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    cuts = ((len(whole) - 1, f"{len(whole) - 1} bytes of the {len(whole)} its header describes"),
            (header_end - 1, f"{header_end - 1} bytes (an interrupted copy or download?)"))
    for n, said in cuts:
        (tmp_path / "cut.safetensors").write_bytes(whole[:n])
        with pytest.raises(CheckpointError, match=f"is cut short: {re.escape(said)}"):
            read_checkpoint(str(tmp_path / "cut.safetensors"))
