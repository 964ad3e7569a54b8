"""Masked autoencoders (He et al., CVPR 2022; facebookresearch/mae models_mae.py): the maths, the
decoder, the network that learns them (`MaeModel`) and its loss on one batch (`mae_step`), together
as models_mae.py keeps them.

Per image, `keep` = int(N (1 - mask_ratio)) of the N patches are kept (49 of 196 at 0.75, the
paper's), the encoder (the run's own timm ViT, `MaeModel` below) reads only those, and the decoder
below puts a learned [mask] token at every removed patch, adds its fixed position table and predicts
each patch's pixels. The loss is the squared error averaged over each patch's values, then over the
removed patches only.

Conventions, used throughout:
- images are (B, 3, H, W) as the model is fed them, normalised by data.mean and data.std: MAE's
targets are
  patches of that normalised image (ImageNet's mean and std in the reference), not of the raw
  pixels;
- patches are numbered row-major over the (H/P, W/P) grid, the order of timm's PatchEmbed tokens; a
patch's
  P*P*3 values are (row, column, channel) with the channel last, MAE's `patchify`
  ('nchpwq->nhwpqc');
- `noise` (B, N) orders each image's patches: the `keep` with the smallest noise are kept (MAE's
  `random_masking`, argsort of uniform noise). The noise is a pure function of (run seed, the
  image's index in the run, the patch): `mask_noise`, so an image gets its mask whichever
  micro-batch, rank or resumed process computes it.

`MaeModel` wraps the run's ViT: its own patch embedding, blocks and norm encode the visible patches
only (gathered, not masked in place), `MaeDecoder` reconstructs every patch, and only the ViT is
exported; the decoder lives in the training state.
"""

from __future__ import annotations

import functools

import torch
from timm.models.vision_transformer import Block
from torch import nn

from vitcli.errors import RecipeError
from vitcli.recipe.schema import MaeConfig

NORM_PIX_EPS = 1e-6  # MAE's forward_loss: (target - mean) / (var + 1e-6) ** 0.5
# MAE's norm_layer, partial(nn.LayerNorm, eps=1e-6); transformers' ViTMAE's: 1e-12
LAYER_NORM_EPS = 1e-6
MLP_RATIO = 4  # MAE's decoder MLP is 4 x its width, as in every model it ships
MASK32 = 0xFFFFFFFF


def sincos_table(grid: tuple[int, int], dim: int, prefix: int = 1) -> torch.Tensor:
    """(1, prefix + gh*gw, dim) float32: MAE's fixed 2-D sin-cos table (`get_2d_sincos_pos_embed`),
    zero rows for the prefix (class) tokens first.

    Features [sin(x w), cos(x w), sin(y w), cos(y w)], x the column and y the row, each dim/4 wide,
    with w_k = 10000^(-k / (dim/4)), k < dim/4: MAE's layout (its `emb_h` reads the column;
    transformers' ViTMAE rotates its canonical table to match). big_vision's sincos_2d
    (models.posemb) divides by dim/4 - 1."""
    if dim % 4:
        raise RecipeError(f"MAE's sin-cos position table needs a width divisible by 4, got {dim}")
    gh, gw = grid
    y, x = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                          indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))  # (D/4,)
    xw, yw = x.reshape(-1, 1) * omega, y.reshape(-1, 1) * omega  # (N, D/4) each
    table = torch.cat([xw.sin(), xw.cos(), yw.sin(), yw.cos()], dim=1)  # (N, D)
    return torch.cat([torch.zeros(prefix, dim, dtype=torch.float64), table]).float()[None]


