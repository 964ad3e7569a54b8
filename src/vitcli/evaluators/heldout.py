"""Evaluators: small, uniform units the training loop runs when told. Each yields (metric name,
value)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from vitcli.data.decoding import bad_images
from vitcli.evaluators.inference import raise_if_nothing_decoded, sharded_pass
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.dist import Dist, all_gather, all_reduce_sum


class SplitEvaluator:
    """What every held-out evaluator shares: one split's batch stream, the model in eval mode, sums
    over the batches added up across ranks, and `PREFIX/skipped_images` when some images do not
    decode (left out)."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str):
        self.prefix, self.ds, self.cfg, self.img_size = prefix, ds, cfg, img_size
        self.dist, self.precision = dist, precision
        # kept across runs: a corrupt image is warned about once, not per eval
        self.skipped = bad_images.Skipped()

    def sums(self, model: torch.nn.Module, per_batch, width: int) -> tuple[list[float], int]:
        """(sums of the `width` numbers per_batch(model, i, x, y) returns, over the split and every
        rank (a rank may have no rows at all), and the skipped images)."""
        values = sharded_pass(model, self.ds, self.cfg, self.img_size, self.dist, self.precision, per_batch,
                              self.skipped)
        totals = [0.0] * width
        for batch in values:
            totals = [a + b for a, b in zip(totals, batch, strict=True)]
        # ranks read disjoint rows, so their skipped counts add up too; a batch holds at least one
        # image
        *totals, skipped, decoded = all_reduce_sum([*totals, self.skipped.total, len(values)], self.dist)
        # the same on every rank: all gather the tallies, all raise alike
        if skipped and not decoded:
            raise_if_nothing_decoded(0, all_gather(self.skipped.rows, self.dist))
        return totals, int(skipped)

    def named(self, metrics: dict[str, float], skipped: int) -> Iterator[tuple[str, float]]:
        """PREFIX/name pairs, and the skipped count only when it happened
        (zeros in every report are noise)."""
        yield from ((f"{self.prefix}/{name}", value) for name, value in metrics.items())
        if skipped:
            yield f"{self.prefix}/skipped_images", skipped


class ClassificationEvaluator(SplitEvaluator):
    """Top-1 accuracy and mean loss of the model's own head on one split; the loss is the one the
    run trains with (train.losses.loss_fn of the recipe), so val/loss and train/loss are one
    quantity."""

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


class PretextEvaluator(SplitEvaluator):
    """A self-supervised objective's held-out losses on one split: `measure(model, i, x)` gives
    batch i's `names` values (0-d tensors, means over its images), each batch with the same draws
    every run (the objective seeds them by i), so the values are comparable step to step; averaged
    over images. The objective (vitcli.objectives) supplies both: its evaluation is its own
    maths."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str, *,
                 names: tuple[str, ...], measure):
        super().__init__(prefix, ds, cfg, img_size, dist, precision)
        self.names, self.measure = names, measure

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        def per_batch(model, i, x, y):
            values = self.measure(model, i, x)
            return [len(x), *(len(x) * v.item() for v in values)]

        (total, *sums), skipped = self.sums(model, per_batch, 1 + len(self.names))
        return self.named({n: v / max(total, 1) for n, v in zip(self.names, sums, strict=True)}, skipped)
