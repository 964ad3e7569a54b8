"""Short classes: a shot set takes what each class has (big_vision's draw), and every row says how
short it is.

VTAB-1k draws its shot sets from 1,000 images (train800val200); SUN397 has 397 classes, so some are
empty and most have fewer than 25. big_vision scores those shot counts on what there is; so do we,
and we mark them.
"""

import json

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.weights import save_weights
from vitcli.errors import DataError
from vitcli.fewshot import solver
from vitcli.fewshot.evaluate import FewshotEvaluator, evaluate_task
from vitcli.models import zoo
from vitcli.recipe.resolve import resolve
from vitcli.runtime.dist import Dist
from vitcli.stages.fewshot import eval_fewshot

CPU = Dist(0, 1, 0, torch.device("cpu"))
TINY_MODEL = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
              "model.num_heads=2", "model.mlp_dim=64"]
SUN_CLASSES, SUN_EMPTY = 397, 32  # VTAB-1k sun397: 1,000 train rows over 397 classes, some never seen


def big_vision_draw(labels: np.ndarray, shots: int, seed: int, num_classes: int) -> np.ndarray:
    """big_vision fewshot_lsr.compute_fewshot_metrics, written out: one rng per seed permutes every
    class's indices (classes in order, empty ones included), then each class gives its first
    `shots`."""
    rng = np.random.default_rng(seed)
    class_indices = [rng.permutation(np.where(labels == c)[0]) for c in range(num_classes)]
    return np.concatenate([indices[:shots] for indices in class_indices], axis=0)


