"""The protocols that score a task's frozen features on all of its train split, beside few-shot:
each a small evaluator on the features one extraction gave (so a second protocol extracts nothing),
in `vit eval-fewshot --protocols` and in training (`knn/TASK/top1`, `linear/TASK/top1`,
`ridge/TASK/top1`, and top-5 with at least 5 classes).

  knn     DINO's weighted kNN (fewshot.knn): k = fewshot.knn_k, T = fewshot.knn_temperature
  linear  a multinomial logistic probe, λ chosen on fewshot.probe_holdout of train (fewshot.probe: CLIP's)
  ridge   the few-shot solver's closed-form least squares fitted on every train example (fewshot.solver),
          λ by exact leave-one-out over its grid, which all of train makes meaningful (one shot does
          not)
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from vitcli.fewshot import knn, probe, solver
from vitcli.recipe.choices import ALL_DATA_PROTOCOLS
from vitcli.recipe.schema import FewshotConfig


def score(protocol: str, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
          num_classes: int, cfg: FewshotConfig, device: torch.device | str = "cpu") -> dict:
    """One protocol's figures on one task: top1 (top5 with >= 5 classes) and what it chose (k,
    λ)."""
    (x_tr, y_tr), (x_te, y_te) = train, test
    if protocol == "knn":
        out = knn.knn_accuracy(x_tr, y_tr, x_te, y_te, num_classes, cfg.knn_k, cfg.knn_temperature, device)
        return {**out, "k": min(cfg.knn_k, len(y_tr)), "temperature": cfg.knn_temperature}
    if protocol == "linear":
        return probe.linear_probe(x_tr, y_tr, x_te, y_te, num_classes, holdout=cfg.probe_holdout,
                                  device=device)
    if protocol == "ridge":
        top1, l2 = solver.score(x_tr, y_tr, x_te, y_te, num_classes, "auto")
        return {"top1": top1, "l2": l2}
    raise ValueError(f"unknown protocol {protocol!r}")  # the recipe checks refuse it first


def task_rows(train, test, num_classes: int, cfg: FewshotConfig, name: str,
              device: torch.device | str = "cpu") -> list[dict]:
    """A row per all-data protocol the recipe names, in ALL_DATA_PROTOCOLS' order: task, protocol,
    the train and test sizes, score()'s figures and the seconds it took (on the features: no
    extraction)."""
    rows = []
    for p in (p for p in ALL_DATA_PROTOCOLS if p in cfg.protocols):
        start = time.perf_counter()
        figures = score(p, train, test, num_classes, cfg, device)
        rows.append({"task": name, "protocol": p, "train": len(train[1]), "test": len(test[1]), **figures,
                     "seconds": time.perf_counter() - start})
    return rows


def metrics(rows: list[dict]) -> Iterator[tuple[str, float]]:
    """`PROTOCOL/TASK/top1` (and top5) of task_rows' rows: what training logs."""
    for row in rows:
        for k in ("top1", "top5"):
            if k in row:
                yield f"{row['protocol']}/{row['task']}/{k}", row[k]
