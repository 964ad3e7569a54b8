"""Linear few-shot accuracy: closed-form ridge regression on frozen features (big_vision
`fewshot_lsr`).

The protocol, as big_vision runs it (ViT paper, App. B.1.1 "few-shot linear"):
  1. per seed, one permutation of each class's example indices from `np.random.default_rng(seed)`,
  classes
     visited in order 0..K-1; the k-shot set is the first k of every permutation, so sets nest
     across k;
  2. standardise every feature with the shot set's mean and population std (+1e-5), and the test
  features
     with the same statistics;
  3. append a constant feature of 100: its weight is the bias, nearly unregularised because a unit
  of
     weight there moves the output 100 times as much as on a standardised feature;
  4. regress {-1, 1}^K targets (2 * onehot - 1) with an L2 penalty l2_reg (default 2**10) on all D+1
     weights, and score the argmax on the test set.

Derivation kept beside the code, as big_vision does. With X (N, P) the augmented features (P = D +
1):
  primal (N >= P):  W = (XᵀX + λI)⁻¹ XᵀY     and  XᵀX = Q diag(e) Qᵀ,  so  W = Q diag(1/(e+λ)) QᵀXᵀY
  dual   (N <  P):  W = Xᵀ(XXᵀ + λI)⁻¹ Y     and  XXᵀ = Q diag(e) Qᵀ,  so  W = XᵀQ diag(1/(e+λ)) QᵀY
One eigendecomposition of the smaller Gram matrix serves every λ: another λ is one rescale of e.

Everything here is numpy float64. big_vision runs the same algebra in JAX float32; we pay the extra
precision because forming the Gram matrix squares X's condition number (the bias column alone is
100x the others) and the leave-one-out grid goes down to λ = 2**-10, where float32 loses most
digits. At these sizes (P <= 1025) float64 costs milliseconds, and features arrive as numpy arrays
from the feature cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vitcli.errors import DataError

BIAS_CONSTANT = 100.0  # big_vision BIAS_CONSTANT
STD_EPS = 1e-5  # added to the std, so constant features do not divide by zero
DEFAULT_L2_REG = 2.0**10  # big_vision common_fewshot `l2_reg`
L2_GRID = 2.0 ** np.arange(-10, 21)  # candidates for leave-one-out choice, 2^-10 .. 2^20


@dataclass(frozen=True)
class LsrCache:
    """Everything about one shot set's features that does not depend on the targets or on λ."""

    mean: np.ndarray  # (1, D) shot-set mean
    std: np.ndarray  # (1, D) shot-set population std + STD_EPS
    x: np.ndarray  # (N, P) standardised shot features with the bias column, P = D + 1
    eigs: np.ndarray  # (R,) eigenvalues of XᵀX (primal, R = P) or XXᵀ (dual, R = N)
    q: np.ndarray  # (R, R) their orthonormal eigenvectors
    primal: bool  # True when N >= P


def _check_features(x: np.ndarray, name: str) -> np.ndarray:
    """float64 (N, D) copy of `x`, or a DataError naming the set."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise DataError(f"few-shot {name} features must be a non-empty (N, D) array, got shape {x.shape}")
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise DataError(
            f"few-shot {name} features contain NaN or inf in {int(bad.sum())} of {len(x)} rows "
            f"(first row {int(np.argmax(bad))}); check the checkpoint and the images"
        )
    return x


def _augment(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Standardise with the shot-set statistics and append the bias column: (N, D) -> (N, D + 1)."""
    z = (x - mean) / std
    return np.concatenate([z, np.full((len(z), 1), BIAS_CONSTANT)], axis=1)