def _long_tail(n: int, num_classes: int, empty: int, seed: int) -> np.ndarray:
    """n labels over the first num_classes - empty classes, each at least once, the rest
    long-tailed."""
    rng = np.random.default_rng(seed)
    seen = num_classes - empty
    weights = 1.0 / np.arange(1, seen + 1)
    extra = rng.choice(seen, size=n - seen, p=weights / weights.sum())
    return rng.permutation(np.concatenate([np.arange(seen), extra]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_short_and_empty_classes_give_big_visions_indices(seed):
    labels = np.array([0] * 30 + [1] * 3 + [3] * 12 + [4] * 1)  # class 2 and class 5 empty
    rng = np.random.default_rng(11)
    labels = rng.permutation(labels)
    for shots in (1, 5, 10, 25):
        drawn = solver.sample_shots(labels, shots, seed, num_classes=6)
        np.testing.assert_array_equal(drawn.indices, big_vision_draw(labels, shots, seed, 6))
        counts = np.bincount(labels, minlength=6)
        assert drawn.record() == {"classes": 6, "short_classes": int((counts < shots).sum()),
                                  "empty_classes": 2, "examples": int(np.minimum(counts, shots).sum())}


def test_a_vtab_sized_label_array_keeps_the_big_vision_order():
    labels = _long_tail(1000, SUN_CLASSES, SUN_EMPTY, seed=3)
    for shots in (1, 5, 10, 25):
        drawn = solver.sample_shots(labels, shots, 0, SUN_CLASSES)
        np.testing.assert_array_equal(drawn.indices, big_vision_draw(labels, shots, 0, SUN_CLASSES))
        assert drawn.record()["empty_classes"] == SUN_EMPTY


def test_solver_fits_k_columns_when_classes_are_empty():
    """Targets stay K wide: an empty class's column is all -1, so it is never predicted; equals the
    direct ridge solve on the augmented features."""
    rng = np.random.default_rng(0)
    labels = np.array([0] * 6 + [2] * 6 + [3] * 2)  # classes 1 and 4 have no example
    x = rng.normal(size=(len(labels), 5)) + labels[:, None]
    x_test = rng.normal(size=(40, 5)) + (np.arange(40) % 5)[:, None]
    y_test = np.arange(40) % 5
    mean, std = x.mean(0), x.std(0) + 1e-5
    big = np.hstack([(x - mean) / std, np.full((len(x), 1), 100.0)])
    w = np.linalg.solve(big.T @ big + 1024.0 * np.eye(6), big.T @ (2.0 * np.eye(5)[labels] - 1.0))
    logits = np.hstack([(x_test - mean) / std, np.full((40, 1), 100.0)]) @ w
    assert solver.score(x, labels, x_test, y_test, 5, 1024.0)[0] == pytest.approx(
        np.mean(logits.argmax(1) == y_test))
    assert not np.isin(logits.argmax(1), [1, 4]).any()


def test_an_empty_train_split_is_an_error_naming_the_task():
    recipe = resolve("pretrain", None, [], inputs=False)
    empty = (np.zeros((0, 4)), np.zeros(0, dtype=np.int64))
    test = (np.ones((3, 4)), np.zeros(3, dtype=np.int64))
    with pytest.raises(DataError, match="^vtab/sun397: the few-shot train split has no example"):
        evaluate_task(empty, test, SUN_CLASSES, recipe, "vtab/sun397")


# ---------------------------------------------------------------- end to end on a VTAB-1k-like
# local task


def _images(n: int, rng) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="module")
def sun_like(tmp_path_factory):
    """data_root/vtab/sun397 saved to disk: train (800) + validation (200) = VTAB-1k's 1,000 rows
    over 397 classes, 32 of them empty; a test split; and a tiny random-init ViT checkpoint."""
    root = tmp_path_factory.mktemp("sun")
    rng = np.random.default_rng(0)
    labels = _long_tail(1000, SUN_CLASSES, SUN_EMPTY, seed=1).tolist()
    test_labels = rng.integers(0, SUN_CLASSES, 200).tolist()
    splits = {"train": (labels[:800], 800), "validation": (labels[800:], 200), "test": (test_labels, 200)}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    datasets.DatasetDict({
        name: datasets.Dataset.from_dict({"image": _images(n, rng), "label": y}, features=features)
        for name, (y, n) in splits.items()
    }).save_to_disk(str(root / "data" / "vtab" / "sun397"))
    r = resolve("pretrain", None, TINY_MODEL, inputs=False)
    torch.manual_seed(0)
    save_weights(root / "random.safetensors", zoo.build_model(r.model, 0).state_dict(),
                       {"model": zoo.model_spec(r.model, 0)})
    return root, np.bincount(labels, minlength=SUN_CLASSES)


def test_every_shot_count_is_scored_and_marked(sun_like, tmp_path, capsys):
    root, counts = sun_like
    r = resolve("eval-fewshot", None, TINY_MODEL + [
        f"init.checkpoint={root / 'random.safetensors'}", "fewshot.tasks=vtab/sun397",
        "fewshot.shots=1,5,10,25", "fewshot.seeds=2", f"fewshot.data_root={root / 'data'}",
        "data.num_workers=0", "data.eval_batch_size=500"], complete=complete)
    rows = eval_fewshot(r, tmp_path)["runs"]
    assert sorted({(row["shots"], row["seed"]) for row in rows}) == [
        (k, s) for k in (1, 5, 10, 25) for s in (0, 1)]
    payload = json.loads((tmp_path / "results.json").read_text())
    out = capsys.readouterr().out
    for k in (1, 5, 10, 25):
        want = {"classes": SUN_CLASSES, "short_classes": int((counts < k).sum()),
                "empty_classes": int((counts == 0).sum()), "examples": int(np.minimum(counts, k).sum())}
        assert want["empty_classes"] == SUN_EMPTY and want["short_classes"] >= SUN_EMPTY
        for row in (row for row in payload["runs"] if row["shots"] == k):
            assert {f: row[f] for f in want} == want
        summary = next(s for s in payload["summary"] if s["shots"] == k)
        assert {f: summary[f] for f in want} == want
        which = ("had no train example" if k == 1 else f"had fewer than {k} train examples (32 had none)")
        assert (f"* vtab/sun397 {k}-shot: {want['short_classes']} of 397 classes {which}: {want['examples']} "
                f"examples, not {k * 397}") in out
    assert out.count("* vtab/sun397") == 4
    table_row = next(line for line in out.splitlines() if "vtab/sun397" in line and "±" in line)
    assert table_row.count("*") == 4, table_row  # every cell marked


def test_the_training_evaluator_logs_the_shortfall():
    r = resolve("pretrain", None, TINY_MODEL + [
        "fewshot.tasks=synthetic", "fewshot.shots=5,50", "fewshot.seeds=1", "data.synthetic.num_classes=4",
        "data.synthetic.train_size=100", "data.synthetic.test_size=40", "data.synthetic.img_size=32",
        "data.num_workers=0", "schedule.steps=2", "schedule.warmup_steps=1",
        "run.precision=fp32"],  # evaluators take a resolved precision (stages resolve auto; here we do)
        complete=complete, inputs=False)  # evaluators only: no run needs a length or a batch
    torch.manual_seed(0)
    metrics = dict(FewshotEvaluator(r, CPU).run(zoo.build_model(r.model, 4)))
    labels = np.asarray(FewshotEvaluator(r, CPU).splits["synthetic"][0]["label"])
    counts = np.bincount(labels, minlength=4)
    assert counts.min() >= 5 and counts.max() < 50  # 5 shots is full, 50 is short everywhere
    assert set(metrics) == {"fewshot/synthetic/5shot", "fewshot/synthetic/50shot",
                            "fewshot/synthetic/50shot/short_classes", "fewshot/synthetic/50shot/examples"}
    assert metrics["fewshot/synthetic/50shot/short_classes"] == 4
    assert metrics["fewshot/synthetic/50shot/examples"] == len(labels)
