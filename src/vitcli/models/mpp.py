"""Masked patch prediction (ViT paper, Dosovitskiy et al. 2021, Appendix B.1.2): the maths, the
network that learns it (`MppModel`) and its loss on one batch (`mpp_step`), together as MAE's
models_mae.py keeps its own.

Per image, round(ratio * N) of the N patch embeddings are corrupted (ratio 0.5 in the paper); of
those, 80% are replaced by a learned [mask] embedding, 10% by the embedding of a random other patch
of the batch and 10% are left as they are (BERT's recipe). The loss is computed on the corrupted
patches only, against one of three targets (`MPP_TARGETS`, vitcli.recipe.choices):

- `mean_color` (the paper's final choice): the patch's mean colour at 3 bits per channel, one
512-way softmax;
- `color_4x4`: that mean colour plus the 4x4 average-pooled patch, 1 + 16 softmaxes of 512 classes
each;
- `pixels_l2`: the full patch in [-1, 1], regressed with L2.

Conventions, used throughout:
- images are (B, 3, H, W) floats in [-1, 1] (pixel / 127.5 - 1); v = (x + 1) / 2 puts a value in [0,
1];
- patches are numbered row-major over the (H/P, W/P) grid, the order of timm's PatchEmbed tokens;
- a channel value v in [0, 1] has level min(floor(v * 8), 7): level k covers [k/8, (k+1)/8) and 1.0
is level
  7 (values a rounding error outside [0, 1] clamp to 0 or 7); a colour's bin is r * 64 + g * 8 + b;
- `mode` (B, N) int8 codes each patch: 0 untouched, 1 [mask], 2 random other patch, 3 corrupted but
unchanged.
  Every random draw comes from a caller's torch.Generator, so a run repeats and resumes exactly.
- nothing here reads a device tensor back on the host (no boolean indexing, no `if tensor`) but the
  empty-mask check of `mpp_loss`, which a caller can skip: on a GPU such a read waits for all queued
  work.

`MppModel` wraps the ViT the run exports: a learned [mask] embedding replaces patch embeddings
before the position embedding is added (so a masked patch still knows where it is), and a linear
head reads each patch's output token. Its targets are read from the pixels as the paper's [-1, 1]
whatever data.mean and data.std normalised them to (the colour bins are of (x + 1) / 2). Only the
ViT (`backbone`) is exported to model.safetensors; the wrapper hands `forward_features` /
`forward_head` through, so few-shot evaluation during pretraining sees the backbone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from vitcli.errors import RecipeError
from vitcli.recipe.choices import MPP_CELLS, MPP_TARGETS
from vitcli.recipe.schema import MppConfig

BITS = 3  # per channel, as in the paper: 8 levels, 512 colours
NUM_BINS = 2 ** (3 * BITS)
UNTOUCHED, MASK, RANDOM, UNCHANGED = 0, 1, 2, 3
SIGNED = (0.5, 0.5, 0.5)  # mean = std = 0.5: the normalisation that leaves pixels in [-1, 1]


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """Map values in [-1, 1] to [0, 1]: v = (x + 1) / 2."""
    return (images + 1) / 2


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C, P, P), patches row-major over the grid like timm's PatchEmbed
    tokens."""
    b, c, h, w = images.shape
    if h % patch or w % patch:
        raise RecipeError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    grid = images.reshape(b, c, h // patch, patch, w // patch, patch)  # (B, C, gh, P, gw, P)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c, patch, patch)


def quantise(values01: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """Levels min(floor(v * 2^bits), 2^bits - 1) (int64) of values in [0, 1]; 1.0 is the top
    level."""
    levels = 2**bits
    return (values01 * levels).floor().clamp(0, levels - 1).long()


def color_bins(rgb01: torch.Tensor, bits: int = BITS) -> torch.Tensor:
    """(..., 3) colours in [0, 1] -> (...) bins r * 2^(2 bits) + g * 2^bits + b; for 3 bits r*64 +
    g*8 + b."""
    q = quantise(rgb01, bits)
    return (q[..., 0] << (2 * bits)) + (q[..., 1] << bits) + q[..., 2]


def mean_color_target(patches: torch.Tensor) -> torch.Tensor:
    """(B, N, 3, P, P) in [-1, 1] -> (B, N) int64: the bin of each patch's mean colour."""
    return color_bins(to_unit(patches.mean(dim=(-2, -1))))


def pooled_cells(patches: torch.Tensor, cells: int = MPP_CELLS) -> torch.Tensor:
    """(B, N, 3, P, P) -> (B, N, cells * cells, 3): the patch
    average-pooled to a cells x cells grid, row-major."""
    b, n, c, p = patches.shape[:4]
    if p % cells:
        raise RecipeError(f"the color_4x4 target needs a patch size divisible by {cells}, got patch size {p}")
    side = p // cells
    # (B, N, 3, cells, cells)
    pooled = patches.reshape(b, n, c, cells, side, cells, side).mean(dim=(-3, -1))
    return pooled.flatten(-2).transpose(-1, -2)


def color_4x4_target(patches: torch.Tensor) -> torch.Tensor:
    """(B, N, 3, P, P) -> (B, N, 17) int64: [mean-colour bin,
    bins of the 16 cells of the 4x4 pooled patch]."""
    cells = color_bins(to_unit(pooled_cells(patches)))  # (B, N, 16)
    return torch.cat([mean_color_target(patches)[..., None], cells], dim=-1)


def pixels_target(patches: torch.Tensor) -> torch.Tensor:
    """(B, N, 3, P, P) -> (B, N, 3*P*P) in [-1, 1], channel-major then row-major (F.unfold's
    layout)."""
    return patches.flatten(2)


def make_target(patches: torch.Tensor, kind: str) -> torch.Tensor:
    """The `kind` target of (B, N, 3, P, P) patches: (B, N), (B, N, 17) or (B, N, 3*P*P)."""
    check_kind(kind)
    targets = {"mean_color": mean_color_target, "color_4x4": color_4x4_target, "pixels_l2": pixels_target}
    return targets[kind](patches)


def pred_shape(kind: str, patch: int) -> tuple[int, ...]:
    """What the prediction head outputs per patch for `kind`: (512,), (17, 512) or (3*P*P,)."""
    check_kind(kind)
    if kind == "pixels_l2":
        return (3 * patch * patch,)
    return (1 + MPP_CELLS * MPP_CELLS, NUM_BINS) if kind == "color_4x4" else (NUM_BINS,)


def check_kind(kind: str) -> None:
    """A RecipeError unless `kind` is one of MPP_TARGETS."""
    if kind not in MPP_TARGETS:
        raise RecipeError(f"masked-patch-prediction target '{kind}': expected one of "
                          f"{', '.join(MPP_TARGETS)}")


def _check_fractions(ratio: float, mask: float, random: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise RecipeError(f"corruption ratio {ratio}: expected a fraction in (0, 1]")
    if mask < 0 or random < 0 or mask + random > 1:
        raise RecipeError(f"mask {mask} + random {random}: "
                          "expected non-negative fractions summing to at most 1")


def corruption(
    batch: int,
    num_patches: int,
    generator: torch.Generator,
    ratio: float = 0.5,
    mask: float = 0.8,
    random: float = 0.1,
) -> torch.Tensor:
    """Draw which patches to corrupt and how: `mode` (B, N) int8 on the generator's device.

    Exactly k = round(ratio * N) >= 1 patches per image are corrupted (Python's round: half to even,
    so 49 patches -> 24), a uniformly random k-subset; each corrupted patch independently becomes 1
    [mask] with probability `mask`, 2 random with probability `random`, else 3 unchanged. The number
    of draws does not depend on their values, so the generator's state after the call is a function
    of its state before.
    """
    _check_fractions(ratio, mask, random)
    k, device = round(ratio * num_patches), generator.device
    # checked here, on the host, so that the loss need not check for an empty mask on the device
    if k == 0:
        raise RecipeError(f"corruption ratio {ratio} of {num_patches} patches corrupts none of them; "
                          f"expected more than {0.5 / num_patches:.3g}")
    # the k smallest of N iid uniforms sit at a uniformly random k-subset; float64 makes ties
    # negligible
    order = torch.rand(batch, num_patches, generator=generator, dtype=torch.float64,
                       device=device).argsort(dim=1)
    corrupted = torch.zeros(batch, num_patches, dtype=torch.bool, device=device)
    corrupted.scatter_(1, order[:, :k], True)
    u = torch.rand(batch, num_patches, generator=generator, dtype=torch.float64, device=device)
    how = torch.full((batch, num_patches), UNCHANGED, dtype=torch.int8, device=device)
    # not how[u < ...] = ...: a mask index reads the mask
    how = torch.where(u < mask + random, RANDOM, how)
    how = torch.where(u < mask, MASK, how)
    return torch.where(corrupted, how, UNTOUCHED)


def other_patches(batch: int, num_patches: int, generator: torch.Generator) -> torch.Tensor:
    """(B*N,) int64: for each patch of the batch (flat index), a uniformly drawn other patch of the
    batch (any image, never itself), on the generator's device; `corrupt` copies it where mode is
    2."""
    if batch * num_patches < 2:
        raise ValueError("a random other patch needs at least 2 patches in the batch")
    own = torch.arange(batch * num_patches, device=generator.device)
    # uniform over the B*N - 1 other patches: draw among B*N - 1 indices, then step over our own
    other = torch.randint(batch * num_patches - 1, (batch * num_patches,), generator=generator,
                          device=generator.device)
    return other + (other >= own)


def corrupt(tokens: torch.Tensor, mode: torch.Tensor, mask_token: torch.Tensor, other: torch.Tensor
            ) -> torch.Tensor:
    """Apply `mode` (B, N) to patch embeddings (B, N, D): 1 -> mask_token (D,), 2 -> the embedding
    of patch `other` (`other_patches`, (B*N,) flat indices).

    That replacement is detached: it is input noise, so every token's gradient comes only through
    its own position, while mask_token gets the summed gradient of all mode-1 positions. No random
    draw here: the caller draws (`corruption`, `other_patches`) outside a compiled forward, which a
    torch.Generator breaks.
    """
    b, n, d = tokens.shape
    # (B, N, D)
    replacement = tokens.detach().reshape(b * n, d)[other.to(tokens.device)].reshape(b, n, d)
    mode = mode.to(tokens.device)[..., None]  # (B, N, 1), broadcasts over D
    out = torch.where(mode == RANDOM, replacement, tokens)
    return torch.where(mode == MASK, mask_token.to(tokens.dtype), out)


def mean_color_of_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """(..., 3*P*P) flattened patches in [-1, 1] (`pixels_target`'s layout) -> (...) bins of their
    mean colour."""
    return color_bins(to_unit(pixels.unflatten(-1, (3, -1)).mean(dim=-1)))


def _check_shapes(pred: torch.Tensor, target: torch.Tensor, corrupted: torch.Tensor, kind: str) -> None:
    check_kind(kind)
    expected = target.shape if kind == "pixels_l2" else (*target.shape, NUM_BINS)
    if pred.shape != expected or corrupted.shape != target.shape[:2]:
        raise ValueError(f"{kind}: pred {tuple(pred.shape)}, target {tuple(target.shape)}, corrupted "
                         f"{tuple(corrupted.shape)}; expected pred {tuple(expected)} and corrupted (B, N)")


def mpp_loss(
    pred: torch.Tensor, target: torch.Tensor, corrupted: torch.Tensor, kind: str, *, nonempty: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, accuracy) over the corrupted patches only; both float32 scalars.

    pred: (B, N, 512) logits for mean_color, (B, N, 17, 512) for color_4x4 (unflatten a flat head
    output with `pred_shape`), (B, N, 3*P*P) pixels for pixels_l2; target from `make_target`;
    corrupted (B, N) bool. Loss: cross-entropy averaged over the corrupted patches (and, for
    color_4x4, equally over the 17 predictions), or the squared error averaged over the corrupted
    patches' 3*P*P values. Accuracy: the mean-colour bin is right (for pixels_l2 the bin of the
    predicted patch's mean colour).

    Every patch is scored and the uncorrupted ones are zeroed before the mean (no boolean indexing:
    its shape depends on the mask's values). An empty mask is a ValueError, which reads the mask on
    the host; `nonempty`: the caller knows it is not (`corruption` corrupts at least one patch per
    image), so nothing is read back and on a GPU the step does not wait for its forward pass.
    """
    _check_shapes(pred, target, corrupted, kind)
    if not nonempty and not corrupted.any():
        raise ValueError("no corrupted patch: the masked-patch-prediction loss would be empty")
    pred, count = pred.float(), corrupted.sum()

    def mean(per_patch: torch.Tensor) -> torch.Tensor:  # (B, N) -> mean over the corrupted patches
        return torch.where(corrupted, per_patch.float(), 0.0).sum() / count

    if kind == "pixels_l2":
        hit = mean_color_of_pixels(pred) == mean_color_of_pixels(target)
        return mean((pred - target.float()).square().mean(dim=-1)), mean(hit)
    loss = F.cross_entropy(pred.reshape(-1, NUM_BINS), target.reshape(-1), reduction="none")
    guess = pred.argmax(dim=-1)  # (B, N) or (B, N, 17)
    hit = guess == target if kind == "mean_color" else guess[..., 0] == target[..., 0]
    return mean(loss.reshape(target.shape[:2] + (-1,)).mean(dim=-1)), mean(hit)


class MppModel(nn.Module):
    """A ViT plus the [mask] embedding and per-patch prediction head of masked patch prediction."""

    def __init__(self, backbone: nn.Module, cfg: MppConfig, patch_size: int,
                 mean: Sequence[float] = SIGNED, std: Sequence[float] = SIGNED):
        super().__init__()
        self.backbone, self.cfg, self.patch_size = backbone, cfg, patch_size
        # normalised x -> x / 127.5 - 1 of its pixel: x * 2 std + (2 mean - 1), per channel (2, 1,
        # 3, 1, 1)
        signed = torch.tensor([[2 * s for s in std], [2 * m - 1 for m in mean]]).view(2, 1, 3, 1, 1)
        # on the model's device, in no checkpoint
        self.register_buffer("signed", signed, persistent=False)
        dim = backbone.embed_dim
        self.mask_token = nn.Parameter(trunc_normal_(torch.empty(dim), std=0.02))  # (D,)
        self.pred_shape = pred_shape(cfg.target, patch_size)
        self.head = nn.Linear(dim, math.prod(self.pred_shape))

    def forward(self, images: torch.Tensor, mode: torch.Tensor, other: torch.Tensor):
        """(pred, target) for normalised images (B, 3, H, W) corrupted as drawn (`mode` (B, N) from
        corruption, `other` (B*N,) from other_patches: mpp_step draws them)."""
        b = self.backbone
        tokens = b.patch_embed(images)  # (B, N, D)
        x = b._pos_embed(corrupt(tokens, mode, self.mask_token, other))  # (B, P+N, D)
        x = b.norm(b.blocks(b.norm_pre(b.patch_drop(x))))
        out = x[:, b.num_prefix_tokens:]  # (B, N, D): the patches' own output tokens
        pred = self.head(out).unflatten(-1, self.pred_shape)
        pixels = torch.addcmul(self.signed[1], images, self.signed[0])  # (B, 3, H, W) in [-1, 1]
        return pred, make_target(patchify(pixels, self.patch_size), self.cfg.target)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens: evaluators read the ViT, not the pretext head."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The backbone's head (pre-logits for few-shot)."""
        return self.backbone.forward_head(x, pre_logits=pre_logits)


def mpp_step(model: nn.Module, images: torch.Tensor, seed: int, cfg: MppConfig, patch_size: int):
    """(loss, mean-colour accuracy) of one masked-patch-prediction batch of `model` (an MppModel,
    maybe wrapped: DDP, torch.compile); `seed` fixes the corruption draws.

    The draws are made here, eagerly, and handed to the model as tensors: a torch.Generator inside a
    compiled forward breaks its graph at every draw. Nothing in the step reads a device value back
    on the host."""
    b, _, h, w = images.shape
    # (patchify refuses a size P does not divide)
    num_patches = (h // patch_size) * (w // patch_size)
    generator = torch.Generator(device=images.device).manual_seed(seed)
    mode = corruption(b, num_patches, generator, cfg.corrupt_ratio, cfg.mask_prob, cfg.random_prob)
    pred, target = model(images, mode, other_patches(b, num_patches, generator))
    return mpp_loss(pred.float(), target, mode > 0, cfg.target, nonempty=True)
