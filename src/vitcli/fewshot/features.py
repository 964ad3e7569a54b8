"""Frozen pre-logits features: extracted once per (checkpoint, task, split, preprocessing), cached on disk.

Every shot count and seed of a few-shot run reuses the same features, so extraction is the whole cost of
an evaluation; the solves are noise next to it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from vitcli import data
from vitcli.checkpoints.files import MODEL_FILE, atomic_path
from vitcli.dist import Dist
from vitcli.errors import DataError
from vitcli.precision import autocast
from vitcli.recipe import DataConfig


def pre_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) -> (B, D'): after the final norm, pooling and representation layer; before the head."""
    return model.forward_head(model.forward_features(x), pre_logits=True)


@torch.inference_mode()
def extract(model, ds, cfg: DataConfig, img_size: int, resize: int, dist: Dist, precision: str):
    """Features (N, D') float32 and labels (N,) int64 of a whole split, in dataset order."""
    was_training = model.training
    model.eval()
    feats, labels = [], []
    for x, y in data.eval_batches(ds, cfg, img_size, cfg.eval_batch_size, 0, 1, resize=resize):
        with autocast(dist.device, precision):
            f = pre_logits(model, x.to(dist.device, non_blocking=True))
        feats.append(f.float().cpu())
        labels.append(y)
    model.train(was_training)
    out = torch.cat(feats).numpy(), torch.cat(labels).numpy().astype(np.int64)
    if not np.isfinite(out[0]).all():
        raise DataError("features contain NaN or inf: the checkpoint's weights or activations overflow "
                        "(try run.precision=fp32)")
    return out


def weights_id(path: str | Path) -> str:
    """Content hash of a checkpoint file (a Hub name hashes as its name): the cache must not outlive a rewrite."""
    p = Path(path)
    if p.is_dir():
        p = p / MODEL_FILE
    if not p.is_file():
        return hashlib.sha256(str(path).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cache_key(weights: str, task: str, split: str, preprocessing: dict) -> str:
    """Key of one cached feature set: the four things that determine it."""
    blob = json.dumps({"weights": weights, "task": task, "split": split, "pre": preprocessing}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached(cache_dir: Path, key: str, compute, write: bool = True) -> tuple[np.ndarray, np.ndarray, bool]:
    """(features, labels, hit): read CACHE_DIR/KEY.safetensors, or compute and (if `write`) store it atomically."""
    path = cache_dir / f"{key}.safetensors"
    if path.exists():
        arrays = load_file(str(path))
        return arrays["features"], arrays["labels"], True
    feats, labels = compute()
    if not write:
        return feats, labels, False
    with atomic_path(path) as tmp:
        save_file({"features": np.ascontiguousarray(feats), "labels": labels}, str(tmp))
    return feats, labels, False
