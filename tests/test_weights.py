"""Reading foreign checkpoints, fitting them to a model, and position-embedding surgery on files.

Google .npz files are made here by exporting a tiny timm ViT with the inverse of the mapping under test
(vit_jax and big_vision layouts), so reading them back must give the original weights.
"""

import os
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vitcli.checkpoint import MODEL_FILE, load_weights, save_weights
from vitcli.errors import CheckpointError
from vitcli.posemb import resample_axis, resample_posemb, sincos_2d
from vitcli.surgery import resize_checkpoint
from vitcli.weights import adapt_state_dict, read_checkpoint

D, HEADS, MLP, PATCH = 32, 2, 64, 8


def tiny_vit(img_size=32, num_classes=5, seed=0, **kw) -> VisionTransformer:
    """A 2-block ViT with every parameter random (timm zero-inits some, which would hide mix-ups)."""
    torch.manual_seed(seed)
    kw = {"embed_dim": D, "depth": 2, "num_heads": HEADS, "mlp_ratio": MLP / D, **kw}
    model = VisionTransformer(img_size=img_size, patch_size=PATCH, num_classes=num_classes, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def gap_vit(**kw) -> VisionTransformer:
    """The paper's GAP variant: no class token, LayerNorm before the average (as big_vision)."""
    return tiny_vit(class_token=False, global_pool="avg", fc_norm=False, **kw)


def export_npz(model, path, layout="vit_jax", prefix="", scan=False, extra=None):
    """Write `model` as flattened Flax params, the inverse of timm's _load_weights mapping."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # OIHW -> HWIO
        "embedding/bias": sd["patch_embed.proj.bias"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
        "head/kernel": sd["head.weight"].T,
        "head/bias": sd["head.bias"],
    }
    pos = sd["pos_embed"]
    if layout == "vit_jax":
        w["Transformer/posembed_input/pos_embedding"] = pos
        if "cls_token" in sd:
            w["cls"] = sd["cls_token"]
    else:  # big_vision adds posemb to the patches only: fold the class row into the class token
        if "cls_token" in sd:
            w["cls"], pos = sd["cls_token"] + pos[:, :1], pos[:, 1:]
        w["pos_embedding"] = pos
    attn, ln2, mlp = (1, 2, 3) if layout == "vit_jax" else (0, 1, 0)
    blocks = []
    for i in range(len(model.blocks)):
        b = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        a = f"MultiHeadDotProductAttention_{attn}/"
        q, k, v = np.split(b["attn.qkv.weight"], 3)  # each (D_out, D_in)
        qb, kb, vb = np.split(b["attn.qkv.bias"], 3)
        blk = {
            "LayerNorm_0/scale": b["norm1.weight"],
            "LayerNorm_0/bias": b["norm1.bias"],
            f"LayerNorm_{ln2}/scale": b["norm2.weight"],
            f"LayerNorm_{ln2}/bias": b["norm2.bias"],
            a + "out/kernel": b["attn.proj.weight"].T.reshape(HEADS, D // HEADS, D),
            a + "out/bias": b["attn.proj.bias"],
        }
        for name, kern, bias in (("query", q, qb), ("key", k, kb), ("value", v, vb)):
            blk[f"{a}{name}/kernel"] = kern.T.reshape(D, HEADS, D // HEADS)
            blk[f"{a}{name}/bias"] = bias.reshape(HEADS, D // HEADS)
        for j in range(2):
            blk[f"MlpBlock_{mlp}/Dense_{j}/kernel"] = b[f"mlp.fc{j + 1}.weight"].T
            blk[f"MlpBlock_{mlp}/Dense_{j}/bias"] = b[f"mlp.fc{j + 1}.bias"]
        blocks.append(blk)
    for key in blocks[0]:
        if scan:
            w[f"Transformer/encoderblock/{key}"] = np.stack([blk[key] for blk in blocks])
        else:
            w.update({f"Transformer/encoderblock_{i}/{key}": blk[key] for i, blk in enumerate(blocks)})
    w.update(extra or {})
    np.savez(path, **{prefix + k: v for k, v in w.items()})
    return path


def assert_same(sd, ref):
    assert sorted(sd) == sorted(ref)
    for k in ref:
        assert sd[k].shape == ref[k].shape, k
        assert torch.equal(sd[k], ref[k]), k


# ---------------------------------------------------------------- reading


def test_vit_jax_npz_reads_back_to_the_timm_weights(tmp_path):
    model = tiny_vit()
    loaded = read_checkpoint(str(export_npz(model, tmp_path / "vit.npz")))
    assert (loaded.kind, loaded.meta) == ("npz", {})
    assert_same(loaded.state_dict, model.state_dict())


@pytest.mark.parametrize("prefix,scan", [("", False), ("params/", False), ("params/img/", True)])
def test_big_vision_gap_npz_reads_back(tmp_path, prefix, scan):
    model = gap_vit()
    path = export_npz(model, tmp_path / "bv.npz", layout="big_vision", prefix=prefix, scan=scan)
    assert_same(read_checkpoint(str(path)).state_dict, model.state_dict())


def test_big_vision_token_npz_gives_the_same_network(tmp_path):
    """big_vision adds posemb before prepending [cls]: read back as a zero class row, same outputs."""
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
    sd = read_checkpoint(str(path)).state_dict
    assert torch.equal(sd["pre_logits.fc.weight"], torch.from_numpy(kernel.T))
    assert torch.equal(sd["pre_logits.fc.bias"], torch.from_numpy(bias))


def test_npz_with_arrays_a_plain_vit_lacks_is_refused(tmp_path):
    path = export_npz(tiny_vit(), tmp_path / "map.npz", extra={"MAPHead_0/probe": np.zeros((1, 1, D))})
    with pytest.raises(CheckpointError, match="MAPHead_0/probe"):
        read_checkpoint(str(path))


def test_our_workdir_and_timm_safetensors(tmp_path):
    sd = tiny_vit().state_dict()
    spec = {
        "name": "custom",
        "img_size": 32,
        "patch_size": PATCH,
        "pos_embed": "learned_1d",
        "num_classes": 5,
    }
    save_weights(tmp_path / "run" / MODEL_FILE, sd, {"recipe": {"model": {"img_size": 32}}, "model": spec})
    ours = read_checkpoint(str(tmp_path / "run"))
    assert ours.kind == "vitcli" and ours.meta["model"] == spec
    assert_same(ours.state_dict, sd)
    save_file(sd, str(tmp_path / "timm.safetensors"), metadata={"format": "pt"})
    theirs = read_checkpoint(str(tmp_path / "timm.safetensors"))
    assert (theirs.kind, theirs.meta) == ("timm", {})
    assert_same(theirs.state_dict, sd)


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
    path, marker = tmp_path / name, tmp_path / "unpickled"
    payload = {"w": torch.zeros(2), "evil": _Payload(str(marker))}
    if how == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=4))
    else:
        torch.save(payload, path, _use_new_zipfile_serialization=how == "torch")
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(str(path))
    msg = str(e.value)
    assert "\n" not in msg and "weights_only=True" in msg and "save_file" in msg and str(path) in msg
    assert not marker.exists()


def test_other_files_are_an_unknown_format(tmp_path):
    import zipfile

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


def test_hub_names_fail_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = "timm/vit_tiny_patch16_224.augreg_in21k"
    with pytest.raises(CheckpointError, match=f"cannot download {name}: offline; pass a local file"):
        read_checkpoint(name)
    with pytest.raises(CheckpointError, match="not a file, a workdir or a timm model name"):
        read_checkpoint("no_such_model_anywhere")


# ---------------------------------------------------------------- fitting to a model


def _fit(sd, model, **kw):
    args = {"keep_head": False, "keep_representation": False, "method": "bilinear", **kw}
    out, rows = adapt_state_dict(sd, model, **args)
    model.load_state_dict(out, strict=True)
    return out, dict(rows)


def test_transfer_drops_head_and_resizes_posemb():
    src, model = (
        tiny_vit(img_size=32, num_classes=5).state_dict(),
        tiny_vit(img_size=48, num_classes=3, seed=1),
    )
    own_head = model.state_dict()["head.weight"].clone()
    out, rows = _fit(src, model)
    assert torch.equal(out["head.weight"], own_head)
    assert torch.equal(out["pos_embed"], resample_posemb(src["pos_embed"], (4, 4), (6, 6), 1, "bilinear"))
    assert torch.equal(out["blocks.1.attn.qkv.weight"], src["blocks.1.attn.qkv.weight"])
    assert (
        "dropped (5 classes)" in rows["head"] and "(1, 17, 32) -> (1, 37, 32)" in rows["position embedding"]
    )


def test_keeping_a_head_of_another_size_is_an_error():
    with pytest.raises(CheckpointError, match="dataset has 3 classes and the checkpoint head has 5"):
        _fit(tiny_vit(num_classes=5).state_dict(), tiny_vit(num_classes=3), keep_head=True)
    src = tiny_vit(num_classes=5).state_dict()
    out, _ = _fit(src, tiny_vit(num_classes=5, seed=1), keep_head=True)
    assert torch.equal(out["head.weight"], src["head.weight"])


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
    out, _ = _fit(src, _with_representation(tiny_vit(seed=1)), keep_representation=True)
    assert torch.equal(out["pre_logits.fc.weight"], src["pre_logits.fc.weight"])
    with pytest.raises(CheckpointError, match="no pre_logits layer"):
        _fit(tiny_vit().state_dict(), _with_representation(tiny_vit()), keep_representation=True)


def test_sincos_and_learned_2d_embeddings():
    model = tiny_vit(img_size=48)
    with torch.no_grad():
        model.pos_embed.copy_(torch.cat([torch.zeros(1, 1, D), sincos_2d((6, 6), D)], 1))
    out, _ = _fit(tiny_vit().state_dict(), model, pos_embed_kind="sincos_2d")
    assert torch.equal(out["pos_embed"][:, 1:], sincos_2d((6, 6), D))

    def two_tables(gh, gw):
        m = tiny_vit(img_size=8 * gh, pos_embed="none")
        m.pos_embed_row, m.pos_embed_col = (
            nn.Parameter(torch.randn(1, gh, D // 2)),
            nn.Parameter(torch.randn(1, gw, D // 2)),
        )
        return m

    src = two_tables(4, 4).state_dict()
    out, _ = _fit(src, two_tables(6, 6), pos_embed_kind="learned_2d")
    assert torch.equal(out["pos_embed_row"], resample_axis(src["pos_embed_row"], 6))


# ---------------------------------------------------------------- surgery


def test_resize_timm_file_loads_in_timm_at_the_new_size(tmp_path):
    src = tmp_path / "vit.safetensors"
    save_file(tiny_vit().state_dict(), str(src), metadata={"format": "pt"})
    rows = dict(resize_checkpoint(str(src), res=48, out=str(tmp_path / "vit48.safetensors")))
    assert rows["grid"].startswith("4x4 -> 6x6") and rows["pos_embed"] == "(1, 17, 32) -> (1, 37, 32)"
    sd = read_checkpoint(str(tmp_path / "vit48.safetensors")).state_dict
    tiny_vit(img_size=48).load_state_dict(sd, strict=True)
    # a non-square grid, and bicubic
    resize_checkpoint(str(src), new_grid=(6, 4), method="bicubic", out=str(tmp_path / "wide.safetensors"))
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
    spec = {"name": "custom", "img_size": 32, "patch_size": PATCH, "pos_embed": kind, "num_classes": 5}
    save_weights(tmp_path / "run" / MODEL_FILE, sd, {"recipe": {"model": {"img_size": 32}}, "model": spec})
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


def test_dry_run_writes_nothing(tmp_path):
    src = tmp_path / "vit.safetensors"
    save_file(tiny_vit().state_dict(), str(src))
    rows = dict(resize_checkpoint(str(src), res=48, out=None, dry_run=True))
    assert "dry run" in rows["output"] and sorted(os.listdir(tmp_path)) == ["vit.safetensors"]
    with pytest.raises(CheckpointError, match="exactly one"):
        resize_checkpoint(str(src), res=48, new_grid=(6, 6), out=None)
