"""Evaluators: small, uniform units the training loop runs when told. Each yields (metric name, value)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from vitcli import batches
from vitcli.dist import Dist, all_reduce_sum
from vitcli.objectives import mpp_step
from vitcli.precision import autocast
from vitcli.recipe import DataConfig


class Evaluator(Protocol):
    """Something that measures a model and names what it measured (`val/top1`, `fewshot/x/5shot`)."""

    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]: ...


class ClassificationEvaluator:
    """Top-1 accuracy and mean cross-entropy of the model's own head on one split; `PREFIX/skipped_images` too
    when some of its images do not decode (they are left out)."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str):
        self.prefix, self.ds, self.cfg, self.img_size = prefix, ds, cfg, img_size
        self.dist, self.precision = dist, precision
        self.skipped = batches.Skipped()  # kept across runs: a corrupt image is warned about once, not per eval

    @torch.inference_mode()
    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        was_training = model.training
        model.eval()
        correct = total = loss_sum = 0.0
        stream = batches.eval_batches(
            self.ds, self.cfg, self.img_size, self.cfg.eval_batch_size, self.dist.rank, self.dist.world_size,
            skipped=self.skipped,
        )
        for x, y in stream:
            x, y = x.to(self.dist.device, non_blocking=True), y.to(self.dist.device, non_blocking=True)
            with autocast(self.dist.device, self.precision):
                logits = model(x).float()  # (B, K)
            correct += (logits.argmax(-1) == y).sum().item()
            loss_sum += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
            total += y.numel()
        # ranks read disjoint rows, so their skipped counts add up
        correct, total, loss_sum, skipped = all_reduce_sum(
            [correct, total, loss_sum, self.skipped.total], self.dist
        )
        model.train(was_training)
        yield f"{self.prefix}/top1", correct / max(total, 1)
        yield f"{self.prefix}/loss", loss_sum / max(total, 1)
        if skipped:  # named only when it happened: a row of zeros in every report would be noise
            yield f"{self.prefix}/skipped_images", int(skipped)


class MppEvaluator:
    """Held-out masked patch prediction: mean loss and mean-colour accuracy on one split, with the same
    corruption draws every run (batch i uses seed i), so runs are comparable step to step."""

    def __init__(self, prefix: str, ds, cfg: DataConfig, img_size: int, dist: Dist, precision: str, target: str):
        self.prefix, self.ds, self.cfg, self.img_size = prefix, ds, cfg, img_size
        self.dist, self.precision, self.target = dist, precision, target
        self.skipped = batches.Skipped()

    @torch.inference_mode()
    def run(self, model: torch.nn.Module) -> Iterator[tuple[str, float]]:
        was_training = model.training
        model.eval()
        loss_sum = accuracy_sum = total = 0.0
        stream = batches.eval_batches(self.ds, self.cfg, self.img_size, self.cfg.eval_batch_size, self.dist.rank,
                                    self.dist.world_size, skipped=self.skipped)
        for i, (x, _) in enumerate(stream):
            with autocast(self.dist.device, self.precision):
                loss, accuracy = mpp_step(model, x.to(self.dist.device), seed=i, target=self.target)
            loss_sum += len(x) * loss.item()
            accuracy_sum += len(x) * accuracy.item()
            total += len(x)
        loss_sum, accuracy_sum, total = all_reduce_sum([loss_sum, accuracy_sum, total], self.dist)
        model.train(was_training)
        yield f"{self.prefix}/mpp_loss", loss_sum / max(total, 1)
        yield f"{self.prefix}/mpp_accuracy", accuracy_sum / max(total, 1)
