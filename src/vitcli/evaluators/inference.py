"""One inference pass over a split, shared by every evaluator (held-out metrics, few-shot features).

Rows are sharded over ranks (rank r reads rows r, r + W, ...), the model runs in eval mode under the run's
autocast, and images that do not decode are left out and counted. Combining the ranks' results is the
caller's: sums add up (heldout.py), features are gathered back into row order (fewshot/features.py).
"""

from __future__ import annotations

import torch

from vitcli.data import batches
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.dist import Dist
from vitcli.runtime.precision import autocast


@torch.inference_mode()
def sharded_pass(
    model: torch.nn.Module, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str, per_batch,
    skipped: batches.Skipped, resize: int = 0, resize_method: str = "big_vision",
) -> list:
    """per_batch(model, i, x, y) for each batch i of this rank's rows, x (B, 3, H, W) and y (B,) on the
    device; the model's train/eval mode is restored after. Rows whose image does not decode land in `skipped`;
    `resize` > 0 selects the few-shot preprocessing (batches.eval_batches)."""
    was_training = model.training
    model.eval()
    share = dist.rank % dist.world_size  # the rank, or 0 for a lone process that torchrun did not start
    stream = batches.eval_batches(ds, cfg, img_size, cfg.eval_batch_size, share, dist.world_size,
                                  resize=resize, skipped=skipped, resize_method=resize_method)
    out = []
    for i, (x, y) in enumerate(stream):
        x, y = x.to(dist.device, non_blocking=True), y.to(dist.device, non_blocking=True)
        with autocast(dist.device, precision):
            out.append(per_batch(model, i, x, y))
    model.train(was_training)
    return out
