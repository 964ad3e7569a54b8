"""The frozen-feature protocols beside few-shot: weighted kNN against a transliteration of DINO's
`knn_classifier`, the logistic probe against scikit-learn's LogisticRegression(lbfgs)."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression  # a test dependency (pyproject: test)

from vitcli.errors import DataError
from vitcli.fewshot import knn, probe


def clustered(n_train: int, n_test: int, classes: int, dim: int, spread: float, seed: int):
    """(train features, labels, test features, labels) around one random centre per class, shared by
    both."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * spread

    def draw(n):
        y = rng.integers(0, classes, n)
        return (centres[y] + rng.normal(size=(n, dim))).astype(np.float32), y

    return (*draw(n_train), *draw(n_test))


def dino_knn_classifier(train_features, train_labels, test_features, test_labels, k, T, num_classes):
    """facebookresearch/dino eval_knn.py `knn_classifier`, transliterated (100 chunks of test rows,
    the one-hot retrieval matrix, exp(distance / T) weights, probs.sort(1, True)); returns
    percentages."""
    top1, top5, total = 0.0, 0.0, 0
    train_features = train_features.t()
    num_test_images, num_chunks = test_labels.shape[0], 100
    imgs_per_chunk = max(num_test_images // num_chunks, 1)
    retrieval_one_hot = torch.zeros(k, num_classes)
    for idx in range(0, num_test_images, imgs_per_chunk):
        features = test_features[idx:min((idx + imgs_per_chunk), num_test_images), :]
        targets = test_labels[idx:min((idx + imgs_per_chunk), num_test_images)]
        batch_size = targets.shape[0]
        similarity = torch.mm(features, train_features)
        distances, indices = similarity.topk(k, largest=True, sorted=True)
        candidates = train_labels.view(1, -1).expand(batch_size, -1)
        retrieved_neighbors = torch.gather(candidates, 1, indices)
        retrieval_one_hot.resize_(batch_size * k, num_classes).zero_()
        retrieval_one_hot.scatter_(1, retrieved_neighbors.view(-1, 1), 1)
        distances_transform = distances.clone().div_(T).exp_()
        probs = torch.sum(torch.mul(retrieval_one_hot.view(batch_size, -1, num_classes),
                                    distances_transform.view(batch_size, -1, 1)), 1)
        _, predictions = probs.sort(1, True)
        correct = predictions.eq(targets.data.view(-1, 1))
        top1 = top1 + correct.narrow(1, 0, 1).sum().item()
        top5 = top5 + correct.narrow(1, 0, min(5, k)).sum().item()
        total += targets.size(0)
    return top1 * 100.0 / total, top5 * 100.0 / total


@pytest.mark.parametrize("k,classes", [(20, 10), (5, 7), (200, 12)])
def test_knn_matches_dinos_knn_classifier(k, classes):
    x_tr, y_tr, x_te, y_te = clustered(300, 250, classes, 24, 0.5, seed=k)
    ours = knn.knn_accuracy(x_tr, y_tr, x_te, y_te, classes, k=k, temperature=0.07)
    # DINO normalises at extraction (nn.functional.normalize(feats, dim=1, p=2))
    tr = torch.nn.functional.normalize(torch.from_numpy(x_tr), dim=1, p=2)
    te = torch.nn.functional.normalize(torch.from_numpy(x_te), dim=1, p=2)
    top1, top5 = dino_knn_classifier(tr, torch.from_numpy(y_tr), te, torch.from_numpy(y_te), k, 0.07, classes)
    # the same float32 products summed in another order: a vote can differ in its last bits, never a
    # rank
    assert ours["top1"] * 100 == pytest.approx(top1, abs=1e-9)
    assert ours["top5"] * 100 == pytest.approx(top5, abs=1e-9)
    assert 0 < ours["top1"] < 1  # neither trivial nor hopeless: the comparison can fail


def test_knn_votes_are_exp_similarity_over_t():
    """Hand case: 3 train points on the unit circle, one test point; k = 2 takes the two nearest."""
    train = knn.normalise(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    test = knn.normalise(torch.tensor([[1.0, 1.0]]))
    votes = knn.class_votes(train, torch.tensor([0, 1, 1]), test, k=2, temperature=0.5, num_classes=2)
    s = 1 / np.sqrt(2)  # cosine of 45 degrees to both of the nearest two
    assert votes.numpy() == pytest.approx(np.array([[np.exp(s / 0.5), np.exp(s / 0.5)]]), rel=1e-6)


def test_knn_chunking_changes_nothing(monkeypatch):
    x_tr, y_tr, x_te, y_te = clustered(200, 97, 6, 16, 0.4, seed=3)
    whole = knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 6)
    monkeypatch.setattr(knn, "CHUNK_ELEMENTS", 200 * 7)  # 7 test rows per chunk
    assert knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 6) == whole


def test_knn_with_fewer_train_points_than_k_uses_them_all():
    x_tr, y_tr, x_te, y_te = clustered(8, 20, 2, 4, 3.0, seed=5)
    out = knn.knn_accuracy(x_tr, y_tr, x_te, y_te, 2, k=20)
    assert set(out) == {"top1"} and 0 <= out["top1"] <= 1  # 2 classes: no top-5