def keep_count(num_patches: int, mask_ratio: float) -> int:
    """How many of N patches the encoder sees: int(N (1 - mask_ratio)), MAE's `len_keep` (49 of
    196)."""
    return int(num_patches * (1 - mask_ratio))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) (int64), in halves so that no product passes 2^49: no
    overflow."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash, a bijection of [0, 2^32) that mixes every input bit
    into every output bit (https://nullprogram.com/blog/2018/07/31/)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def mask_noise(seed: int, samples: torch.Tensor, num_patches: int) -> torch.Tensor:
    """(B, N) float64 in [0, 1): the noise of image `samples[b]` (int64, its index in the run) at
    patch n.

    A counter-based draw: 53 bits of a hash of (seed, sample, patch), in integer arithmetic that
    gives the same bits on every device, so no generator state has to follow an image from one
    process to another. Each word is absorbed by a bijection (xor with a constant of its own, then
    _mix32), so an image's N patches get N distinct leading 32 bits: no ties for the argsort."""
    seed_lo, seed_hi = seed & MASK32, (seed >> 32) & MASK32
    samples = samples.to(torch.int64)[:, None]  # (B, 1)
    patch = torch.arange(num_patches, dtype=torch.int64, device=samples.device)[None]  # (1, N)
    # constants: the hex digits of pi, nothing up the sleeve
    h = _mix32(patch ^ seed_lo ^ 0x243F6A88)
    h = _mix32(h ^ (samples & MASK32) ^ 0x85A308D3)
    h = _mix32(h ^ ((samples >> 32) & MASK32) ^ seed_hi ^ 0x13198A2E)  # (B, N), 32 bits
    low = _mix32(h ^ 0x03707344)  # 32 more bits, of which 21 fill the float64's mantissa
    return ((h << 21) + (low >> 11)).double() / 2.0**53


def random_masking(noise: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_keep (B, keep), ids_restore (B, N), mask (B, N) float: 1 removed, 0 kept) from noise (B,
    N), as MAE's random_masking: the patches in ascending noise, the first `keep` kept; ids_restore
    puts the shuffled sequence back in grid order."""
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    # (N,) in shuffled order
    removed = (torch.arange(noise.shape[1], device=noise.device) >= keep).float()
    mask = torch.gather(removed.expand(noise.shape[0], -1), 1, ids_restore)
    return ids_shuffle[:, :keep], ids_restore, mask


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, N, D) tokens -> (B, K, D) at the indices ids (B, K)."""
    return torch.gather(x, 1, ids[..., None].expand(-1, -1, x.shape[-1]))


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, P*P*C): MAE's layout, each patch's values row, column, then
    channel."""
    b, c, h, w = images.shape
    grid = images.reshape(b, c, h // patch, patch, w // patch, patch)  # (B, C, gh, P, gw, P)
    return grid.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // patch) * (w // patch), patch * patch * c)


def unpatchify(patches: torch.Tensor, patch: int, grid: tuple[int, int]) -> torch.Tensor:
    """(B, N, P*P*C) in patchify's layout -> (B, C, H, W)."""
    b, _, width = patches.shape
    c, (gh, gw) = width // (patch * patch), grid
    # (B, C, gh, P, gw, P)
    x = patches.reshape(b, gh, gw, patch, patch, c).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, c, gh * patch, gw * patch)


def mae_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, norm_pix: bool) -> torch.Tensor:
    """MAE's forward_loss, a float32 scalar: per patch the mean squared error over its P*P*3 values
    (B, N), averaged over the removed patches (mask 1). norm_pix: each target patch less its mean,
    over its std (unbiased, as torch's var) + 1e-6 under the root; pred and target (B, N, P*P*3),
    mask (B, N)."""
    target = target.float()
    if norm_pix:
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + NORM_PIX_EPS) ** 0.5
    per_patch = (pred.float() - target).square().mean(dim=-1)  # (B, N)
    return (per_patch * mask).sum() / mask.sum()


