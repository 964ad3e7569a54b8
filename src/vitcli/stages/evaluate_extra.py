"""What `vit evaluate` reports beside top-1: calibration (ECE, NLL, a reliability diagram; softmax
models), temperature scaling fitted on a held-out split (--calibrate-on), and test-time augmentation
(--tta).

The per-row numbers ride on evaluate's one pass (`per_row` is its `extra`, so they are gathered back
in row order under torchrun like the predictions); the scores are computed from the gathered rows
here. None of it changes the plain numbers: top1, top5, loss, ece and nll are always the
un-augmented, unscaled model's. A sigmoid-loss model's probabilities are per-class, not one
distribution over the classes, so it has no top-label calibration in Guo et al.'s sense: no ece, nll
or diagram, and --calibrate-on is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vitcli.errors import RecipeError
from vitcli.evaluators import calibration, classify
from vitcli.evaluators.tta import averaged_probs
from vitcli.figures.reliability import write_reliability
from vitcli.runtime.metrics import console
from vitcli.runtime.run_files import RELIABILITY_PLOT

# the printed report's rows, after top1, top5 and loss
REPORTED = ("ece", "nll", "ts/temperature", "ts/ece", "ts/nll", "tta/top1", "tta/top5")


def check_held_out(held_out: str | None, split: str, loss: str) -> None:
    """Refuse a --calibrate-on split that is the evaluated one (or holds it, or is held by it: the
    same split unsliced on either side), and temperature scaling of a sigmoid-loss model. Slices of
    one split that overlap (test[:600] and test[500:]) are not detected."""
    if held_out is None:
        return
    if not held_out.strip():
        raise RecipeError("--calibrate-on needs a split name, e.g. validation or train[:5000]")
    base, other = held_out.split("[")[0].strip(), split.split("[")[0].strip()
    # one of them is the whole split
    whole = base == other and ("[" not in held_out or "[" not in split)
    if held_out.strip() == split.strip() or whole:
        raise RecipeError(f"--calibrate-on {held_out} overlaps the evaluated split '{split}': fit the "
                          "temperature on held-out images (another split, or another slice of it)")
    if loss != "softmax":
        raise RecipeError(f"--calibrate-on: temperature scaling fits a softmax, and this model was trained "
                          f"with optim.loss={loss}")


def per_row(softmax: bool, tta: tuple[str, ...], keep_logits: bool, k: int,
            columns: torch.Tensor | None = None):
    """evaluate.predictions' `extra`: a batch's (NLL of the label (B, 1), TTA's top-k classes (B,
    k), logits (B, K)), each (B, 0) when not asked for (NLL: a sigmoid-loss model). `columns`: an
    ImageNet set's classes (robustness.Scoring): the views' logits are cut to them as the plain ones
    are, and TTA's classes are the head's."""
    def activate(logits: torch.Tensor) -> torch.Tensor:
        return logits.softmax(-1) if softmax else logits.sigmoid()

    def probs(logits: torch.Tensor) -> torch.Tensor:  # a view's: the head's logits, cut as x's were
        return activate(logits if columns is None else logits[:, columns])

    def extra(model, x, logits, y) -> tuple[np.ndarray, ...]:
        empty = np.zeros((len(y), 0), dtype=np.float32)
        nll = calibration.row_nll(logits, y)[:, None].cpu().numpy() if softmax else empty
        own = activate(logits)  # x's own: already cut to `columns`
        tta_top = averaged_probs(model, x, tta, probs, own).topk(k, dim=-1).indices if tta else None
        # positions among the set's classes -> the head's
        if tta_top is not None and columns is not None:
            tta_top = columns[tta_top]
        tta_top = empty if tta_top is None else tta_top.cpu().numpy()
        return nll, tta_top, logits.cpu().numpy() if keep_logits else empty

    return extra


def calibration_results(top: np.ndarray, probs: np.ndarray, labels: np.ndarray, nll: np.ndarray) -> dict:
    """ece and nll of the plain predictions (top-1 confidence probs[:, 0]); {} for a sigmoid-loss
    model."""
    if nll.shape[1] == 0:
        return {}
    return calibration.calibration_scores(probs[:, 0], top[:, 0] == labels, nll[:, 0])


def tta_results(tta_top: np.ndarray, labels: np.ndarray, tta: tuple[str, ...], top5: bool) -> dict:
    """tta/views, tta/top1 and (with >= 5 classes) tta/top5 of the views' averaged probabilities."""
    if not tta:
        return {}
    n = max(len(labels), 1)
    out = {"tta/views": "+".join(tta),
           "tta/top1": float(classify.top_k_correct(tta_top, labels, 1).sum() / n)}
    if top5:
        out["tta/top5"] = float(classify.top_k_correct(tta_top, labels, 5).sum() / n)
    return out


def scaled_results(temperature: float, held_out: str, held_rows: int, logits: np.ndarray,
                   top: np.ndarray, labels: np.ndarray) -> dict:
    """ts/...: the temperature fitted on `held_out` (held_rows images), and the evaluated split's
    ECE and NLL with the logits divided by it (top-1 does not change)."""
    confidence = calibration.scaled_confidence(logits, temperature)
    nll = calibration.scaled_nll(torch.as_tensor(logits), torch.as_tensor(labels), temperature)
    return {"ts/split": held_out, "ts/images": held_rows, "ts/temperature": temperature,
            "ts/ece": calibration.expected_calibration_error(confidence, top[:, 0] == labels), "ts/nll": nll}


def write_plot(results: dict, top: np.ndarray, probs: np.ndarray, labels: np.ndarray, workdir: Path) -> None:
    """reliability.png of the plain predictions, its path in results (rank 0; softmax models
    only)."""
    if "ece" not in results:
        console.log(f"a sigmoid-loss model: no ece, nll or {RELIABILITY_PLOT} (per-class probabilities)")
        # an earlier run's, not named in results.json
        (workdir / RELIABILITY_PLOT).unlink(missing_ok=True)
        return
    bins = calibration.reliability_bins(probs[:, 0], top[:, 0] == labels)
    title = f"{Path(results['checkpoint']).name} on {results['data']} {results['split']}"
    write_reliability(*bins, f"{title}\nECE {results['ece']:.4f} ({calibration.N_BINS} bins)",
                      workdir / RELIABILITY_PLOT)
    results["reliability_png"] = str(workdir / RELIABILITY_PLOT)
