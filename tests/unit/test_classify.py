"""`vit evaluate`'s arithmetic against cases worked by hand: top-k, the confusion matrix and
per-class accuracy, ImageNet ReaL (empty and multi-label rows, matched by file name or by row
order), the checks on a real.json, and the confusion figure's row shares."""

import json

import numpy as np
import pytest

from vitcli.errors import DataError
from vitcli.evaluators import classify
from vitcli.figures.confusion import confusion_figure, row_normalised

# 5 rows, 4 classes; predictions best first
TOP = np.array([[2, 0, 1], [1, 3, 0], [0, 2, 3], [3, 1, 2], [2, 1, 0]])
LABELS = np.array([2, 3, 3, 0, 1])


def test_top_k_by_hand():
    # row 0: 2 first (top-1 right); row 1: 3 second; row 2: 3 third; row 3: 0 nowhere; row 4: 1
    # second
    assert classify.top_k_correct(TOP, LABELS, 1).tolist() == [True, False, False, False, False]
    assert classify.top_k_correct(TOP, LABELS, 2).tolist() == [True, True, False, False, True]
    assert classify.top_k_correct(TOP, LABELS, 3).tolist() == [True, True, True, False, True]


def test_confusion_matrix_and_per_class_accuracy_by_hand():
    predicted = TOP[:, 0]  # 2, 1, 0, 3, 2
    confusion = classify.confusion_matrix(LABELS, predicted, 5)
    expected = np.zeros((5, 5), int)
    for true, guess in [(2, 2), (3, 1), (3, 0), (0, 3), (1, 2)]:
        expected[true, guess] += 1
    assert confusion.tolist() == expected.tolist()
    # class 2 is right once of once, classes 0, 1, 3 never; class 4 has no rows at all
    assert classify.per_class_accuracy(confusion) == [0.0, 0.0, 1.0, 0.0, None]


# ReaL for 5 validation images: image 2 has no valid label (left out), image 3 two valid ones
REAL = [[2], [], [3, 0], [1], [1, 2]]


def test_real_accuracy_by_hand_with_empty_and_multi_label_rows():
    entries = np.arange(5)
    # top-1: image 1 (2 in [2]) right; 2 left out; 3 (0 in [3, 0]) right; 4 (3 not in [1]) wrong;
    # 5 (2 in [1, 2]) right -> 3 of 4
    assert classify.real_top_k(TOP, entries, REAL, 1) == (3, 4)
    # top-2: image 4 has 1 second -> 4 of 4
    assert classify.real_top_k(TOP, entries, REAL, 2) == (4, 4)


def test_real_rows_matched_by_file_name_in_any_order():
    names = ["/v/b/ILSVRC2012_val_00000004.JPEG", "/v/a/ILSVRC2012_val_00000001.JPEG",
             "ILSVRC2012_val_00000003.png"]
    entries, how = classify.real_entries(names, 3, 5, "real.json")
    assert how == "file name" and entries.tolist() == [3, 0, 2]
    # rows 0..2 with TOP[:3]: [1] vs 2 wrong, [2] vs 1 wrong, [3, 0] vs 0 right
    assert classify.real_top_k(TOP[:3], entries, REAL, 1) == (1, 3)


def test_real_rows_matched_by_order_when_the_split_has_no_file_names():
    for names in (None, [None] * 5, ["a.png", "b.png", "c.png", "d.png", "e.png"]):
        entries, how = classify.real_entries(names, 5, 5, "real.json")
        assert how == "row order" and entries.tolist() == list(range(5))


@pytest.mark.parametrize("names, rows, message", [
    (None, 1000, "has 5 entries, but the split has 1000 rows and no ILSVRC2012_val_* file names"),
    (["ILSVRC2012_val_00000009.JPEG"], 1, "has 5 entries, but the split holds ILSVRC2012_val_00000009"),
    (["ILSVRC2012_val_00000001.JPEG", "x.png"], 2, "1 of the split's 2 files are ILSVRC2012_val_* but x.png"),
])
def test_real_rows_that_cannot_be_matched_are_one_clear_error(names, rows, message):
    with pytest.raises(DataError, match=message.replace("*", r"\*")):
        classify.real_entries(names, rows, 5, "real.json")


@pytest.mark.parametrize("content, message", [
    ("not json", "not a JSON file"),
    ('{"a": 1}', "expected a JSON list of label lists"),
    ("[]", "expected a JSON list of label lists"),
    ("[[1], 2]", "entry 1 is 2, not a list of class indices"),
    ("[[1], [true]]", "entry 1 is \\[True\\], not a list of class indices"),
    ("[[1], [0.5]]", "entry 1 is \\[0.5\\], not a list"),
    ("[[1], [4]]", "entry 1 has class 4, but the model has 4 classes"),
])
def test_a_real_file_of_the_wrong_shape_is_one_line(tmp_path, content, message):
    path = tmp_path / "real.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        classify.read_real_labels(path, 4)


def test_a_real_file_is_read_as_written(tmp_path):
    path = tmp_path / "real.json"
    path.write_text(json.dumps(REAL))
    assert classify.read_real_labels(path, 4) == REAL
    with pytest.raises(DataError, match="file not found"):
        classify.read_real_labels(tmp_path / "missing.json", 4)


def test_confusion_rows_are_shares_of_the_true_class():
    confusion = np.array([[3, 1, 0], [0, 0, 0], [2, 2, 4]])
    shares = row_normalised(confusion)
    assert np.allclose(shares, [[0.75, 0.25, 0], [0, 0, 0], [0.25, 0.25, 0.5]], atol=1e-12)
    fig = confusion_figure(confusion, ["a", "b", "c"], "t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert sorted(t.get_text() for t in ax.texts) == ["1", "2", "2", "3", "4"]  # non-zero counts only
