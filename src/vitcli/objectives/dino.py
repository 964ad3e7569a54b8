"""Self-distillation without labels (DINO, Caron et al. 2021; DINOv2's iBOT, KoLeo and Sinkhorn-Knopp
terms as keys, Oquab et al. 2023): a student ViT matches a teacher, the EMA of itself, across the
multi-crop views of each image (models.dino holds the network, models.dino_loss the maths).

Invariant to how the batch is split: each image's crops and masks are drawn from (run seed, its
index in the run), the teacher runs over the whole step's global crops before the student's first
micro-batch (`before_step`), and its centring, running centre or Sinkhorn-Knopp, is computed over
the global batch (summed over micro-batches and ranks). So one process, accumulation and several
ranks give the same loss; KoLeo's nearest neighbours are sought within fixed groups of the global
batch (dino.koleo_group), which a micro-batch holds whole.

Watched: the teacher's entropy and the teacher-student KL are logged; a teacher that collapses to
one prototype or to uniform outputs, or a term that is not finite, stops the run within
run.log_every steps with one line naming which and what to change.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.distributed as torch_dist
from torch import nn

from vitcli.errors import TrainingError
from vitcli.models import dino_loss as L
from vitcli.models.dino import DinoModel, masked_positions, tokens
from vitcli.models.flops import forward_flops
from vitcli.models.ibot_masks import masks_for
from vitcli.objectives.objective import Objective
from vitcli.recipe.schema import Recipe
from vitcli.runtime.dist import Dist, all_reduce_sum
from vitcli.train.loop import Draws

if TYPE_CHECKING:  # the evaluators import datasets: see Supervised.evaluator
    from vitcli.data.augmentation.multicrop import MultiCrop
    from vitcli.evaluators.heldout import PretextEvaluator

# the collapse watch (DINO's Figure 7): a teacher whose batch-mean output has under this entropy
# (nats) uses about one prototype, and a student that matches it within this KL (nats) has followed
# it there: a random network's teacher also starts near one prototype, but the student does not
# match it yet; a teacher whose outputs' own entropy is within this share of log K says nothing
# (uniform: a random head's sit near 0.9 log K at DINO's temperature)
ONE_PROTOTYPE_NATS = math.log(2)
MATCHED_KL = 1e-2
UNIFORM_SHARE = 0.995


def summed(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over the processes, in place (itself with one process)."""
    if torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(t)
    return t