def sklearn_probe(x_tr, y_tr, x_te, y_te, l2):
    """scikit-learn's LogisticRegression(lbfgs) at C = 1 / λ on the same standardised features."""
    mean, std = x_tr.mean(0), x_tr.std(0) + probe.STD_EPS
    clf = LogisticRegression(C=1 / l2, solver="lbfgs", max_iter=probe.MAX_ITER)
    clf.fit((x_tr - mean) / std, y_tr)
    return clf.score((x_te - mean) / std, y_te)


@pytest.mark.parametrize("l2", [1e-2, 1.0, 1e2])
def test_the_logistic_probe_matches_scikit_learn(l2):
    x_tr, y_tr, x_te, y_te = clustered(400, 600, 8, 32, 0.4, seed=7)
    x, y = torch.from_numpy(x_tr).double(), torch.from_numpy(y_tr)
    fitted = probe.fit(x, y, 8, l2)
    ours = probe.top_k(fitted.logits(torch.from_numpy(x_te).double()), torch.from_numpy(y_te), 1)
    theirs = sklearn_probe(x_tr.astype(np.float64), y_tr, x_te.astype(np.float64), y_te, l2)
    assert abs(ours - theirs) <= 0.005  # the tolerance: 0.5 points
    assert 0.3 < theirs < 0.99  # a task where regularisation matters: the comparison can fail


def test_the_fit_minimises_sklearns_objective():
    """Weights, not only accuracy: the same objective's minimiser, up to L-BFGS's stopping
    tolerance."""
    x_tr, y_tr, _, _ = clustered(300, 0, 5, 12, 0.4, seed=9)
    x = x_tr.astype(np.float64)
    z = (x - x.mean(0)) / (x.std(0) + probe.STD_EPS)
    fitted = probe.fit(torch.from_numpy(x), torch.from_numpy(y_tr), 5, 1.0)
    clf = LogisticRegression(C=1.0, tol=1e-8, max_iter=5000).fit(z, y_tr)
    # a softmax's logits are defined up to a constant per row: compare centred
    ours = fitted.logits(torch.from_numpy(x)).numpy()
    theirs = clf.decision_function(z)
    centred = lambda a: a - a.mean(axis=1, keepdims=True)
    assert np.abs(centred(ours) - centred(theirs)).max() < 0.02 * np.abs(centred(theirs)).max()


def test_lambda_is_chosen_on_held_out_train_rows():
    x_tr, y_tr, x_te, y_te = clustered(200, 100, 4, 16, 0.3, seed=10)
    out = probe.linear_probe(x_tr, y_tr, x_te, y_te, 4, grid=(1e-3, 1.0, 1e3))
    _, tried = probe.choose_l2(torch.from_numpy(x_tr).double(), torch.from_numpy(y_tr), 4, (1e-3, 1.0, 1e3))
    best = max(tried.values())
    assert out["l2"] == max(l2 for l2, acc in tried.items() if acc == best)
    assert out["holdout_top1"] == tried[out["l2"]] and set(out) == {"top1", "l2", "holdout_top1"}
    fit_rows, held = probe.holdout_split(200, 0.2)
    assert len(held) == 40 and not set(fit_rows) & set(held) and len(fit_rows) + len(held) == 200


def test_prior_logits_are_the_optimal_bias_at_zero_weights():
    y = torch.tensor([0, 0, 0, 1, 2, 2])
    b = probe.prior_logits(y, 3, torch.float64).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(b.expand(6, 3), y)
    loss.backward()
    assert b.grad.abs().max() < 1e-12


def test_too_few_train_examples_is_one_line():
    with pytest.raises(DataError, match="at least 2 train examples"):
        probe.holdout_split(1, 0.2)


def test_the_sweep_stops_past_the_peak(monkeypatch):
    """Held-out accuracy scripted per λ (a fit stands for its λ): the sweep stops 3 points past the
    peak."""
    scripted = {1e3: 0.2, 1e2: 0.4, 1e1: 0.6, 1e0: 0.8, 1e-1: 0.7, 1e-2: 0.8, 1e-3: 0.5, 1e-4: 0.5,
                1e-5: 0.5, 1e-6: 0.9}
    fitted = []

    class Scripted(float):
        def logits(self, rows):
            return float(self)

    monkeypatch.setattr(probe, "fit", lambda x, y, k, l2, *_, **__: fitted.append(l2) or Scripted(l2))
    monkeypatch.setattr(probe, "top_k", lambda l2, labels, k: scripted[l2])
    l2, _ = probe.choose_l2(torch.zeros(10, 2), torch.zeros(10, dtype=torch.int64), 2, grid=tuple(scripted))
    # 0.1 is below the best (0.8 at 1), 0.01 ties it (the count restarts), then three below: 1e-6
    # never fitted
    assert fitted == [1e3, 1e2, 1e1, 1e0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5] and l2 == 1.0
