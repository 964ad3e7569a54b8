"""Google's Flax ViT checkpoints (`.npz`, vit_jax and big_vision layouts) renamed to timm's names.

Flax Dense kernels are (in, out) and timm Linear weights (out, in); conv kernels HWIO vs OIHW;
attention q/k/v kernels (D, H, D/H) are flattened and stacked into timm's fused (3D, D) qkv. The
query kernel's middle axis is the number of heads, the one architecture fact a timm state dict
loses, so it is returned.

The vit_jax hybrid (R50+ViT-B/16) keeps its BiT ResNet beside `embedding/` and `Transformer/`:
`conv_root`, `gn_root`, then `block{i}/unit{j}/` bottlenecks (conv1-3 and gn1-3, conv_proj and
gn_proj where the shape changes). They become timm's `patch_embed.backbone.*` (HybridEmbed over a
ResNetV2), and `embedding/kernel` is then a 1x1 conv over the ResNet's channels; describe tells the
hybrid by those names.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vitcli.errors import CheckpointError

PREFIXES = ("", "opt/target/", "params/", "params/img/", "img/")  # vit_jax, old vit_jax, big_vision
POS_KEYS = ("Transformer/posembed_input/pos_embedding", "pos_embedding", "Transformer/pos_embedding")
QKV = ("query", "key", "value")


class _Arrays:
    """The arrays under one prefix; remembers which were read, so that leftovers can be refused."""

    def __init__(self, w: dict[str, np.ndarray], prefix: str, name: str):
        self.w, self.prefix, self.name, self.used = w, prefix, name, set()

    def has(self, key: str) -> bool:
        """Whether the array `key` (without the prefix) exists."""
        return self.prefix + key in self.w

    def get(self, key: str, idx: int | None = None) -> torch.Tensor:
        """Array `key` as float32; `idx` picks one block of a scan checkpoint's stacked arrays."""
        if not self.has(key):
            raise CheckpointError(f"{self.name}: missing array {self.prefix + key}")
        self.used.add(self.prefix + key)
        a = self.w[self.prefix + key]
        return torch.from_numpy(np.asarray(a if idx is None else a[idx], dtype=np.float32))

    def conv(self, key: str) -> torch.Tensor:
        """A Flax conv kernel (H, W, I, O) as timm's (O, I, H, W)."""
        kernel = self.get(key)
        if kernel.ndim != 4:
            raise CheckpointError(f"{self.name}: {self.prefix + key} has shape {tuple(kernel.shape)}, "
                                  "but a conv kernel is 4-D (H, W, in, out); the file is damaged")
        return kernel.permute(3, 2, 0, 1)

    def dense(self, key: str, idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A Flax Dense layer as timm's (weight (out, in), bias)."""
        return self.get(f"{key}/kernel", idx).T, self.get(f"{key}/bias", idx)

    def leftover(self) -> list[str]:
        """Arrays under the prefix that nothing read: parts neither a ViT nor its hybrid ResNet
        has."""
        return sorted(k for k in self.w if k.startswith(self.prefix) and k not in self.used)

    def count(self, pattern: str) -> int:
        """How many of pattern.format(1), pattern.format(2), ... exist; a gap ends the count
        (and is left over)."""
        n = 0
        while self.has(pattern.format(n + 1)):
            n += 1
        return n


def npz_to_timm(arrays: dict[str, np.ndarray], name: str = "npz") -> tuple[dict[str, torch.Tensor], int]:
    """Flattened Flax ViT params -> (timm VisionTransformer state dict, number of attention
    heads)."""
    prefix = next((p for p in PREFIXES if f"{p}embedding/kernel" in arrays), None)
    if prefix is None:
        raise CheckpointError(
            f"{name}: no embedding/kernel array, so not a ViT in vit_jax or big_vision layout"
        )
    a = _Arrays(arrays, prefix, name)
    sd = _stem(a)
    if a.has("conv_root/kernel"):
        sd.update(_resnet(a))
    blocks, num_heads = _blocks(a)
    sd.update(blocks)
    leftover = a.leftover()
    if leftover:
        raise CheckpointError(f"{name}: arrays outside a ViT and its hybrid ResNet: "
                              f"{', '.join(leftover[:3])}")
    return {k: v.contiguous() for k, v in sd.items()}, num_heads


def _stem(a: _Arrays) -> dict[str, torch.Tensor]:
    """Everything outside the encoder blocks: patch embedding, tokens, final norm, pre-logits,
    head."""
    sd = {
        # (D, C, ph, pw); hybrid (D, 1024, 1, 1)
        "patch_embed.proj.weight": a.conv("embedding/kernel"),
        "patch_embed.proj.bias": a.get("embedding/bias"),
        "norm.weight": a.get("Transformer/encoder_norm/scale"),
        "norm.bias": a.get("Transformer/encoder_norm/bias"),
    }
    if a.has("cls"):
        sd["cls_token"] = a.get("cls")  # (1, 1, D)
    pos_key = next((k for k in POS_KEYS if a.has(k)), None)  # absent for big_vision sincos2d
    if pos_key:
        sd["pos_embed"] = _pos_embed(a.get(pos_key), sd)
    for layer, key in (("head", "head"), ("pre_logits.fc", "pre_logits")):
        if a.has(f"{key}/kernel"):
            sd[f"{layer}.weight"], sd[f"{layer}.bias"] = a.dense(key)
    return sd


def _pos_embed(pos: torch.Tensor, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """The position table in timm's (1, prefix + N, D) layout."""
    pos = pos.reshape(1, -1, sd["patch_embed.proj.bias"].shape[0])  # (1, N or 1+N, D)
    n = pos.shape[1]
    if "cls_token" in sd and math.isqrt(n) ** 2 == n:
        # big_vision adds posemb before prepending [cls]; timm adds it after, so [cls] gets a zero
        # row
        pos = torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)
    return pos


def _blocks(a: _Arrays) -> tuple[dict[str, torch.Tensor], int]:
    """Encoder blocks and the head count; `scan` checkpoints stack all blocks with a leading depth
    axis."""
    scan_key = "Transformer/encoderblock/LayerNorm_0/scale"
    scan = a.has(scan_key)
    depth = len(a.w[a.prefix + scan_key]) if scan else 0
    while not scan and a.has(f"Transformer/encoderblock_{depth}/LayerNorm_0/scale"):
        depth += 1
    sd, num_heads = {}, 0
    for i in range(depth):
        bp, idx = ("Transformer/encoderblock/", i) if scan else (f"Transformer/encoderblock_{i}/", None)
        block, num_heads = _block(a, f"blocks.{i}.", bp, idx)
        sd.update(block)
    return sd, num_heads


def _block(a: _Arrays, t: str, bp: str, idx: int | None) -> tuple[dict[str, torch.Tensor], int]:
    """One encoder block under timm prefix `t`, and its head count (0 when the kernels are
    flattened)."""
    # vit_jax numbers submodules in call order (LN_0, MHDPA_1, LN_2, Mlp_3), big_vision per type
    attn, ln2, mlp = (1, 2, 3) if a.has(f"{bp}MultiHeadDotProductAttention_1/out/bias") else (0, 1, 0)
    at = f"{bp}MultiHeadDotProductAttention_{attn}/"
    qkv = [a.get(f"{at}{n}/kernel", idx) for n in QKV]  # each (D, H, D/H)
    out = a.get(at + "out/kernel", idx)  # (H, D/H, D)
    sd = {
        t + "norm1.weight": a.get(bp + "LayerNorm_0/scale", idx),
        t + "norm1.bias": a.get(bp + "LayerNorm_0/bias", idx),
        t + "attn.qkv.weight": torch.cat([k.flatten(1).T for k in qkv]),  # (3D, D)
        # (3D,)
        t + "attn.qkv.bias": torch.cat([a.get(f"{at}{n}/bias", idx).flatten() for n in QKV]),
        t + "attn.proj.weight": out.reshape(-1, out.shape[-1]).T,  # (D, D)
        t + "attn.proj.bias": a.get(at + "out/bias", idx),
        t + "norm2.weight": a.get(f"{bp}LayerNorm_{ln2}/scale", idx),
        t + "norm2.bias": a.get(f"{bp}LayerNorm_{ln2}/bias", idx),
    }
    for j in range(2):
        fc = f"{t}mlp.fc{j + 1}"
        sd[f"{fc}.weight"], sd[f"{fc}.bias"] = a.dense(f"{bp}MlpBlock_{mlp}/Dense_{j}", idx)
    return sd, qkv[0].shape[1] if qkv[0].ndim == 3 else 0


def _resnet(a: _Arrays) -> dict[str, torch.Tensor]:
    """The hybrid's BiT ResNet (root, then stages of bottleneck units) as timm's HybridEmbed
    backbone."""
    t = "patch_embed.backbone."
    sd = {t + "stem.conv.weight": a.conv("conv_root/kernel"), **_group_norm(a, t + "stem.norm", "gn_root")}
    for i in range(a.count("block{}/unit1/conv1/kernel")):
        for j in range(a.count(f"block{i + 1}/unit{{}}/conv1/kernel")):
            sd.update(_unit(a, f"{t}stages.{i}.blocks.{j}.", f"block{i + 1}/unit{j + 1}/"))
    return sd


def _unit(a: _Arrays, t: str, u: str) -> dict[str, torch.Tensor]:
    """One bottleneck (1x1, strided 3x3, 1x1 convs, each before a GroupNorm) and its projection
    shortcut."""
    sd = {}
    for r in (1, 2, 3):
        sd[f"{t}conv{r}.weight"] = a.conv(f"{u}conv{r}/kernel")
        sd.update(_group_norm(a, f"{t}norm{r}", f"{u}gn{r}"))
    if a.has(f"{u}conv_proj/kernel"):  # the first unit of a stage: its width or stride changes
        sd[f"{t}downsample.conv.weight"] = a.conv(f"{u}conv_proj/kernel")
        sd.update(_group_norm(a, f"{t}downsample.norm", f"{u}gn_proj"))
    return sd


def _group_norm(a: _Arrays, t: str, key: str) -> dict[str, torch.Tensor]:
    """A Flax GroupNorm's scale and bias, (C,); flattened, as some exports keep them (1, 1, 1,
    C)."""
    return {f"{t}.weight": a.get(f"{key}/scale").reshape(-1), f"{t}.bias": a.get(f"{key}/bias").reshape(-1)}
