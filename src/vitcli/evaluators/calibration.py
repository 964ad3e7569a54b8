"""Calibration of a softmax classifier from its per-row predictions: expected calibration error, the
reliability diagram's bins, the negative log-likelihood, and temperature scaling (Guo et al. 2017,
"On Calibration of Modern Neural Networks").

ECE = sum over the bins m of |B_m| / N * |accuracy(B_m) - confidence(B_m)|, where a row's confidence
is its top-1 probability and B_m the rows whose confidence falls in the m-th of `n_bins` equal-width
bins of [0, 1]. The bins are right-closed, (edge_m, edge_m+1], so a confidence exactly on an edge
belongs to the lower bin (a confidence of exactly 1 to the last); the edges are torch.linspace(0, 1,
n_bins + 1) in float32, and a row is binned by torch.bucketize(confidence, edges) - 1: the rule of
torchmetrics' `multiclass_calibration_error(norm="l1")` (its `_binning_bucketize`) and of Guo et
al.'s reference code (`confidences.gt(lower) * confidences.le(upper)`). A confidence of 0, which no
top-1 probability of a softmax is, would be counted in the first bin.

Temperature scaling divides the logits by one T > 0 fitted on held-out rows by minimising their NLL.
The NLL of logits / T is convex in 1 / T (a log-sum-exp of a linear function of 1 / T, minus a
linear term), so it has one minimum on any interval of log T and a golden-section search over log T
finds it, deterministically. Written by hand: torchmetrics is not a dependency, and torch has no 1-D
bounded minimiser.
"""

from __future__ import annotations

import math

import numpy as np
import torch

N_BINS = 15  # Guo et al.'s choice, and torchmetrics' default
# the temperatures searched: far beyond what a trained classifier needs either way
T_RANGE = (0.05, 20.0)
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618...: the share of the interval kept at each step


def bin_index(confidence: np.ndarray, n_bins: int = N_BINS) -> np.ndarray:
    """(N,) the bin of each confidence (N,) in [0, 1]: bins (edge_m, edge_m+1], as torchmetrics
    (above)."""
    edges = torch.linspace(0.0, 1.0, n_bins + 1)  # float32, as torchmetrics builds them
    found = torch.bucketize(torch.as_tensor(np.ascontiguousarray(confidence), dtype=torch.float32), edges) - 1
    return found.clamp(0, n_bins - 1).numpy()


def reliability_bins(confidence: np.ndarray, correct: np.ndarray,
                     n_bins: int = N_BINS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows per bin (M,), accuracy per bin (M,), mean confidence per bin (M,)); an empty bin has 0
    for both means. `confidence` (N,) is each row's top-1 probability, `correct` (N,) whether its
    top-1 was right."""
    index = bin_index(confidence, n_bins)
    counts = np.bincount(index, minlength=n_bins)
    right = np.bincount(index, weights=np.asarray(correct, dtype=np.float64), minlength=n_bins)
    sure = np.bincount(index, weights=np.asarray(confidence, dtype=np.float64), minlength=n_bins)
    held = np.maximum(counts, 1)
    return counts, right / held, sure / held


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, n_bins: int = N_BINS) -> float:
    """Guo et al.'s ECE: the bins' |accuracy - confidence| weighted by their share of the rows."""
    counts, accuracy, mean_confidence = reliability_bins(confidence, correct, n_bins)
    return float(np.sum(counts / max(counts.sum(), 1) * np.abs(accuracy - mean_confidence)))


def row_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) -log softmax(logits)[label] of each row, in the logits' dtype: logits (B, K), labels
    (B,)."""
    return -logits.log_softmax(-1).gather(1, labels[:, None].long())[:, 0]


def scaled_nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """The mean NLL of softmax(logits / T) over the rows, in float64."""
    return float(row_nll(logits.double() / temperature, labels).mean())


def fit_temperature(logits: np.ndarray, labels: np.ndarray, t_range: tuple[float, float] = T_RANGE,
                    tol: float = 1e-5) -> float:
    """The T in t_range minimising the mean NLL of logits (N, K) / T on labels (N,): golden-section
    search on log T down to an interval `tol` wide (in log T, so T to a relative 1e-5).
    Deterministic."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)

    def cost(log_t: float) -> float:
        return scaled_nll(z, y, math.exp(log_t))

    lo, hi = math.log(t_range[0]), math.log(t_range[1])
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    cost_a, cost_b = cost(a), cost(b)
    while hi - lo > tol:
        if cost_a <= cost_b:  # the minimum lies in [lo, b]
            hi, b, cost_b = b, a, cost_a
            a = hi - GOLDEN * (hi - lo)
            cost_a = cost(a)
        else:  # in [a, hi]
            lo, a, cost_a = a, b, cost_b
            b = lo + GOLDEN * (hi - lo)
            cost_b = cost(b)
    return math.exp((lo + hi) / 2)


def scaled_confidence(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(N,) the top-1 probability of softmax(logits / T); the top-1 class itself does not change (T
    > 0)."""
    z = torch.as_tensor(np.asarray(logits), dtype=torch.float64) / temperature
    return z.softmax(-1).max(-1).values.float().numpy()


def calibration_scores(confidence: np.ndarray, correct: np.ndarray, nll: np.ndarray,
                       n_bins: int = N_BINS) -> dict:
    """ece and nll (the mean of the rows' NLL (N,)) of gathered predictions."""
    return {"ece": expected_calibration_error(confidence, correct, n_bins),
            "nll": float(np.mean(np.asarray(nll, dtype=np.float64)))}
