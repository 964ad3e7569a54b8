"""Google's `.npz` checkpoints give the network timm's own `.npz` loader gives: the same logits.

The reference is timm's `_load_weights` (`VisionTransformer.load_pretrained`). A timm model with
random weights is written out here as flattened Flax params, by hand (the vit_jax / big_vision names
and transposes are spelled out below, independently of vitcli's mapping); timm loads that file into
a model of the same configuration whose weights were all changed first, and vitcli loads it the way
`vit finetune --init x.npz` and `vit eval-fewshot --ckpt x.npz` do, without being told the
architecture. Logits agree within 1e-5 (float32 on CPU; measured: exactly equal, both sides run the
same timm layers).

The hybrid is the paper's R50+ViT-B/16 at full width and depth (the name fixes its sizes, so vitcli
cannot build a smaller one), at 32 px (a 2x2 grid on the stride-16 ResNet): ~100M parameters, ~6 s
of CPU (more on a busy machine), most of it initialising the two models. The refusals use names and
ranks only, so they stay tiny.
"""

import numpy as np
import pytest
import timm
import torch

from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.describe import describe
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.transfer import load_for_eval, load_init
from vitcli.errors import CheckpointError
from vitcli.models.zoo import HYBRID, build_model
from vitcli.recipe.resolve import resolve
from vitcli.runtime import dist as dist_mod

ATOL = 1e-5  # float32 on CPU; both sides run the same timm layers, so only summation order may differ
K = 5  # classes of the checkpoint's head
IMG = 32


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Parameters that timm starts at constants (zero last GroupNorm gains, biases, norms, tokens)
    moved off them, so every array matters; dense and conv weights already start random."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim not in (2, 4):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def hwio(w: torch.Tensor) -> np.ndarray:
    """timm conv weight (O, I, H, W) -> Flax kernel (H, W, I, O)."""
    return w.numpy().transpose(2, 3, 1, 0)


