"""Evaluators: small, uniform units the training loop runs when told. Each yields (metric name, value)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vitcli.data.decoding import bad_images
from vitcli.evaluators.inference import raise_if_nothing_decoded, sharded_pass
from vitcli.models.mae import mae_step
from vitcli.models.mpp import mpp_step
from vitcli.recipe.schema import DataConfig, MaeConfig, MppConfig
from vitcli.runtime.dist import Dist, all_gather, all_reduce_sum


class SplitEvaluator:
    """What every held-out evaluator shares: one split's batch stream, the model in eval mode, sums over the
    batches added up across ranks, and `PREFIX/skipped_images` when some images do not decode (left out)."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str):
        self.prefix, self.ds, self.cfg, self.img_size = prefix, ds, cfg, img_size
        self.dist, self.precision = dist, precision
        # kept across runs: a corrupt image is warned about once, not per eval
        self.skipped = bad_images.Skipped()

    def sums(self, model: torch.nn.Module, per_batch, width: int) -> tuple[list[float], int]:
        """(sums of the `width` numbers per_batch(model, i, x, y) returns, over the split and every rank
        (a rank may have no rows at all), and the skipped images)."""
        values = sharded_pass(model, self.ds, self.cfg, self.img_size, self.dist, self.precision, per_batch,
                              self.skipped)
        totals = [0.0] * width
        for batch in values:
            totals = [a + b for a, b in zip(totals, batch, strict=True)]
        # ranks read disjoint rows, so their skipped counts add up too; a batch holds at least one image
        *totals, skipped, decoded = all_reduce_sum([*totals, self.skipped.total, len(values)], self.dist)
        if skipped and not decoded:  # the same on every rank: all gather the tallies, all raise alike
            raise_if_nothing_decoded(0, all_gather(self.skipped.rows, self.dist))
        return totals, int(skipped)

    def named(self, metrics: dict[str, float], skipped: int) -> Iterator[tuple[str, float]]:
        """PREFIX/name pairs, and the skipped count only when it happened
        (zeros in every report are noise)."""
        yield from ((f"{self.prefix}/{name}", value) for name, value in metrics.items())
        if skipped:
            yield f"{self.prefix}/skipped_images", skipped


class ClassificationEvaluator(SplitEvaluator):
    """Top-1 accuracy and mean loss of the model's own head on one split; the loss is the one the run trains
    with (train.losses.loss_fn of the recipe), so val/loss and train/loss are one quantity."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str, *, loss):
        super().__init__(prefix, ds, cfg, img_size, dist, precision)
        self.loss = loss  # loss(logits (B, K), labels (B,)) -> mean over the batch

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        def per_batch(model, i, x, y):
            logits = model(x).float()  # (B, K)
            loss = self.loss(logits, y) * y.numel()  # a sum, so batches of any size average right
            return [y.numel(), (logits.argmax(-1) == y).sum().item(), loss.item()]

        (total, correct, loss_sum), skipped = self.sums(model, per_batch, 3)
        total = max(total, 1)
        return self.named({"top1": correct / total, "loss": loss_sum / total}, skipped)


class MppEvaluator(SplitEvaluator):
    """Held-out masked patch prediction: mean loss and mean-colour accuracy on one split, with the same
    corruption draws every run (batch i uses seed i), so runs are comparable step to step."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str,
                 mpp: MppConfig, patch_size: int):
        super().__init__(prefix, ds, cfg, img_size, dist, precision)
        self.mpp, self.patch_size = mpp, patch_size

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        def per_batch(model, i, x, y):
            loss, accuracy = mpp_step(model, x, i, self.mpp, self.patch_size)
            return [len(x), len(x) * loss.item(), len(x) * accuracy.item()]

        (total, loss_sum, accuracy_sum), skipped = self.sums(model, per_batch, 3)
        total = max(total, 1)
        return self.named({"mpp_loss": loss_sum / total, "mpp_accuracy": accuracy_sum / total}, skipped)


class MaeEvaluator(SplitEvaluator):
    """Held-out MAE loss on one split, with the same masks every run: image p of batch i is the split's image
    i x eval_batch_size + p of this rank's rows, masked with seed 0 (mae.mask_noise)."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str,
                 mae: MaeConfig, patch_size: int):
        super().__init__(prefix, ds, cfg, img_size, dist, precision)
        self.mae, self.patch_size = mae, patch_size

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        def per_batch(model, i, x, y):
            loss = mae_step(model, x, 0, i * self.cfg.eval_batch_size, self.mae, self.patch_size)
            return [len(x), len(x) * loss.item()]  # every image has as many removed patches: a plain mean

        (total, loss_sum), skipped = self.sums(model, per_batch, 2)
        return self.named({"mae_loss": loss_sum / max(total, 1)}, skipped)
