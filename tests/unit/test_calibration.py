"""Calibration and test-time augmentation maths against independent computations: ECE by hand and by
a plain loop over the bins (Guo et al.'s reference code, gt(lower) & le(upper)), NLL against
cross_entropy, the fitted temperature against a grid search and against the temperature the labels
were drawn with, and the averaged test-time probabilities against the model run on each view by
hand."""

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitcli.evaluators import calibration
from vitcli.evaluators.tta import averaged_probs, views


def loop_bins(confidence: np.ndarray, correct: np.ndarray, n_bins: int) -> list[tuple[int, float, float]]:
    """(rows, accuracy, mean confidence) of each bin (lower, upper] as Guo et al.'s code finds them,
    one bin at a time; the edges torchmetrics' float32 linspace; (0, 0, 0) for an empty bin."""
    edges = torch.linspace(0, 1, n_bins + 1).tolist()
    conf32 = torch.as_tensor(confidence, dtype=torch.float32)
    out = []
    for lower, upper in itertools.pairwise(edges):
        inside = ((conf32 > lower) & (conf32 <= upper)).numpy()
        out.append((int(inside.sum()), float(np.mean(correct[inside])), float(np.mean(confidence[inside])))
                   if inside.any() else (0, 0.0, 0.0))
    return out


def loop_ece(confidence: np.ndarray, correct: np.ndarray, n_bins: int) -> float:
    """ECE from loop_bins: each bin's |accuracy - confidence| weighted by its share of the rows."""
    bins = loop_bins(confidence, correct, n_bins)
    return sum(n / len(confidence) * abs(acc - conf) for n, acc, conf in bins)


def test_ece_of_four_predictions_in_two_bins_by_hand():
    confidence = np.array([0.3, 0.4, 0.8, 0.9], dtype=np.float32)
    correct = np.array([True, False, True, True])
    low = 2 / 4 * abs(1 / 2 - (0.3 + 0.4) / 2)  # (0, 0.5]: one of two right, mean confidence 0.35
    high = 2 / 4 * abs(2 / 2 - (0.8 + 0.9) / 2)  # (0.5, 1]: both right, mean confidence 0.85
    ece = calibration.expected_calibration_error(confidence, correct, 2)
    assert ece == pytest.approx(low + high, abs=1e-7)


def test_a_confidence_on_a_bin_edge_belongs_to_the_lower_bin():
    # 0.5 wrong and 0.75 right in 2 bins: 0.5 in (0, 0.5] alone -> 1/2 * |0 - 0.5| + 1/2 * |1 -
    # 0.75|; had it gone to (0.5, 1] with 0.75 the one bin would give |1/2 - 0.625| = 0.125
    ece = calibration.expected_calibration_error(np.array([0.5, 0.75]), np.array([False, True]), 2)
    assert ece == pytest.approx(0.5 * 0.5 + 0.5 * 0.25, abs=1e-12)
    edges = torch.linspace(0, 1, 16).numpy()  # each float32 edge in the bin below it; 0 in the first
    assert calibration.bin_index(edges[1:]).tolist() == list(range(15))
    assert calibration.bin_index(np.array([0.0, 1.0], dtype=np.float32)).tolist() == [0, 14]


def test_ece_equals_a_loop_over_the_bins_on_random_predictions():
    rng = np.random.default_rng(0)
    logits = torch.as_tensor(rng.normal(0, 3, (2000, 10)), dtype=torch.float32)
    confidence = logits.softmax(-1).max(-1).values.numpy()
    confidence[:30] = torch.linspace(0, 1, 16).numpy()[rng.integers(1, 16, 30)]  # some exactly on edges
    correct = rng.random(2000) < confidence
    for n_bins in (15, 7):
        assert calibration.expected_calibration_error(confidence, correct, n_bins) == pytest.approx(
            loop_ece(confidence, correct, n_bins), abs=1e-6)
    counts, accuracy, mean_confidence = calibration.reliability_bins(confidence, correct)
    expected = np.array(loop_bins(confidence, correct, calibration.N_BINS))  # (15, 3)
    assert counts.tolist() == expected[:, 0].astype(int).tolist()
    np.testing.assert_allclose(np.stack([accuracy, mean_confidence], 1), expected[:, 1:], atol=1e-6, rtol=0)


