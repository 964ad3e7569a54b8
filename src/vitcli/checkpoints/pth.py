"""A `torch.save` file (.pth, .pt): read with `torch.load(weights_only=True)`, MAE's layouts told
apart.

weights_only unpickles tensors, containers and primitives only, plus what is allowed by name: here
`argparse.Namespace`, the `args` entry every facebookresearch/mae (and timm, DeiT) training
checkpoint pickles (a plain attribute bag). Any other pickled global is refused before it is built,
in one line that names the file and the global.

The weights are the first of `state_dict_ema`, `state_dict`, `model` that the file holds (timm's EMA
weights, then the raw ones; MAE and DeiT keep theirs under `model`), DDP's `module.` prefix
stripped; the rest of the file (optimizer, loss scaler, epoch, args) is not used, and the load table
says so.

MAE's checkpoints (He et al., facebookresearch/mae) keep the encoder in timm's names (cls_token,
pos_embed, patch_embed.proj, blocks.N, norm), so the encoder is read as any plain ViT. Their
layouts:

- `mae_pretrain_vit_*.pth`: {'model': encoder}; told by its fixed 2-D sin-cos position table (MAE's
  `get_2d_sincos_pos_embed`, class row zero), which MAE never trains;
- `mae_pretrain_vit_*_full.pth`, `mae_visualize_vit_*.pth` and a run's `checkpoint-N.pth`: also the
decoder
  (`decoder_*`) and `mask_token`, dropped; a run's file also holds optimizer, scaler, epoch and
  args;
- `mae_finetuned_vit_*.pth` (global pool): encoder, `fc_norm` and `head` but no final `norm`: MAE's
  fine-tuned network, which reads the head off fc_norm(mean of the patch tokens) with the class
  token kept in the sequence; read whole, as model.pool `gap_fc_norm` (checkpoints.describe tells it
  by those keys), so `vit evaluate` and `vit predict` run it as MAE does.
"""

from __future__ import annotations

import argparse
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vitcli.errors import CheckpointError, first_line
from vitcli.models.mae import sincos_table

ALLOWED_GLOBALS = (argparse.Namespace,)
STATE_DICT_KEYS = ("state_dict_ema", "state_dict", "model")
# MAE's pre-training decoder, the token it puts in masked slots
MAE_DROPPED = ("decoder_", "mask_token")
SINCOS_ATOL = 1e-5  # MAE computes the table in float64 and stores float32


@dataclass(frozen=True)
class TorchFile:
    """The weights of a torch.save file, in timm names, and what was left out of them."""

    state_dict: dict[str, torch.Tensor]
    mae: bool  # one of MAE's layouts
    # for the load table: "decoder (104 tensors)", "mask_token", "not used: optimizer, epoch, ..."
    dropped: tuple[str, ...]


def read_pth(path: Path, is_zip: bool) -> TorchFile:
    """A torch.save file's weights; the decoder, mask token and training state of MAE's files
    dropped."""
    content = _load(path, is_zip)
    keys = STATE_DICT_KEYS if isinstance(content, dict) else ()
    found = next((k for k in keys if isinstance(content.get(k), dict)), None)
    sd = content[found] if found else content
    if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{path}: no state dict of tensors (looked for {', '.join(STATE_DICT_KEYS)} "
                              "or a dict of tensors at the top)")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    rest = [_unused(k) for k in content if k != found] if found else []
    mae = is_mae(sd, found == "model")
    kept, dropped = split_mae(sd) if mae else (sd, [])
    return TorchFile(kept, mae, (*dropped, *([f"not used: {', '.join(rest)}"] if rest else [])))


def _load(path: Path, is_zip: bool):
    """torch.load with weights_only=True and argparse.Namespace allowed; mmap spares the optimizer
    state's pages in a zip file (the legacy format cannot be mapped)."""
    try:
        with torch.serialization.safe_globals(list(ALLOWED_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"a pickled {found.group(1)}" if found else "a pickled object"
        raise CheckpointError(
            f"{path} holds {what}, which vit does not unpickle (torch.load weights_only=True allows tensors, "
            f"containers and argparse.Namespace only); where you trust the file, save its state dict as "
            f".safetensors and pass that"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable torch.save file ({first_line(e)})") from None


def _unused(key: str) -> str:
    """How the load table names an entry of the file beside the weights."""
    return {"args": "args (argparse.Namespace)", "scaler": "loss scaler"}.get(key, key)


def is_mae(sd: dict[str, torch.Tensor], under_model: bool = True) -> bool:
    """One of MAE's layouts: its decoder or mask token, its global-pool fine-tune (fc_norm, no final
    norm, under 'model' as MAE saves it; timm's avg-pool training files keep theirs under
    'state_dict'), or the fixed sin-cos position table its encoder-only release carries."""
    if any(k.startswith(MAE_DROPPED) for k in sd):
        return True
    if "fc_norm.weight" in sd and "norm.weight" not in sd and "blocks.0.attn.qkv.weight" in sd:
        return under_model
    table = sd.get("pos_embed")  # (1, 1 + H*W, D)
    if table is None or table.ndim != 3 or "cls_token" not in sd:
        return False
    side, dim = round((table.shape[1] - 1) ** 0.5), table.shape[2]
    if side * side != table.shape[1] - 1 or dim % 4:
        return False
    return torch.allclose(table.float(), sincos_table((side, side), dim), atol=SINCOS_ATOL)


def split_mae(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the network, what was dropped): decoder and mask_token go; a global-pool fine-tune is kept
    whole."""
    decoder = [k for k in sd if k.startswith("decoder_")]
    dropped = [f"decoder ({len(decoder)} tensors)"] if decoder else []
    dropped += ["mask_token"] if "mask_token" in sd else []
    return {k: v for k, v in sd.items() if not k.startswith(MAE_DROPPED)}, dropped
