"""Frozen pre-logits features: extracted once per (checkpoint, task, split, preprocessing), cached
on disk.

Every shot count and seed of a few-shot run reuses the same features, so extraction is the whole
cost of an evaluation; the solves are noise next to it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from rich.markup import escape
from safetensors import safe_open
from safetensors.numpy import save_file

from vitcli.data.decoding import bad_images
from vitcli.errors import DataError, first_line
from vitcli.evaluators.inference import in_row_order, sharded_pass
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.dist import Dist, all_reduce_max
from vitcli.runtime.files import atomic_path
from vitcli.runtime.metrics import console
from vitcli.runtime.run_files import MODEL_FILE


def pre_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) -> (B, D'): after the final norm, pooling and representation layer; before the
    head."""
    return model.forward_head(model.forward_features(x), pre_logits=True)


def extract(model, ds, cfg: DataConfig, img_size: int, resize: int, dist: Dist, precision: str,
            skipped: bad_images.Skipped | None = None, resize_method: str = "big_vision"):
    """Features (N, D') float32 and labels (N,) int64 of a whole split, in dataset order, on every
    rank; rows whose image does not decode are left out (and recorded in `skipped`).
    `resize_method`: fewshot.resize_method.

    Each rank extracts rows rank, rank + world_size, ... and the parts are gathered: a collective
    call."""
    own = bad_images.Skipped(warn=False)  # this rank's share: `skipped` names each, from every rank
    skipped = skipped if skipped is not None else bad_images.Skipped()

    def per_batch(model, i, x, y):
        return pre_logits(model, x).float().cpu(), y.cpu()  # (B, D'), (B,)

    parts = sharded_pass(model, ds, cfg, img_size, dist, precision, per_batch, own, resize, resize_method)
    # None: this rank had no rows that decode
    part = ((torch.cat([f for f, _ in parts]).numpy(), torch.cat([y for _, y in parts]).numpy())
            if parts else None)
    gathered = in_row_order(part, own.rows, len(ds), dist, skipped)
    if gathered is None:  # an empty split
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    out = gathered[1], gathered[2].astype(np.int64)
    if not np.isfinite(out[0]).all():
        raise DataError("features contain NaN or inf: the checkpoint's weights or activations overflow "
                        "(try run.precision=fp32)")
    return out


def weights_id(path: str | Path) -> str:
    """Content hash of a checkpoint file (a Hub name hashes as its name): the cache must not
    outlive a rewrite."""
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


def state_id(model: torch.nn.Module) -> str:
    """Content hash of a network's weights (names, dtypes, shapes, bytes): the id of weights no file
    holds."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def cache_key(weights: str, task: str, split: str, preprocessing: dict) -> str:
    """Key of one cached feature set: the four things that determine it (`preprocessing` holds
    img_size, resize, resize_method, precision, and the mean and std that normalise unless they are
    [-1, 1]'s)."""
    blob = json.dumps({"weights": weights, "task": task, "split": split, "pre": preprocessing},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached(
    cache_dir: Path, key: str, compute, write: bool = True, skipped: bad_images.Skipped | None = None,
    dist: Dist | None = None,
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(features, labels, hit): read CACHE_DIR/KEY.safetensors, or compute and
    (if `write`) store it atomically.

    The images the extraction skipped (rows and names) are stored with the features and recorded
    into `skipped` on a hit as on a miss (`compute` must extract into that same tally). A damaged
    file is recomputed, with a warning.
    With `dist`, a miss on any rank is a miss on all, since `compute` (extract) is collective.
    """
    path = cache_dir / f"{key}.safetensors"
    skipped = skipped if skipped is not None else bad_images.Skipped()
    entry = _read_entry(path) if path.exists() else None
    if dist is not None and all_reduce_max([float(entry is None)], dist)[0]:
        entry = None
    if entry is not None:
        feats, labels, rows = entry
        why = "skipped when these cached features were extracted"
        for name, bad in rows.items():
            skipped.add(name, {row: bad_images.Bad(image, why) for row, image in bad.items()})
        return feats, labels, True
    before = {name: set(rows) for name, rows in skipped.as_dict().items()}
    feats, labels = compute()
    if not write:
        return feats, labels, False
    # what the tally gained during `compute` is this entry's: one (task, split) per key
    rows = {n: [r for r in bad if r not in before.get(n, set())] for n, bad in skipped.as_dict().items()}
    rows = {n: bad for n, bad in rows.items() if bad}
    images = {n: [skipped.rows[n][r].image for r in bad] for n, bad in rows.items()}  # rows' order
    meta = {"skipped_rows": json.dumps(rows), "skipped_images": json.dumps(images)}
    with atomic_path(path) as tmp:  # a damaged file is replaced whole
        save_file({"features": np.ascontiguousarray(feats), "labels": labels}, str(tmp), metadata=meta)
    return feats, labels, False


def _read_entry(path: Path) -> tuple[np.ndarray, np.ndarray, dict[str, dict[int, str]]] | None:
    """(features, labels, {row: image name} skipped per split) of a cache file; None, with a
    warning, if it is damaged. A file from before names were stored names rows by row and split."""
    try:
        with safe_open(str(path), framework="np") as f:
            feats, labels = f.get_tensor("features"), f.get_tensor("labels")
            meta = f.metadata() or {}
            rows = json.loads(meta.get("skipped_rows", "{}"))
            images = json.loads(meta.get("skipped_images", "{}"))
        if feats.ndim != 2 or labels.shape != (len(feats),):
            raise ValueError(f"features {feats.shape} do not pair with labels {labels.shape}")
    except Exception as e:  # noqa: BLE001 - truncated or foreign files fail in many ways, all meaning redo
        console.log(f"[yellow]warning: feature cache {escape(str(path))} is damaged "
                    f"({escape(first_line(e))}); "
                    "recomputing it")
        return None
    named = {n: images.get(n) or [bad_images.image_name({}, n, r) for r in bad] for n, bad in rows.items()}
    return feats, labels, {n: dict(zip(bad, named[n])) for n, bad in rows.items()}
