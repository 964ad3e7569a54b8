"""DINO's network (Caron et al. 2021; DINOv2's masked tokens, Oquab et al. 2023): a student ViT with
its projection head, and a teacher of the same shape that is an EMA of the student, never trained
by gradients. The maths of the losses is in models.dino_loss, the head in models.dino_head.

The ViT reads crops of any side that is a multiple of its patch: the global crops at its own
img_size, the local ones (96 of 224) with the position table resized to their grid by a bicubic
interpolation, as DINO's interpolate_pos_encoding does (DINOv2's, without its `+ 0.1` offset: the
size is given, not a scale factor).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from vitcli.models.dino_head import DinoHead
from vitcli.models.layer_decay import dinov2_param_groups
from vitcli.recipe.schema import DinoConfig


def patch_positions(pos_embed: torch.Tensor, prefix: int, grid: tuple[int, int],
                    to: tuple[int, int]) -> torch.Tensor:
    """(1, prefix + H*W, D) position table -> (1, h*w, D) of its patch rows resized to the grid
    `to` (bicubic, align_corners off, no antialias: DINO's); the table itself when `to` is its own
    grid."""
    patches = pos_embed[:, prefix:]
    if tuple(to) == tuple(grid):
        return patches
    d = patches.shape[-1]
    table = patches.reshape(1, grid[0], grid[1], d).permute(0, 3, 1, 2)
    table = F.interpolate(table.float(), size=to, mode="bicubic", align_corners=False)
    return table.to(patches.dtype).permute(0, 2, 3, 1).reshape(1, to[0] * to[1], d)


def tokens(backbone: nn.Module, images: torch.Tensor, masks: torch.Tensor | None = None,
           mask_token: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1 + n, D): the ViT's final-normed tokens of images (B, 3, h, w) of any side that is a
    multiple of the patch; patches where `masks` (B, n) is true replaced by `mask_token` (D,) before
    the positions are added (DINOv2's prepare_tokens_with_masks)."""
    b = backbone
    p = b.patch_embed.patch_size[0]
    x = b.patch_embed(images)  # (B, n, D): strict_img_size is off (DinoModel)
    if masks is not None:
        x = torch.where(masks[..., None], mask_token.to(x.dtype), x)
    grid = (images.shape[-2] // p, images.shape[-1] // p)
    x = x + patch_positions(b.pos_embed, b.num_prefix_tokens, b.patch_embed.grid_size, grid)
    cls = (b.cls_token + b.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
    x = torch.cat([cls.to(x.dtype), x], dim=1)
    return b.norm(b.blocks(b.norm_pre(b.pos_drop(x))))


def masked_positions(masks: torch.Tensor) -> torch.Tensor:
    """(M,) flat positions, row-major, of the true entries of masks (B, N)."""
    return masks.flatten().nonzero().squeeze(1)


def selected(tokens_: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(M, D): the patch tokens of tokens_ (B, 1 + N, D) at flat positions `index` (M,), in their
    order (DINOv2's index_select of its mask_indices_list)."""
    return tokens_[:, 1:].flatten(0, 1).index_select(0, index)


class Side(nn.Module):
    """One side, student or teacher: a ViT, the DINO head on its class token, and iBOT's head on its
    masked patch tokens (the DINO head itself unless ibot_separate_head; None without iBOT)."""

    def __init__(self, backbone: nn.Module, cfg: DinoConfig):
        super().__init__()
        self.backbone = backbone
        width = backbone.embed_dim
        self.head = DinoHead(width, cfg.out_dim, cfg.hidden_dim, cfg.bottleneck_dim, cfg.head_layers,
                             cfg.norm_last_layer)
        separate = cfg.ibot_weight > 0 and cfg.ibot_separate_head
        self.ibot_head = (DinoHead(width, cfg.out_dim, cfg.hidden_dim, cfg.bottleneck_dim, cfg.head_layers,
                                   cfg.norm_last_layer) if separate else None)


class DinoModel(nn.Module):
    """The student (`student`: trained) and the teacher (`teacher`: the student's EMA, in eval mode
    always: no drop-path), the running centres of the teacher's outputs (`center`, and
    `patch_center` for iBOT), and iBOT's mask token. Everything is in the state dict, so a
    checkpoint resumes the teacher and its centres with the weights."""

    def __init__(self, backbone: nn.Module, cfg: DinoConfig):
        super().__init__()
        backbone.patch_embed.strict_img_size = False  # local crops are smaller than img_size
        backbone.patch_embed.dynamic_img_pad = False
        self.cfg = cfg
        self.student = Side(backbone, cfg)
        self.mask_token = nn.Parameter(torch.zeros(backbone.embed_dim)) if cfg.ibot_weight > 0 else None
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.teacher.eval()
        self.register_buffer("center", torch.zeros(1, cfg.out_dim))
        self.register_buffer("patch_center", torch.zeros(1, cfg.out_dim))

    @property
    def backbone(self) -> nn.Module:
        """The teacher's ViT: what DINO releases, what evaluators read and what is exported."""
        return self.teacher.backbone

    def train(self, mode: bool = True) -> DinoModel:
        super().train(mode)
        self.teacher.eval()  # the teacher never drops paths
        return self

    def forward(self, globals_: torch.Tensor, locals_: torch.Tensor | None,
                masks: torch.Tensor | None = None, index: torch.Tensor | None = None):
        """The student on a micro-batch's crops: globals_ (2B, 3, S, S) view-major, locals_ (nB, 3,
        s, s) or None, masks (2B, N) of the global crops' patches for iBOT or None, and `index` (M,)
        the masked ones' flat positions (masked_positions(masks), made outside: a boolean selection
        here would break a compiled graph, its size read from the data). Returns (the DINO
        head's logits of every crop's class token (2B + nB, K), global crops first; the iBOT head's
        logits of the masked patch tokens (M, K) or None; the global crops' class tokens (2B, D),
        for KoLeo). One head call on the class tokens and the masked tokens together where the head
        is shared, as DINOv2 does."""
        s = self.student
        g = tokens(s.backbone, globals_, masks, self.mask_token)
        cls = [g[:, 0]]
        if locals_ is not None and len(locals_):
            cls.append(tokens(s.backbone, locals_)[:, 0])
        cls = torch.cat(cls)
        patches = selected(g, index) if masks is not None else None  # (M, D)
        if patches is None:
            return s.head(cls), None, g[:, 0]
        if s.ibot_head is not None:
            return s.head(cls), s.ibot_head(patches), g[:, 0]
        both = s.head(torch.cat([cls, patches]))
        return both[: len(cls)], both[len(cls):], g[:, 0]

    @torch.no_grad()
    def teach(self, globals_: torch.Tensor, masks: torch.Tensor | None = None):
        """The teacher on the global crops (2B, 3, S, S): (its DINO head's logits (2B, K), its iBOT
        head's logits of the patch tokens where the student's crops are masked (M, K), or None)."""
        t = self.teacher
        g = tokens(t.backbone, globals_)
        cls_logits = t.head(g[:, 0])
        if masks is None:
            return cls_logits, None
        patches = selected(g, masked_positions(masks))
        return cls_logits, (t.ibot_head or t.head)(patches)

    def optimizer_groups(self, layer_decay: float, patch_embed_lr_scale: float) -> list[dict]:
        """The student's parameters (and iBOT's mask token) as DINOv2 groups them (train.optim's
        dinov2_param_groups, by the backbone's names): the teacher has no gradients to step."""
        named = [(n.removeprefix("backbone."), p) for n, p in self.student.named_parameters()]
        if self.mask_token is not None:
            named.append(("mask_token", self.mask_token))
        depth = len(self.student.backbone.blocks)
        return dinov2_param_groups(named, depth, layer_decay, patch_embed_lr_scale)

    def last_layers(self) -> list[nn.Parameter]:
        """The student's heads' weight-normalised last layers: not updated while frozen (DINO's
        cancel_gradients_last_layer)."""
        heads = [h for h in (self.student.head, self.student.ibot_head) if h is not None]
        return [p for h in heads for name, p in h.named_parameters() if name.startswith("last")]

    @torch.no_grad()
    def update_teacher(self, momentum: float) -> None:
        """teacher <- momentum x teacher + (1 - momentum) x student, parameter by parameter (the
        student's buffers have none to follow)."""
        teacher = [p for p in self.teacher.parameters()]
        student = [p.detach() for p in self.student.parameters()]
        torch._foreach_mul_(teacher, momentum)
        torch._foreach_add_(teacher, student, alpha=1 - momentum)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's tokens on whole images: the evaluators (kNN, few-shot) read the teacher, as
        DINO's own kNN monitor does."""
        return self.backbone.forward_features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.backbone.forward_head(x, pre_logits=pre_logits)
