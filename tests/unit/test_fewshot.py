"""The few-shot ridge solver matches a direct solve, its leave-one-out matches refits, and shots
nest."""

import numpy as np
import pytest

from vitcli.errors import DataError
from vitcli.fewshot import solver as fs

RTOL = 1e-6  # float64 eigendecomposition vs float64 direct solve


def _augmented(x_train: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Reference preprocessing, written out: shot-set mean / population std + 1e-5, then a column of
    100."""
    mean, std = x_train.mean(0), np.sqrt(((x_train - x_train.mean(0)) ** 2).mean(0)) + 1e-5
    return np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])


def _problem(n: int, d: int, k: int, seed: int = 0, spread: float = 1.0):
    """Features with class-dependent means (so accuracy and LOO are neither 0 nor 1) and their
    labels."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % k
    centres = rng.normal(size=(k, d)) * spread
    return centres[labels] + rng.normal(size=(n, d)) * 2.0 + 3.0, labels


@pytest.mark.parametrize("n,d", [(120, 16), (24, 40)], ids=["primal N>=D", "dual N<D"])
def test_solve_matches_direct_ridge_at_every_l2(n, d):
    x, labels = _problem(n, d, k=4)
    y = 2.0 * np.eye(4)[labels] - 1.0
    cache = fs.precompute(x)
    assert cache.primal == (n >= d + 1)
    big_x = _augmented(x, x)
    for l2_reg in (2.0**-3, 1.0, 1024.0, 2.0**15):  # one cache, every λ is a rescale
        direct = np.linalg.solve(big_x.T @ big_x + l2_reg * np.eye(d + 1), big_x.T @ y)
        np.testing.assert_allclose(fs.solve(cache, y, l2_reg), direct, rtol=RTOL,
                                   atol=RTOL * np.abs(direct).max())


@pytest.mark.parametrize("n,d", [(120, 16), (24, 40)], ids=["primal", "dual"])
def test_accuracy_matches_direct_pipeline(n, d):
    x, labels = _problem(n, d, k=4, spread=0.7)
    x_test, y_test = _problem(200, d, k=4, seed=0, spread=0.7)  # same centres (same seed), fresh noise rows
    x_test = x_test + np.random.default_rng(1).normal(size=x_test.shape)
    big_x = _augmented(x, x)
    w = np.linalg.solve(big_x.T @ big_x + 1024.0 * np.eye(d + 1), big_x.T @ (2.0 * np.eye(4)[labels] - 1.0))
    expected = np.mean((_augmented(x, x_test) @ w).argmax(1) == y_test)
    assert 0.0 < expected < 1.0
    accuracy, l2 = fs.score(x, labels, x_test, y_test, num_classes=4)
    assert (accuracy, l2) == (pytest.approx(expected), 1024.0)


def test_auto_l2_scores_with_the_leave_one_out_choice():
    x, labels = _problem(60, 10, k=3, spread=0.6)
    x_test, y_test = _problem(90, 10, k=3, seed=0, spread=0.6)
    chosen = fs.choose_l2(fs.precompute(x), fs.targets(labels, 3))[0]
    assert fs.score(x, labels, x_test, y_test, 3, "auto") == fs.score(x, labels, x_test, y_test, 3, chosen)


@pytest.mark.parametrize("n,d", [(60, 10), (30, 50)], ids=["primal", "dual"])
def test_loo_matches_refits_without_each_point(n, d):
    x, labels = _problem(n, d, k=3, spread=0.6)
    y = 2.0 * np.eye(3)[labels] - 1.0
    big_x = _augmented(x, x)  # standardised on the full shot set, as loo_errors documents
    grid = np.array([2.0**-6, 1.0, 64.0, 4096.0])
    expected = []
    for l2_reg in grid:
        wrong = 0
        for i in range(n):
            keep = np.arange(n) != i
            w = np.linalg.solve(big_x[keep].T @ big_x[keep] + l2_reg * np.eye(d + 1), big_x[keep].T @ y[keep])
            wrong += int((big_x[i] @ w).argmax() != labels[i])
        expected.append(wrong / n)
    assert len(set(expected)) > 1  # the grid matters here, so a λ mix-up would show
    np.testing.assert_array_equal(fs.loo_errors(fs.precompute(x), y, grid), expected)


def test_choose_l2_picks_lowest_error_and_larger_on_ties():
    x, labels = _problem(60, 10, k=3, spread=0.6)
    y = 2.0 * np.eye(3)[labels] - 1.0
    cache = fs.precompute(x)
    grid = 2.0 ** np.arange(-4, 14)
    best, errors = fs.choose_l2(cache, y, grid)
    np.testing.assert_array_equal(errors, fs.loo_errors(cache, y, grid))
    assert errors[grid == best][0] == errors.min()
    assert best == grid[errors == errors.min()].max()
    separated, sep_labels = _problem(60, 10, k=3, spread=50.0)  # every λ classifies every point right
    best, errors = fs.choose_l2(fs.precompute(separated), 2.0 * np.eye(3)[sep_labels] - 1.0, grid)
    assert errors.max() == 0.0 and best == grid.max()


def test_sample_shots_follows_big_vision_draw_and_nests():
    labels = np.random.default_rng(5).integers(0, 4, size=200)
    rng = np.random.default_rng(7)  # the documented procedure, spelled out
    perms = [rng.permutation(np.where(labels == c)[0]) for c in range(4)]
    for shots in (1, 5, 10, 25):
        idx = fs.sample_shots(labels, shots, seed=7).indices
        np.testing.assert_array_equal(idx, np.concatenate([p[:shots] for p in perms]))
        np.testing.assert_array_equal(np.bincount(labels[idx], minlength=4), [shots] * 4)
    small, large = fs.sample_shots(labels, 5, seed=7).indices, fs.sample_shots(labels, 10, seed=7).indices
    for c in range(4):  # nested: the 5-shot set of each class is the start of its 10-shot set
        np.testing.assert_array_equal(small[labels[small] == c], large[labels[large] == c][:5])


def test_sample_shots_is_deterministic_per_seed_and_varies_across_seeds():
    labels = np.arange(300) % 10
    np.testing.assert_array_equal(fs.sample_shots(labels, 5, 0).indices,
                                  fs.sample_shots(labels, 5, 0).indices)
    assert not np.array_equal(fs.sample_shots(labels, 5, 0).indices, fs.sample_shots(labels, 5, 1).indices)


def test_only_an_empty_draw_is_an_error():
    with pytest.raises(DataError, match="no example of classes 0..3"):
        fs.sample_shots(np.array([7, 9]), 5, seed=0, num_classes=4)  # labels outside 0..K-1 are not drawn
    with pytest.raises(DataError, match="0 labels"):
        fs.sample_shots(np.array([], dtype=np.int64), 1, seed=0)


def test_non_finite_features_name_the_set():
    x, labels = _problem(20, 8, k=2)
    bad = x.copy()
    bad[3, 2] = np.nan
    with pytest.raises(DataError, match="train features contain NaN or inf in 1 of 20 rows"):
        fs.score(bad, labels, x, labels, num_classes=2)
    bad[3, 2] = np.inf
    with pytest.raises(DataError, match="test features contain NaN or inf"):
        fs.score(x, labels, bad, labels, num_classes=2)


def test_test_features_of_another_width_are_rejected():
    x, labels = _problem(20, 8, k=2)
    cache = fs.precompute(x)
    w = fs.solve(cache, fs.targets(labels, 2), 1.0)
    with pytest.raises(DataError, match="D=5, train features D=8"):
        fs.predict(cache, w, x[:, :5])