class MaeDecoder(nn.Module):
    """MAE's decoder: the encoder's tokens embedded to its width, a [mask] token at each removed
    patch, the fixed sin-cos table added, timm Blocks (LayerNorm eps 1e-6, qkv bias, MLP 4x), a norm
    and a linear layer to each patch's P*P*3 values. `prefix` class tokens (0 or 1) ride along and
    are dropped at the end."""

    def __init__(self, embed_dim: int, patch_size: int, grid: tuple[int, int], prefix: int, width: int,
                 depth: int, num_heads: int):
        super().__init__()
        norm = functools.partial(nn.LayerNorm, eps=LAYER_NORM_EPS)
        self.prefix = prefix
        self.embed = nn.Linear(embed_dim, width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        # a function of the grid: in no checkpoint, moved with the model
        self.register_buffer("pos_embed", sincos_table(grid, width, prefix), persistent=False)
        self.blocks = nn.Sequential(*[Block(width, num_heads, MLP_RATIO, qkv_bias=True, norm_layer=norm)
                                      for _ in range(depth)])
        self.norm = norm(width)
        self.pred = nn.Linear(width, patch_size * patch_size * 3)

    def forward(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """latent (B, prefix + K, D) from the encoder, ids_restore (B, N) -> pred (B, N, P*P*3)."""
        x = self.embed(latent)  # (B, prefix + K, W)
        head, visible = x[:, : self.prefix], x[:, self.prefix :]
        removed = self.mask_token.to(x.dtype).expand(x.shape[0], ids_restore.shape[1] - visible.shape[1], -1)
        # (B, N, W), grid order
        x = gather_tokens(torch.cat([visible, removed], dim=1), ids_restore)
        x = torch.cat([head, x], dim=1) + self.pos_embed
        x = self.pred(self.norm(self.blocks(x)))
        return x[:, self.prefix :]


def init_weights(module: nn.Module) -> None:
    """MAE's initialize_weights on `module`'s layers: xavier-uniform Linear weights and zero biases,
    unit LayerNorms, the patch embedding's conv as a Linear, class and [mask] tokens N(0, 0.02)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Conv2d):
            nn.init.xavier_uniform_(m.weight.view(m.weight.shape[0], -1))
    for name, p in module.named_parameters():
        if name.rsplit(".", 1)[-1] in ("cls_token", "mask_token"):
            nn.init.normal_(p, std=0.02)


class MaeModel(nn.Module):
    """A ViT as MAE's encoder, plus MAE's decoder. The ViT's position table becomes MAE's fixed 2-D
    sin-cos (frozen while pretraining; exported as timm's pos_embed, which fine-tuning trains, as
    MAE's own encoders carry it). `fresh`: a new network, which takes MAE's initialisation; else
    only the decoder does."""

    # weight decay on every tensor of 2 or more dims, cls_token and mask_token included, as MAE's
    # main_pretrain.py (timm's add_weight_decay without a skip list): train.optim.no_decay_names
    decays_tokens = True

    def __init__(self, backbone: nn.Module, cfg: MaeConfig, patch_size: int, fresh: bool = True):
        super().__init__()
        self.backbone, self.cfg, self.patch_size = backbone, cfg, patch_size
        grid, prefix = tuple(backbone.patch_embed.grid_size), backbone.num_prefix_tokens
        self.keep = keep_count(grid[0] * grid[1], cfg.mask_ratio)
        self.decoder = MaeDecoder(backbone.embed_dim, patch_size, grid, prefix, cfg.decoder_embed_dim,
                                      cfg.decoder_depth, cfg.decoder_num_heads)
        init_weights(self if fresh else self.decoder)
        with torch.no_grad():
            backbone.pos_embed.copy_(sincos_table(grid, backbone.embed_dim, prefix))  # (1, P+N, D)
        backbone.pos_embed.requires_grad_(False)

    def forward(self, images: torch.Tensor, noise: torch.Tensor):
        """(pred, target (B, N, P*P*3), mask (B, N): 1 removed) for normalised images (B, 3, H, W)
        and the masking noise (B, N) (mask_noise: mae_step draws it)."""
        ids_keep, ids_restore, mask = random_masking(noise.to(images.device), self.keep)
        pred = self.decoder(self.encode(images, ids_keep), ids_restore)
        return pred, patchify(images, self.patch_size), mask

    def encode(self, images: torch.Tensor, ids_keep: torch.Tensor) -> torch.Tensor:
        """(B, P+K, D): the ViT on its prefix tokens and the K kept patches (ids_keep (B, K)), MAE's
        forward_encoder: positions added before the gather, the class token's after."""
        b = self.backbone
        prefix, pos = b.num_prefix_tokens, b.pos_embed  # (1, P+N, D)
        x = gather_tokens(b.patch_embed(images) + pos[:, prefix:], ids_keep)  # (B, K, D)
        if b.cls_token is not None:
            x = torch.cat([(b.cls_token + pos[:, :prefix]).expand(x.shape[0], -1, -1), x], dim=1)
        return b.norm(b.blocks(b.norm_pre(b.pos_drop(x))))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The backbone's tokens on whole images: evaluators read the ViT, unmasked."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """The backbone's head (pre-logits for few-shot)."""
        return self.backbone.forward_head(x, pre_logits=pre_logits)


def mae_step(model: nn.Module, images: torch.Tensor, seed: int, first: int, cfg: MaeConfig,
             patch_size: int) -> torch.Tensor:
    """MAE's loss on one batch of `model` (an MaeModel, maybe wrapped: DDP, torch.compile); image b
    is the run's image `first` + b, which with `seed` fixes its mask (mask_noise), whatever batch
    holds it. The noise is drawn here, outside the model, as mpp_step's; nothing is read back on the
    host."""
    b, _, h, w = images.shape
    samples = torch.arange(first, first + b, device=images.device)
    noise = mask_noise(seed, samples, (h // patch_size) * (w // patch_size))  # (B, N)
    pred, target, mask = model(images, noise)
    return mae_loss(pred, target, mask, cfg.norm_pix_loss)