class Dino(Objective):
    """DINO's student and teacher (models.dino.DinoModel) around the run's ViT; the teacher's
    backbone is what the run exports, as DINO releases it."""

    whole_step = True  # the loop hands `before_step` the step's micro-batches first

    def __init__(self, r: Recipe, num_classes: int, device: torch.device):
        super().__init__(r, num_classes, device)
        self.cfg = r.dino
        self.total_steps, self.epoch_steps = 1, 1.0
        self.module: DinoModel | None = None
        self.queue: deque = deque()  # per micro-batch: (masks, teacher targets, patch targets)
        self.pending: tuple[torch.Tensor, torch.Tensor | None] | None = None  # centre sums
        self.counts = (0, 0)  # (teacher rows, masked tokens) of the step, over every process
        self.watch: dict[str, torch.Tensor] = {}  # this step's monitors, the same on every process
        self.sums: dict[str, torch.Tensor] = {}  # logged terms summed since the last log
        self.logged_steps = 0
        self.step_kl = torch.zeros(())

    def plan(self, total_steps: int, epoch_steps: float) -> None:
        self.total_steps, self.epoch_steps = total_steps, epoch_steps

    def views(self) -> MultiCrop:
        """DINO's multi-crop, for the feed (imported here: its decoders bring datasets' imports,
        which a micro-batch trial's memory would count)."""
        from vitcli.data.augmentation.multicrop import MultiCrop

        return MultiCrop.of(self.cfg, self.recipe.model.img_size)

    def build(self, network: nn.Module, fresh: bool) -> DinoModel:
        self.module = DinoModel(network, self.cfg)
        return self.module

    def example(self, images: int, device: torch.device):
        """(globals (2B, 3, S, S), locals (nB, 3, s, s)) of random pixels, as the feed gives them."""
        c, side = self.cfg, self.recipe.model.img_size
        return (torch.randn(2 * images, 3, side, side, device=device),
                torch.randn(c.local_crops * images, 3, c.local_crop_size, c.local_crop_size, device=device))

    # ---------------------------------------------------------------- the step

    def _masks(self, draws: Draws, images: int) -> torch.Tensor | None:
        """iBOT's masks of the micro-batch's global crops (2B, N), view-major, each drawn from (run
        seed, view, the image's index in the run); None without iBOT."""
        c, m = self.cfg, self.recipe.model
        if c.ibot_weight <= 0:
            return None
        first, grid = draws.first_sample(images), m.img_size // m.patch_size
        views = [masks_for(draws.seed, first, images, grid, c.ibot_mask_prob, tuple(c.ibot_mask_ratio),
                           view=view) for view in range(2)]
        return torch.cat(views).to(self.device)

    def temperature(self, step: int) -> float:
        c = self.cfg
        return L.teacher_temperature(step, c.warmup_teacher_temp, c.teacher_temp,
                                     round(c.warmup_teacher_temp_epochs * self.epoch_steps))

    def before_step(self, xs: list, draws: list[Draws]) -> None:
        """The teacher on the step's global crops (every micro-batch of this process), its targets
        centred over the global batch, queued for the student's micro-batches in order."""
        c, module = self.cfg, self.module
        temp = self.temperature(draws[0].step)
        masks = [self._masks(d, len(x[0]) // 2) for x, d in zip(xs, draws)]
        out = [module.teach(x[0], m) for x, m in zip(xs, masks)]
        logits = torch.cat([o[0] for o in out]).float()  # (2 x this process's batch, K)
        rows = summed(torch.tensor(float(len(logits)), device=logits.device))
        if c.centering == "sinkhorn":
            probs = L.sinkhorn_knopp(logits, temp, c.sinkhorn_iterations, summed, int(rows))
        else:
            probs = L.centred_probs(logits, module.center, temp)
        patch_probs, tokens = None, 0
        if masks[0] is not None:
            patch_logits = torch.cat([o[1] for o in out]).float()  # (M, K) of this process
            tokens = int(summed(torch.tensor(float(len(patch_logits)), device=logits.device)))
            if c.centering == "sinkhorn":
                patch_probs = L.sinkhorn_knopp(patch_logits, temp, c.sinkhorn_iterations, summed, tokens)
            else:
                patch_probs = L.centred_probs(patch_logits, module.patch_center, temp)
            self.pending = (logits.sum(0, keepdim=True), patch_logits.sum(0, keepdim=True))
        else:
            self.pending = (logits.sum(0, keepdim=True), None)
        self.counts = (int(rows), tokens)
        # Sinkhorn-Knopp spreads every batch over the prototypes by construction, so the watch
        # reads the teacher's own sharpened outputs there
        self._monitor(probs if c.centering == "center" else torch.softmax(logits / temp, -1), rows)
        self.step_kl = torch.zeros((), device=probs.device)
        cut = [len(o[0]) for o in out]
        patch_cut = [len(o[1]) for o in out] if patch_probs is not None else None
        for i, (m, t) in enumerate(zip(masks, probs.split(cut))):
            self.queue.append((m, t, None if patch_cut is None else patch_probs.split(patch_cut)[i]))

    def _monitor(self, probs: torch.Tensor, rows: torch.Tensor) -> None:
        """The teacher's collapse monitors over the global batch, the same on every process: the
        mean entropy of its outputs and the entropy of their mean (DINO's Figure 7)."""
        row_entropy = summed(L.entropy(probs) * len(probs)) / rows
        mean = summed(probs.sum(0)) / rows
        self.watch = {"teacher_entropy": row_entropy, "teacher_mean_entropy": L.entropy(mean[None])}

    def loss(self, model: nn.Module, x, y: torch.Tensor, draws: Draws):
        """The student on one micro-batch (x = (globals (2B, ...), locals (nB, ...))) against the
        teacher's targets `before_step` queued for it."""
        c = self.cfg
        globals_, locals_ = x
        images = len(globals_) // 2
        masks, targets, patch_targets = self.queue.popleft()
        index = None if masks is None else masked_positions(masks)
        logits, patch_logits, cls = model(globals_, locals_ if len(locals_) else None, masks, index)
        logits = logits.float()
        views = logits.split(images)
        dino = L.dino_loss(views, targets.split(images), c.student_temp)
        terms = {"dino_loss": dino}
        total = dino
        if patch_targets is not None:
            ibot = L.ibot_loss(patch_logits.float(), patch_targets, L.ibot_weights(masks), 2 * images,
                               c.student_temp)
            terms["ibot_loss"] = ibot
            total = total + c.ibot_weight * ibot * 0.5  # DINOv2's ibot_loss_scale: 1 / global crops
        if c.koleo_weight > 0:
            koleo = sum(L.koleo_loss(t.float(), c.koleo_group) for t in cls.split(images))
            terms["koleo_loss"] = koleo
            total = total + c.koleo_weight * koleo
        with torch.no_grad():
            terms["kl"] = L.kl(targets, logits[: 2 * images], c.student_temp)
            self.step_kl = self.step_kl + terms["kl"] * len(targets)  # summed over ranks after the step
        for name, value in terms.items():
            value = value.detach()
            self.sums[name] = self.sums.get(name, 0) + value
        self.logged_steps += 1
        return total, None

    def before_update(self, model: nn.Module, step: int) -> None:
        """DINO's clip_gradients (each parameter's gradient norm at most dino.clip_grad), then, while
        the last layer is frozen (dino.freeze_last_layer_epochs), its gradients dropped, so the
        optimizer leaves it alone (cancel_gradients_last_layer): main_dino.py's order."""
        grads = [p.grad for p in self.module.student.parameters() if p.grad is not None]
        if self.module.mask_token is not None and self.module.mask_token.grad is not None:
            grads.append(self.module.mask_token.grad)
        if self.cfg.clip_grad and grads:
            norms = torch.stack(torch._foreach_norm(grads))
            torch._foreach_mul_(grads, list((self.cfg.clip_grad / (norms + 1e-6)).clamp(max=1.0).unbind()))
        if step < self.cfg.freeze_last_layer_epochs * self.epoch_steps:
            for p in self.module.last_layers():
                p.grad = None

    def after_step(self, model: nn.Module, done: int) -> None:
        """The teacher's EMA with this step's momentum, the centres' update from the step's sums
        over the global batch, then (every run.log_every steps) the collapse watch."""
        c, module = self.cfg, self.module
        module.update_teacher(L.cosine(c.momentum, c.momentum_end, done - 1, self.total_steps))
        if c.centering == "center" and self.pending is not None:
            rows, tokens = self.counts
            cls_sum, patch_sum = self.pending
            module.center.copy_(L.updated_center(module.center, summed(cls_sum), rows, c.center_momentum))
            if patch_sum is not None:  # it stays where no token was masked
                module.patch_center.copy_(L.updated_patch_center(module.patch_center, summed(patch_sum),
                                                                 tokens, c.center_momentum))
        self.pending = None
        # the step's KL over the global batch, the same on every process: the collapse watch
        self.watch["kl"] = summed(self.step_kl) / self.counts[0]
        if done % self.recipe.run.log_every == 0 or done == self.total_steps:
            self.check(done)

    def check(self, done: int) -> None:
        """Stop a run whose teacher collapsed, with one line naming how and what to change."""
        if not self.watch:
            return
        k = self.cfg.out_dim
        mean_entropy = float(self.watch["teacher_mean_entropy"])
        row_entropy = float(self.watch["teacher_entropy"])
        kept = "the checkpoints written before it are kept"
        if not (math.isfinite(mean_entropy) and math.isfinite(row_entropy)):
            raise TrainingError(f"step {done}: the teacher's outputs are not finite (run.precision="
                                f"{self.recipe.run.precision}); {kept}; try run.precision=fp32 or bf16 "
                                "(not fp16), or a lower optim.lr")
        kl = float(self.watch["kl"])
        if mean_entropy < ONE_PROTOTYPE_NATS and kl < MATCHED_KL:
            raise TrainingError(
                f"step {done}: the teacher collapsed to one prototype (the entropy of its mean output is "
                f"{mean_entropy:.3g} nats of log K = {math.log(k):.3g}, the student's KL to it "
                f"{kl:.2g}); {kept}; centre it "
                "(dino.centering, dino.center_momentum closer to 1), or lower optim.lr")
        if row_entropy > UNIFORM_SHARE * math.log(k):
            raise TrainingError(
                f"step {done}: the teacher's outputs collapsed to uniform (entropy {row_entropy:.4g} of "
                f"log K = {math.log(k):.4g} nats); {kept}; sharpen it: a lower dino.teacher_temp "
                f"(now {self.cfg.teacher_temp:g}; DINO: 0.04 to 0.07)")

    def logged(self, dist: Dist) -> dict[str, float]:
        """The terms since the last log (means over its micro-batches) and the teacher's monitors,
        averaged over the processes; named train/...; the sums restart."""
        names = sorted(self.sums)
        if not names or not self.logged_steps:
            return {}
        values = [float(self.sums[n]) / self.logged_steps for n in names]
        values = [v / dist.world_size for v in all_reduce_sum(values, dist)]
        row = {f"train/{n}": v for n, v in zip(names, values)}
        row.update({f"train/{n}": float(v) for n, v in self.watch.items() if n != "kl"})
        self.sums, self.logged_steps = {}, 0
        return row

    def why_diverged(self) -> str:
        """Which term of the last micro-batch is not finite, and what to change, for the loop's
        line about a non-finite loss."""
        bad = [n for n, v in self.sums.items() if not bool(torch.isfinite(torch.as_tensor(v)).all())]
        if "koleo_loss" in bad:
            return ("the KoLeo term is not finite: two class tokens of a dino.koleo_group coincide "
                    "(duplicate images, or fp16: KoLeo's eps underflows; DINOv2 #143); lower "
                    "dino.koleo_weight or run in bf16/fp32")
        if bad:
            return (f"{', '.join(bad)} is not finite: try run.precision=bf16 or fp32 (not fp16: DINO #58), a "
                    "lower optim.lr or optim.clip_grad_norm=3")
        return ""

    # ---------------------------------------------------------------- the rest

    def evaluator(self, name: str, ds, dist: Dist) -> PretextEvaluator:
        """On held-out images (the eval crop): the student's cross-entropy to the teacher and the
        teacher's entropy, both at the final temperatures and the current centre: no crops drawn, so
        comparable step to step; a collapse shows as the entropy going to 0 or log K."""
        from vitcli.evaluators.heldout import PretextEvaluator  # datasets: see Supervised.evaluator

        r, c = self.recipe, self.cfg

        def measure(model, i, x):
            module = self.module
            teacher, _ = module.teach(x)
            probs = L.centred_probs(teacher.float(), module.center, c.teacher_temp)
            student = module.student.head(module_tokens(module, x)).float()
            return L.dino_loss([student], [probs, probs], c.student_temp), L.entropy(probs)

        return PretextEvaluator(name, ds, r.data, r.model.img_size, dist, r.run.precision,
                                names=("dino_ce", "teacher_entropy"), measure=measure)

    def flops_per_image(self) -> float:
        """The DINO step's: the student forward and backward on 2 global and n local crops, the
        teacher forward on the 2 global ones (the heads left out, as the plain count leaves out the
        head)."""
        m, c = self.recipe.model, self.cfg
        small = forward_flops(_sized(m, c.local_crop_size), num_classes=0)
        big = forward_flops(m, num_classes=0)
        return 3 * (2 * big + c.local_crops * small) + 2 * big

    def learns(self) -> str:
        c = self.cfg
        extra = [name for name, on in (("iBOT", c.ibot_weight > 0), ("KoLeo", c.koleo_weight > 0),
                                       ("Sinkhorn-Knopp", c.centering == "sinkhorn")) if on]
        return (f"self-distillation (DINO{' + ' + ', '.join(extra) if extra else ''}: 2 global + "
                f"{c.local_crops} local crops, {c.out_dim} prototypes)")

    def exported(self, model: nn.Module) -> nn.Module:
        """The teacher's ViT, as DINO releases it."""
        return model.teacher.backbone


def module_tokens(module: DinoModel, x: torch.Tensor) -> torch.Tensor:
    """The student's class tokens of whole images (B, D)."""
    return tokens(module.student.backbone, x)[:, 0]


def _sized(m, side: int):
    return dataclasses.replace(m, img_size=side)
