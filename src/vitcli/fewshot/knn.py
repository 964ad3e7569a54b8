"""Weighted k-nearest-neighbour classification of frozen features, with DINO's semantics (Caron et
al. 2021, facebookresearch/dino eval_knn.py `knn_classifier`):

  1. train and test features are L2-normalised, so a dot product is the cosine similarity;
  2. each test point takes its k most similar train points (k = 20 by default);
  3. each neighbour votes for its class with weight exp(similarity / T), T = 0.07;
  4. classes are ranked by their summed votes: top-1 is the first, top-5 whether the label is among
  the
     first min(5, k).

Written here rather than imported: DINO is not a package, and timm has no kNN evaluator. The test
points go in chunks so that the (chunk, N_train) similarity matrix stays bounded for ImageNet-sized
train sets; the chunking changes nothing in the result (each test point is scored on its own).
"""

from __future__ import annotations

import numpy as np
import torch

from vitcli.errors import DataError

DEFAULT_K = 20  # DINO reports k in {10, 20, 100, 200}; 20 is its usual headline
DEFAULT_TEMPERATURE = 0.07  # DINO's T for the vote weights
CHUNK_ELEMENTS = 1 << 26  # similarities held at once (256 MB in float32): a chunk of test rows


def normalise(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (torch.nn.functional.normalize's eps guards an all-zero row)."""
    return torch.nn.functional.normalize(x, dim=1)


def class_votes(train: torch.Tensor, train_labels: torch.Tensor, test: torch.Tensor, k: int,
                temperature: float, num_classes: int) -> torch.Tensor:
    """(M, K) summed vote weights per class of each test row: the k nearest train rows (cosine
    similarity of already normalised `train` (N, D) and `test` (M, D)) each add exp(sim /
    temperature) to its class."""
    k = min(k, len(train))  # fewer train points than k: every one votes
    out = []
    step = max(1, CHUNK_ELEMENTS // max(len(train), 1))
    for start in range(0, len(test), step):
        sim = test[start:start + step] @ train.T  # (m, N)
        top, idx = sim.topk(k, dim=1, largest=True, sorted=True)  # (m, k)
        votes = torch.zeros(len(sim), num_classes, dtype=sim.dtype, device=sim.device)
        out.append(votes.scatter_add_(1, train_labels[idx], (top / temperature).exp()))
    return torch.cat(out) if out else torch.zeros(0, num_classes, dtype=train.dtype, device=train.device)


def knn_accuracy(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                 num_classes: int, k: int = DEFAULT_K, temperature: float = DEFAULT_TEMPERATURE,
                 device: torch.device | str = "cpu") -> dict[str, float]:
    """{"top1", "top5"} of the weighted kNN classifier (top-5 only with at least 5 classes):
    fractions of the test rows whose label is the first-ranked class, or among the first min(5, k).
    float32 on `device`, as DINO runs it."""
    if len(x_train) == 0 or len(x_test) == 0:
        raise DataError(f"kNN needs train and test features, got {len(x_train)} train and {len(x_test)} test")
    as_tensor = lambda a, dtype: torch.as_tensor(np.asarray(a), dtype=dtype, device=device)
    train, test = normalise(as_tensor(x_train, torch.float32)), normalise(as_tensor(x_test, torch.float32))
    labels = as_tensor(y_test, torch.int64)
    votes = class_votes(train, as_tensor(y_train, torch.int64), test, k, temperature, num_classes)
    ranked = votes.sort(dim=1, descending=True).indices  # as DINO: probs.sort(1, True)
    correct = ranked == labels[:, None]  # (M, K)
    out = {"top1": float(correct[:, 0].double().mean())}
    if num_classes >= 5:
        out["top5"] = float(correct[:, :min(5, k)].any(dim=1).double().mean())
    return out
