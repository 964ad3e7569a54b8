"""Linear probe on all the training data: multinomial logistic regression on frozen features, with
the L2 strength chosen on a held-out part of train (CLIP, Radford et al. 2021, sec. 3.2 and App.
A.3: L-BFGS, at most 1,000 iterations, λ swept log-uniformly over 1e-6 .. 1e6 on a validation split,
then the model refitted).

  1. features are standardised with the fitting set's mean and std: MAE's linear probe puts a
  BatchNorm
     without affine before its head for the same reason (features of different scales train badly);
     it is also what makes one λ grid fit every backbone;
  2. the objective is mean cross-entropy + λ / (2N) ||W||², the bias unpenalised: exactly
  scikit-learn's
     LogisticRegression(C=1/λ, solver="lbfgs"), which CLIP ran, so λ means what CLIP's does;
  3. λ is the grid point with the best top-1 on a seeded `holdout` fraction of train, fitted on the
  rest
     (ties go to the larger λ; the sweep stops PATIENCE points past the peak); the probe is refitted
     on all of train with it and scored on test.

Written here rather than taken from scikit-learn, which is not a dependency: torch's L-BFGS with a
strong Wolfe line search on the same objective, float64 on a CPU (as scikit-learn) and float32 on a
GPU. The grid runs from strong to weak regularisation, each fit starting from the last one's weights
(the path is smooth, so the warm start saves most iterations).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vitcli.errors import DataError

L2_GRID = tuple(float(v) for v in 10.0 ** np.arange(-6, 7))  # CLIP's range, one point per decade
HOLDOUT = 0.2  # VTAB-1k's own split of its 1,000 train images is 800 + 200
MAX_ITER = 1000  # CLIP's L-BFGS budget
TOLERANCE = 1e-4  # stop when no gradient entry exceeds this: scikit-learn's default `tol`
STD_EPS = 1e-6
PATIENCE = 3  # λ in a row below the best held-out accuracy that end the sweep (choose_l2)


@dataclass(frozen=True)
class Fit:
    """A fitted probe over standardised features: logits = ((x - mean) / std) @ weight + bias."""

    mean: torch.Tensor  # (1, D)
    std: torch.Tensor  # (1, D)
    weight: torch.Tensor  # (D, K)
    bias: torch.Tensor  # (K,)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return ((x - self.mean) / self.std) @ self.weight + self.bias


def fit(x: torch.Tensor, y: torch.Tensor, num_classes: int, l2: float, max_iter: int = MAX_ITER,
        start: Fit | None = None) -> Fit:
    """The minimiser of mean cross-entropy + l2 / (2N) ||W||² over standardised `x` (N, D), labels
    `y` (N,); `start`: a fit on the same rows to warm-start from."""
    mean = x.mean(dim=0, keepdim=True)
    std = x.std(dim=0, unbiased=False, keepdim=True) + STD_EPS
    z = (x - mean) / std
    weight = (start.weight.clone() if start is not None
              else torch.zeros(x.shape[1], num_classes, dtype=x.dtype, device=x.device)).requires_grad_(True)
    bias = start.bias.clone() if start is not None else prior_logits(y, num_classes, x.dtype)
    bias.requires_grad_(True)
    opt = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, tolerance_grad=TOLERANCE,
                            tolerance_change=1e-12, history_size=10, line_search_fn="strong_wolfe")

    def objective():
        opt.zero_grad()
        loss = (torch.nn.functional.cross_entropy(z @ weight + bias, y)
                + l2 / (2 * len(z)) * weight.square().sum())
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(objective)
    return Fit(mean, std, weight.detach(), bias.detach())


def prior_logits(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """(K,) log class frequencies of `y`: the optimal bias while the weights are zero, where a cold
    fit starts. The unpenalised bias is the ill-conditioned direction of a strongly regularised fit
    (its curvature is ~p(1 - p), the weights' ~λ/N), so starting it at its optimum saves most of
    L-BFGS's iterations there. A class absent from `y` starts at half an example's frequency; the
    fit moves it on."""
    counts = torch.bincount(y, minlength=num_classes).to(dtype).clamp(min=0.5)
    return (counts / counts.sum()).log()


def top_k(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    """Fraction of rows whose label is among the k largest logits."""
    return float((logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).double().mean())


def holdout_split(n: int, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, held-out rows) of n train rows: a seeded permutation, round(fraction * n) held out
    (at least one, and at least one left to fit)."""
    if n < 2:
        raise DataError(f"the linear probe needs at least 2 train examples to hold some out, got {n}")
    held = min(max(1, round(fraction * n)), n - 1)
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[held:]), np.sort(order[:held])


def choose_l2(x: torch.Tensor, y: torch.Tensor, num_classes: int, grid=L2_GRID, holdout: float = HOLDOUT,
              max_iter: int = MAX_ITER, patience: int = PATIENCE) -> tuple[float, dict[float, float]]:
    """(the λ of `grid` with the best held-out top-1, ties to the larger; top-1 of every λ tried).

    The sweep goes from strong to weak and stops once `patience` λ in a row score below the best so
    far: held-out accuracy rises and then falls along the path (CLIP's binary search over λ assumes
    the same), and the weakly regularised fits past the peak are the slow ones (a separable task's
    weights grow without bound as λ -> 0, and L-BFGS takes its whole budget)."""
    fit_rows, held_rows = (torch.as_tensor(r, device=x.device) for r in holdout_split(len(x), holdout))
    accuracy, last, worse = {}, None, 0
    for l2 in sorted(grid, reverse=True):  # strong to weak: each fit warm-starts the next
        last = fit(x[fit_rows], y[fit_rows], num_classes, l2, max_iter, start=last)
        accuracy[l2] = top_k(last.logits(x[held_rows]), y[held_rows], 1)
        worse = worse + 1 if accuracy[l2] < max(accuracy.values()) else 0
        if worse == patience:
            break
    best = max(accuracy.values())
    return max(l2 for l2, acc in accuracy.items() if acc == best), accuracy


def linear_probe(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                 num_classes: int, grid=L2_GRID, holdout: float = HOLDOUT, max_iter: int = MAX_ITER,
                 device: torch.device | str = "cpu") -> dict:
    """{"top1", "top5" (>= 5 classes), "l2" (the chosen λ), "holdout_top1" (its held-out top-1)} of
    the logistic probe fitted on all of train with the λ chosen on a held-out part of it."""
    device = torch.device(device)
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    as_tensor = lambda a, t: torch.as_tensor(np.asarray(a), dtype=t, device=device)
    x, y = as_tensor(x_train, dtype), as_tensor(y_train, torch.int64)
    l2, tried = choose_l2(x, y, num_classes, grid, holdout, max_iter)
    probe = fit(x, y, num_classes, l2, max_iter)
    logits, labels = probe.logits(as_tensor(x_test, dtype)), as_tensor(y_test, torch.int64)
    out = {"top1": top_k(logits, labels, 1)}
    if num_classes >= 5:
        out["top5"] = top_k(logits, labels, 5)
    return {**out, "l2": l2, "holdout_top1": tried[l2]}