def flax_block(sd: dict, t: str, heads: int, layout: str) -> dict[str, np.ndarray]:
    """One timm encoder block `t` as a Flax encoderblock's arrays (names relative to the block)."""
    attn, ln2, mlp = (1, 2, 3) if layout == "vit_jax" else (0, 1, 0)  # vit_jax counts all submodules
    a = f"MultiHeadDotProductAttention_{attn}/"
    dim = sd[t + "norm1.weight"].shape[0]
    w = {"LayerNorm_0/scale": sd[t + "norm1.weight"], "LayerNorm_0/bias": sd[t + "norm1.bias"],
         f"LayerNorm_{ln2}/scale": sd[t + "norm2.weight"], f"LayerNorm_{ln2}/bias": sd[t + "norm2.bias"],
         a + "out/kernel": sd[t + "attn.proj.weight"].T.reshape(heads, dim // heads, dim),  # (H, D/H, D)
         a + "out/bias": sd[t + "attn.proj.bias"]}
    qkv_w, qkv_b = sd[t + "attn.qkv.weight"].chunk(3), sd[t + "attn.qkv.bias"].chunk(3)  # (D, D), (D,) each
    for name, kernel, bias in zip(("query", "key", "value"), qkv_w, qkv_b):
        w[f"{a}{name}/kernel"] = kernel.T.reshape(dim, heads, dim // heads)  # (D, H, D/H)
        w[f"{a}{name}/bias"] = bias.reshape(heads, dim // heads)
    for j in range(2):
        w[f"MlpBlock_{mlp}/Dense_{j}/kernel"] = sd[f"{t}mlp.fc{j + 1}.weight"].T  # (in, out)
        w[f"MlpBlock_{mlp}/Dense_{j}/bias"] = sd[f"{t}mlp.fc{j + 1}.bias"]
    return {k: np.asarray(v) for k, v in w.items()}


def flax_vit(model, layout: str = "vit_jax", scan: bool = False) -> dict[str, np.ndarray]:
    """A timm VisionTransformer's patch embedding, tokens, blocks, final norm and head as Flax
    arrays."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    w = {"embedding/kernel": hwio(sd["patch_embed.proj.weight"]),
         "embedding/bias": sd["patch_embed.proj.bias"],
         "Transformer/encoder_norm/scale": sd["norm.weight"],
         "Transformer/encoder_norm/bias": sd["norm.bias"],
         "head/kernel": sd["head.weight"].T, "head/bias": sd["head.bias"]}
    if "cls_token" in sd:
        w["cls"] = sd["cls_token"]  # (1, 1, D)
    pos_key = "Transformer/posembed_input/pos_embedding" if layout == "vit_jax" else "pos_embedding"
    w[pos_key] = sd["pos_embed"]  # (1, [1 +] N, D)
    heads = model.blocks[0].attn.num_heads
    blocks = [flax_block(sd, f"blocks.{i}.", heads, layout) for i in range(len(model.blocks))]
    for key in blocks[0]:
        if scan:  # big_vision's scanned encoder stacks every block's array on a leading depth axis
            w[f"Transformer/encoderblock/{key}"] = np.stack([b[key] for b in blocks])
        else:
            w.update({f"Transformer/encoderblock_{i}/{key}": b[key] for i, b in enumerate(blocks)})
    return {k: np.asarray(v) for k, v in w.items()}


def flax_resnet(model) -> dict[str, np.ndarray]:
    """The hybrid's ResNetV2 as vit_jax names it: conv_root, gn_root,
    block{i}/unit{j}/{conv,gn}{1,2,3,_proj}."""
    backbone = model.patch_embed.backbone
    w = {"conv_root/kernel": hwio(backbone.stem.conv.weight.detach()),
         "gn_root/scale": backbone.stem.norm.weight, "gn_root/bias": backbone.stem.norm.bias}
    for i, stage in enumerate(backbone.stages):
        for j, unit in enumerate(stage.blocks):
            u = f"block{i + 1}/unit{j + 1}/"
            parts = [(f"conv{r}", f"gn{r}", getattr(unit, f"conv{r}"), getattr(unit, f"norm{r}"))
                     for r in (1, 2, 3)]
            if unit.downsample is not None:
                parts.append(("conv_proj", "gn_proj", unit.downsample.conv, unit.downsample.norm))
            for conv, gn, conv_layer, norm in parts:
                w[f"{u}{conv}/kernel"] = hwio(conv_layer.weight.detach())
                w[f"{u}{gn}/scale"], w[f"{u}{gn}/bias"] = norm.weight, norm.bias
    return {k: np.asarray(v.detach() if torch.is_tensor(v) else v) for k, v in w.items()}


def timm_loaded(path, model: torch.nn.Module) -> torch.nn.Module:
    """`model`, exported to `path`, with every weight negated and then loaded by timm's own .npz
    loader: whatever that loader leaves out keeps a value unrelated to the file, as in a fresh model
    (negated, not re-drawn, because drawing 100M numbers is slow; weight standardisation removes
    shifts, not signs)."""
    with torch.no_grad():
        for p in model.parameters():
            p.neg_()
    model.load_pretrained(str(path))
    return model.eval()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """(npz path, timm's model loaded from it) for R50+ViT-B/16 with a 5-way head."""
    model = randomized(timm.create_model("vit_base_r50_s16_224", pretrained=False, img_size=IMG,
                                         num_classes=K), 0)
    path = tmp_path_factory.mktemp("hybrid") / "R50+ViT-B_16.npz"
    np.savez(path, **flax_vit(model), **flax_resnet(model))
    return path, timm_loaded(path, model)


@pytest.fixture(scope="module")
def hybrid_names():
    """The hybrid's array names, each a zero array of its rank (1, ..., 1): the refusals look at
    names and ranks only, and 100M floats would only slow them down."""
    model = timm.create_model("vit_base_r50_s16_224", embed_dim=64, depth=1, num_heads=2, num_classes=K)
    return {k: np.zeros((1,) * v.ndim) for k, v in {**flax_vit(model), **flax_resnet(model)}.items()}


def logits_gap(ours: torch.nn.Module, theirs: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(x) - theirs(x)).abs().max().item()


# ---------------------------------------------------------------- the hybrid


def test_hybrid_npz_finetunes_from_timms_logits(hybrid):
    """`vit finetune --init x.npz` with the head kept: the network timm's loader builds, logit for
    logit."""
    path, theirs = hybrid
    r = resolve("finetune", None, [f"init.checkpoint={path}", f"model.img_size={IMG}", "init.keep_head=true"],
                complete=complete, inputs=False)
    assert (r.model.name, r.model.img_size, r.model.num_heads) == (HYBRID, IMG, 12)  # nobody named it
    ours = build_model(r.model, K).eval()
    x = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))
    before = logits_gap(ours, theirs, x)
    rows = dict(load_init(ours, r, K, dist_mod.setup("cpu")))
    assert rows["head"] == f"kept ({K} classes)" and rows["loaded"].startswith(f"{len(ours.state_dict())} of")
    gap = logits_gap(ours, theirs, x)
    print(f"hybrid max |logit diff| = {gap:.3g} (before loading: {before:.3g})")
    assert gap <= ATOL < before  # the load, not the init, made them agree


def test_hybrid_npz_is_described_as_the_hybrid_at_its_native_resolution(hybrid):
    """`vit eval-fewshot --ckpt x.npz`: the R50 hybrid at the grid x 16 px its position table
    spans."""
    path = hybrid[0]
    spec = describe(read_checkpoint(str(path)))
    assert (spec.name, spec.patch_size, spec.grid, spec.img_size) == (HYBRID, 16, (2, 2), IMG)
    assert (spec.num_heads, spec.heads_from, spec.num_classes) == (12, "attention kernels", K)
    r = resolve("eval-fewshot", None, [f"init.checkpoint={path}", "fewshot.tasks=synthetic"],
                complete=complete)
    assert (r.model.name, r.model.img_size, r.model.num_classes) == (HYBRID, IMG, 0)


def save_with(tmp_path, arrays: dict, drop: str = "", **extra) -> str:
    path = tmp_path / "edited.npz"
    np.savez(path, **{k: v for k, v in arrays.items() if k != drop}, **extra)
    return str(path)


def test_the_refusals_below_start_from_a_file_that_reads(tmp_path, hybrid_names):
    """Zero arrays with the hybrid's names and ranks read as the hybrid:
    each refusal below is its one edit."""
    loaded = read_checkpoint(save_with(tmp_path, hybrid_names))
    assert describe(loaded).name == HYBRID


def test_a_hybrid_with_another_resnet_is_not_taken_for_r50(tmp_path, hybrid_names):
    """Stage 3 cut to 6 units (the first stages of R50+ViT-L/32's ResNet): the file reads, but its
    network is not one vitcli builds from the file alone, so the architecture asks for
    model.name."""
    shorter = {k: v for k, v in hybrid_names.items() if not k.startswith(("block3/unit7/", "block3/unit8/",
                                                                         "block3/unit9/"))}
    spec = describe(read_checkpoint(save_with(tmp_path, shorter)))
    assert (spec.name, spec.patch_size) == ("", 0)
    with pytest.raises(CheckpointError, match="set model.name"):
        spec.architecture()


@pytest.mark.parametrize("array", ["block2/unit1/conv4/kernel",  # no such layer in a unit
                                   "block3/unit11/conv1/kernel"])  # after a gap: unit10 is missing
def test_hybrid_npz_with_an_unknown_array_is_refused_by_name(tmp_path, hybrid_names, array):
    with pytest.raises(CheckpointError, match=f"hybrid ResNet: {array}$"):
        read_checkpoint(save_with(tmp_path, hybrid_names, **{array: np.zeros((1, 1, 64, 64))}))


@pytest.mark.parametrize("array", ["block2/unit1/gn_proj/bias", "block3/unit9/conv3/kernel", "gn_root/scale"])
def test_hybrid_npz_missing_a_resnet_array_names_it(tmp_path, hybrid_names, array):
    with pytest.raises(CheckpointError, match=f"missing array {array}$") as err:
        read_checkpoint(save_with(tmp_path, hybrid_names, drop=array))
    assert "\n" not in str(err.value)


def test_hybrid_npz_with_a_truncated_kernel_names_it(tmp_path, hybrid_names):
    """A conv kernel that lost its axes is named with its shape, not met by a permute error."""
    kernel = "block1/unit2/conv2/kernel"  # (3, 3, 64, 64) in the real file
    path = save_with(tmp_path, hybrid_names, drop=kernel, **{kernel: np.zeros((3, 64, 64))})
    with pytest.raises(CheckpointError, match=rf"{kernel} has shape \(3, 64, 64\)") as err:
        read_checkpoint(path)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- plain ViTs


PLAIN = {"img_size": IMG, "depth": 2, "embed_dim": 64, "num_heads": 4, "num_classes": K}  # vit_tiny, smaller


@pytest.mark.parametrize("layout,scan,gap", [("vit_jax", False, False), ("big_vision", False, True),
                                             ("big_vision", True, True)])
def test_plain_npz_gives_timms_logits(tmp_path, layout, scan, gap):
    """vit_tiny_patch16_224-shaped (smaller), as `vit eval-fewshot --ckpt x.npz` loads it: the
    pre-logits with the file's head applied equal timm's logits. big_vision's gap models: no class
    token, and the final LayerNorm before the average (timm fc_norm=False)."""
    kwargs = {**PLAIN, **({"class_token": False, "global_pool": "avg", "fc_norm": False} if gap else {})}
    model = randomized(timm.create_model("vit_tiny_patch16_224", pretrained=False, **kwargs), 2)
    arrays = flax_vit(model, layout, scan)
    path = tmp_path / "vit.npz"
    np.savez(path, **arrays)
    theirs = timm_loaded(path, model)
    r = resolve("eval-fewshot", None, [f"init.checkpoint={path}", "fewshot.tasks=synthetic"],
                complete=complete)
    assert (r.model.name, r.model.embed_dim, r.model.depth, r.model.num_heads) == ("custom", 64, 2, 4)
    assert r.model.pool == ("gap" if gap else "token")
    features = load_for_eval(r)
    x = torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(3))
    head_w, head_b = (torch.from_numpy(arrays[f"head/{k}"]) for k in ("kernel", "bias"))  # (D, K), (K,)
    with torch.no_grad():
        gap_ = (features(x) @ head_w + head_b - theirs(x)).abs().max().item()
    print(f"plain {layout}{' scan' if scan else ''} max |logit diff| = {gap_:.3g}")
    assert gap_ <= ATOL