def test_nll_equals_cross_entropy():
    rng = np.random.default_rng(1)
    logits = torch.as_tensor(rng.normal(0, 4, (300, 7)), dtype=torch.float32)
    labels = torch.as_tensor(rng.integers(0, 7, 300))
    assert calibration.row_nll(logits, labels).mean().item() == pytest.approx(
        F.cross_entropy(logits, labels).item(), abs=1e-6)
    assert calibration.scaled_nll(logits, labels, 1.7) == pytest.approx(
        F.cross_entropy(logits.double() / 1.7, labels).item(), abs=1e-12)


def drawn_with(temperature: float, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(logits (n, k), labels (n,)): labels drawn from softmax(logits / temperature)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (n, k))
    p = torch.as_tensor(logits / temperature).softmax(-1).numpy()
    labels = (p.cumsum(-1) < rng.random((n, 1))).sum(-1).clip(0, k - 1)  # inverse CDF draw per row
    return logits.astype(np.float32), labels


def test_fitted_temperature_is_the_grid_searchs_minimum():
    logits, labels = drawn_with(0.6, 500, 5, seed=2)
    step = 0.002  # in log T
    grid = torch.arange(math.log(0.05), math.log(20.0), step, dtype=torch.float64)  # (G,)
    z, y = torch.as_tensor(logits, dtype=torch.float64), torch.as_tensor(labels)
    scaled = z[None] / grid.exp()[:, None, None]  # (G, N, K)
    costs = torch.logsumexp(scaled, -1).mean(-1) - scaled[:, torch.arange(len(y)), y].mean(-1)  # (G,)
    best = grid[int(costs.argmin())].item()
    assert abs(math.log(calibration.fit_temperature(logits, labels)) - best) <= step


@pytest.mark.parametrize("temperature", [0.5, 2.5])
def test_fitting_recovers_the_temperature_labels_were_drawn_with(temperature):
    logits, labels = drawn_with(temperature, 20000, 10, seed=3)
    assert calibration.fit_temperature(logits, labels) == pytest.approx(temperature, rel=0.05)


def tiny_net(k: int = 4) -> torch.nn.Module:
    """A small position-dependent classifier (a flip changes its output), in eval mode."""
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 32 * 32, k))
    for p in net.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.1
    return net.eval()


def test_flip_averages_the_probabilities_of_x_and_its_mirror():
    net, x = tiny_net(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = (net(x).softmax(-1) + net(x.flip(-1)).softmax(-1)) / 2
        got = averaged_probs(net, x, ("flip",), lambda z: z.softmax(-1))
        assert not torch.allclose(net(x).softmax(-1), expected, atol=1e-4)  # the mirror does count
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_flip_takes_the_plain_views_probabilities_instead_of_a_second_forward():
    """The pass has x's probabilities already: given them, flip runs the model once (on the mirror);
    the crops, none of which is x, run it for every view."""
    net, x = tiny_net(), torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    seen = []
    counted = lambda v: seen.append(v) or net(v)
    with torch.no_grad():
        plain = net(x).softmax(-1)
        got = averaged_probs(counted, x, ("flip",), lambda z: z.softmax(-1), plain)
        assert len(seen) == 1 and torch.equal(seen[0], x.flip(-1))
        torch.testing.assert_close(got, averaged_probs(net, x, ("flip",), lambda z: z.softmax(-1)),
                                   atol=0, rtol=0)
        seen.clear()
        averaged_probs(counted, x, ("multicrop",), lambda z: z.softmax(-1), plain)
        assert len(seen) == 5


def test_multicrop_is_the_centre_and_corner_crops_resized_back():
    """28-pixel crops of 32 (0.875): rows/cols 0-27 and 4-31 at the corners, 2-29 in the centre;
    each upsampled back to 32 by plain bilinear interpolation; with flip, their mirrors too."""
    net, x = tiny_net(), torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    crops = [x[..., a:a + 28, b:b + 28] for a, b in ((0, 0), (0, 4), (4, 0), (4, 4), (2, 2))]
    up = [F.interpolate(c, size=(32, 32), mode="bilinear", align_corners=False) for c in crops]
    with torch.no_grad():
        five = sum(net(v).softmax(-1) for v in up) / 5
        ten = sum(net(v).softmax(-1) + net(v.flip(-1)).softmax(-1) for v in up) / 10
        torch.testing.assert_close(averaged_probs(net, x, ("multicrop",), lambda z: z.softmax(-1)), five,
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(averaged_probs(net, x, ("flip", "multicrop"), lambda z: z.softmax(-1)),
                                   ten, atol=1e-5, rtol=0)
    assert len(views(x, ("flip",))) == 2 and len(views(x, ("multicrop",))) == 5
    with pytest.raises(ValueError, match="unknown test-time views"):
        views(x, ("flop",))