def targets(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Regression targets 2 * onehot - 1: (N,) integer labels -> (N, K) in {-1, 1}."""
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DataError(f"few-shot labels must lie in [0, {num_classes}), got {labels.min()}..{labels.max()}")
    return 2.0 * np.eye(num_classes)[labels] - 1.0


# ShotSet.record, a result row's
DRAW_FIELDS = ("classes", "short_classes", "empty_classes", "examples")


@dataclass(frozen=True)
class ShotSet:
    """One seed's shot set, and how far it falls short of `shots` examples in each of the K
    classes."""

    indices: np.ndarray  # (N,) train rows, class 0's first; N = shots * K unless a class is short
    shots: int
    per_class: np.ndarray  # (K,) examples taken from each class: min(shots, examples the class has)

    @property
    def short_classes(self) -> int:
        """Classes with fewer than `shots` examples (empty ones included)."""
        return int((self.per_class < self.shots).sum())

    def record(self) -> dict[str, int]:
        """What a result row says about the draw: classes, short and empty ones, examples
        (of shots * classes)."""
        values = len(self.per_class), self.short_classes, int((self.per_class == 0).sum()), len(self.indices)
        return dict(zip(DRAW_FIELDS, values, strict=True))


def sample_shots(labels: np.ndarray, shots: int, seed: int, num_classes: int | None = None) -> ShotSet:
    """Up to `shots` examples per class, drawn exactly as big_vision draws them (nested across
    shots).

    One `default_rng(seed)` permutes each class's indices, classes 0..num_classes-1 in order (all of
    them, empty ones too, before any are cut), and the first `shots` of each are concatenated in
    class order. As in big_vision a class with fewer examples gives what it has, possibly none
    (VTAB-1k's 1,000 train images over SUN397's 397 classes); the ShotSet says how many classes fell
    short. Only an empty draw is an error.
    """
    labels = np.asarray(labels)
    if shots < 1:
        raise DataError(f"few-shot shots must be >= 1, got {shots}")
    if num_classes is None:
        num_classes = int(labels.max()) + 1 if labels.size else 0
    rng = np.random.default_rng(seed)
    per_class = [rng.permutation(np.flatnonzero(labels == c))[:shots] for c in range(num_classes)]
    if not sum(len(idx) for idx in per_class):
        raise DataError(f"the few-shot train split has no example of classes 0..{num_classes - 1} "
                        f"({labels.size} labels): nothing to fit; "
                        "check the task's train split and label column")
    return ShotSet(np.concatenate(per_class), shots, np.array([len(idx) for idx in per_class]))


def precompute(x_train: np.ndarray) -> LsrCache:
    """Standardisation statistics and the eigendecomposition of the smaller Gram matrix of one shot
    set."""
    x_train = _check_features(x_train, "train")
    mean = x_train.mean(axis=0, keepdims=True)
    std = x_train.std(axis=0, keepdims=True) + STD_EPS  # population std (ddof=0), as jnp.std
    x = _augment(x_train, mean, std)  # (N, P)
    primal = x.shape[0] >= x.shape[1]
    eigs, q = np.linalg.eigh(x.T @ x if primal else x @ x.T)  # (R,), (R, R)
    return LsrCache(mean=mean, std=std, x=x, eigs=eigs, q=q, primal=primal)


def solve(cache: LsrCache, y_onehot_pm1: np.ndarray, l2_reg: float) -> np.ndarray:
    """Ridge weights W (D + 1, K) for targets (N, K) in {-1, 1}; the last row is the bias weight."""
    if l2_reg <= 0:
        raise DataError(f"few-shot l2_reg must be positive, got {l2_reg}")
    y = np.asarray(y_onehot_pm1, dtype=np.float64)
    scale = 1.0 / (cache.eigs + l2_reg)  # (R,)
    if cache.primal:
        return cache.q @ (scale[:, None] * (cache.q.T @ (cache.x.T @ y)))
    return cache.x.T @ (cache.q @ (scale[:, None] * (cache.q.T @ y)))


def predict(cache: LsrCache, w: np.ndarray, x_test: np.ndarray) -> np.ndarray:
    """Logits (M, K) of test features (M, D), standardised with the shot set's statistics."""
    x_test = _check_features(x_test, "test")
    if x_test.shape[1] != cache.mean.shape[1]:
        raise DataError(f"few-shot test features have D={x_test.shape[1]}, "
                        f"train features D={cache.mean.shape[1]}")
    return _augment(x_test, cache.mean, cache.std) @ w


def score(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    l2_reg: float | str = DEFAULT_L2_REG,
) -> tuple[float, float]:
    """(top-1 accuracy on the test set, λ used) of the ridge classifier fitted on the shot set.

    The one scoring function of `vit eval-fewshot` and of few-shot evaluation during training.
    `l2_reg` is a positive number or "auto" (the λ of L2_GRID with the lowest leave-one-out error on
    the shot set).
    """
    if len(x_train) != len(y_train) or len(x_test) != len(y_test):
        raise DataError(
            f"few-shot features and labels differ in length: train {len(x_train)} vs {len(y_train)}, "
            f"test {len(x_test)} vs {len(y_test)}"
        )
    cache = precompute(x_train)
    y = targets(y_train, num_classes)
    l2 = choose_l2(cache, y)[0] if l2_reg == "auto" else float(l2_reg)
    logits = predict(cache, solve(cache, y, l2), x_test)  # (M, K)
    return float(np.mean(logits.argmax(axis=1) == np.asarray(y_test))), l2


def loo_errors(cache: LsrCache, y_onehot_pm1: np.ndarray, l2_regs=L2_GRID) -> np.ndarray:
    """Exact leave-one-out classification error of the shot set for each λ in `l2_regs`.

    With hat matrix H = X (XᵀX + λI)⁻¹ Xᵀ, the prediction for point i from a fit without it is
    y_i - r_i / (1 - H_ii), r = Y - HY; exact for ridge because the bias is just another column of
    X. In eigen terms H = B diag(h) Bᵀ with B = XQ, h = 1/(e+λ) (primal) or B = Q, h = e/(e+λ)
    (dual). The standardisation stays the one of the full shot set (point i included), so the refit
    this matches is "same features, row i dropped", not "re-standardise without i".
    """
    y = np.asarray(y_onehot_pm1, dtype=np.float64)  # (N, K)
    labels = y.argmax(axis=1)
    basis = cache.x @ cache.q if cache.primal else cache.q  # (N, R)
    basis_sq = basis**2
    basis_y = basis.T @ y  # (R, K)
    errors = []
    for l2_reg in np.atleast_1d(l2_regs):
        # (R,)
        h = 1.0 / (cache.eigs + l2_reg) if cache.primal else cache.eigs / (cache.eigs + l2_reg)
        fitted = basis @ (h[:, None] * basis_y)  # (N, K) = HY
        leverage = basis_sq @ h  # (N,) = diag(H)
        held_out = y - (y - fitted) / (1.0 - leverage)[:, None]  # (N, K)
        errors.append(np.mean(held_out.argmax(axis=1) != labels))
    return np.asarray(errors)


def choose_l2(cache: LsrCache, y_onehot_pm1: np.ndarray, grid=L2_GRID) -> tuple[float, np.ndarray]:
    """The λ in `grid` with the lowest leave-one-out error, and the errors; ties go to the larger λ.

    Larger wins ties because it is the more conservative fit. With one shot per class every held-out
    point loses its whole class, so the error is (near) 100% for every λ and the largest is
    returned: LOO says nothing there, so prefer a fixed l2_reg at 1 shot.
    """
    grid = np.asarray(grid, dtype=np.float64)
    errors = loo_errors(cache, y_onehot_pm1, grid)
    tied = np.flatnonzero(errors == errors.min())
    return float(grid[tied].max()), errors
