"""`vit evaluate` on ImageNet's robustness sets and `--suite`, `--real`, and ImageNet class names in
`vit predict`: a tiny 1000-class timm checkpoint on generated 32 px image folders laid out as
ImageNet-R, V2 and val. Every number is compared with a plain timm forward over the same files
(numpy arg-max over the set's classes, labels from the folder names), ReaL with timm's real.json
read here as plain JSON."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import timm.data
import torch
from PIL import Image
from safetensors.torch import save_file

from helpers import run_vit, tiny_vit
from vitcli.runtime.run_files import EVALUATE_FILE

INFO = Path(timm.data.__file__).parent / "_info"
SYNSETS = (INFO / "imagenet_synsets.txt").read_text().split()
R_CLASSES = [int(i) for i in (INFO / "imagenet_r_indices.txt").read_text().split()]
with open(INFO / "imagenet_synset_to_lemma.txt") as f:
    LEMMA = dict(csv.reader(f, delimiter="\t"))
RUN = ["model.num_heads=2", "run.precision=fp32", "run.device=cpu", "data.num_workers=0"]
PIXELS = np.random.default_rng(0)  # one stream for the module's generated images


def checkpoint(path: Path, bias: dict[int, float], num_classes: int = 1000) -> torch.nn.Module:
    """A tiny timm ViT saved as a timm safetensors file (no class names stored), its head's bias
    raised for the classes `bias` names."""
    model = tiny_vit(num_classes=num_classes)
    with torch.no_grad():
        for c, b in bias.items():
            model.head.bias[c] += b
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model


def image_folder(root: Path, counts: dict[str, int], name=lambda folder, j: f"{j}.png") -> None:
    """root/<folder>/<file> with counts[folder] random 32 px PNGs (PNG: the pixels read back
    exactly)."""
    for folder, n in counts.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        for j in range(n):
            pixels = PIXELS.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / folder / name(folder, j))


def logits_of(model, root: Path) -> tuple[np.ndarray, list[Path]]:
    """(logits (N, 1000) of a plain forward over every image under root, the files): at 32 px the
    eval transform (resize to 32 / crop_pct 1.0, centre crop 32) leaves the pixels as they are."""
    files = sorted(root.rglob("*.png"))
    x = torch.stack([torch.from_numpy(np.array(Image.open(f))).permute(2, 0, 1) for f in files])
    with torch.no_grad():
        return model(x.float() / 127.5 - 1).numpy(), files


def top_k_accuracy(logits: np.ndarray, classes: np.ndarray, labels: np.ndarray, k: int) -> float:
    """Share of rows whose label is among the k best of `classes` (the set's columns) by logit."""
    cut = logits[:, classes]
    best = classes[np.argsort(-cut, axis=1, kind="stable")[:, :k]]
    return float((best == labels[:, None]).any(axis=1).mean())


def evaluate(monkeypatch, capsys, ckpt, workdir, *args):
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ckpt, "--workdir", workdir, *args,
                             *RUN)
    assert code == 0, err
    return json.loads((workdir / EVALUATE_FILE).read_text()), out


def test_an_r_folder_is_scored_over_rs_200_classes(tmp_path, monkeypatch, capsys):
    """Four of R's synset folders; the head's arg-max over all 1000 is class 0 (tench, not in R),
    over R's 200 one of the four folders' classes: top-1/-5 and the loss are the numpy ones over R's
    classes."""
    folders = {SYNSETS[c]: 3 for c in R_CLASSES[2:6]}
    image_folder(tmp_path / "imagenet-r", folders)
    model = checkpoint(tmp_path / "c.safetensors", {0: 50, **{c: 6 for c in R_CLASSES[2:6]}})
    logits, files = logits_of(model, tmp_path / "imagenet-r")
    labels = np.array([SYNSETS.index(f.parent.name) for f in files])
    r = np.array(R_CLASSES)
    assert (logits.argmax(1) == 0).all() and (r[logits[:, r].argmax(1)] != 0).all()  # masking matters
    results, out = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev", "--data",
                            tmp_path / "imagenet-r", "--split", "train", "--imagenet-set", "imagenet-r")
    assert results["imagenet_set"] == "imagenet-r" and results["imagenet_set/classes"] == 200
    assert results["imagenet_set/labels_by"] == "synset folder names"
    assert results["top1"] == pytest.approx(top_k_accuracy(logits, r, labels, 1), abs=1e-12)
    assert results["top5"] == pytest.approx(top_k_accuracy(logits, r, labels, 5), abs=1e-12)
    assert 0 < results["top1"] < 1
    cut = torch.from_numpy(logits[:, r])
    target = torch.from_numpy(np.searchsorted(r, labels))
    assert results["loss"] == pytest.approx(torch.nn.functional.cross_entropy(cut, target).item(), abs=1e-5)
    assert "scored as ImageNet-R over its 200 classes" in " ".join(out.split())
    named = {row["class"]: row["name"] for row in results["per_class"] if row["images"]}
    assert named == {c: LEMMA[SYNSETS[c]] for c in R_CLASSES[2:6]}
    assert [row["class"] for row in results["per_class"]] == sorted(R_CLASSES)  # R's classes, not all 1000
    assert results["class_names_from"] == "timm imagenet-1k lemmas"
    # the same folder without --imagenet-set: four synset folders are any ImageNet folder, all 1000
    # classes
    results, _ = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev_all", "--data",
                          tmp_path / "imagenet-r", "--split", "train")
    assert results["imagenet_set"] == "imagenet" and results["imagenet_set/classes"] == 1000
    assert results["top1"] == 0 and results["top5"] == pytest.approx(
        top_k_accuracy(logits, np.arange(1000), labels, 5), abs=1e-12)


def test_an_r_folder_with_tta_and_calibration_is_scored_over_its_200_classes(tmp_path, monkeypatch, capsys):
    """--tta flip on an R folder: the views' softmax is over R's 200 classes, as the plain one's
    (evaluate's views and the set's mask come from two features: this is where they meet); nll is
    the cut loss."""
    folders = {SYNSETS[c]: 3 for c in R_CLASSES[2:6]}
    image_folder(tmp_path / "imagenet-r", folders)
    model = checkpoint(tmp_path / "c.safetensors", {0: 50, **{c: 6 for c in R_CLASSES[2:6]}})
    logits, files = logits_of(model, tmp_path / "imagenet-r")
    x = torch.stack([torch.from_numpy(np.array(Image.open(f))).permute(2, 0, 1) for f in files])
    with torch.no_grad():
        flipped = model(x.flip(-1).float() / 127.5 - 1).numpy()
    labels = np.array([SYNSETS.index(f.parent.name) for f in files])
    r = np.array(R_CLASSES)
    soft = lambda a: torch.from_numpy(a[:, r]).softmax(-1).numpy()
    averaged = (soft(logits) + soft(flipped)) / 2
    by_hand = float((r[averaged.argmax(1)] == labels).mean())
    results, _ = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev", "--data",
                          tmp_path / "imagenet-r", "--split", "train", "--imagenet-set", "imagenet-r",
                          "--tta", "flip")
    assert by_hand > 0 and (logits.argmax(1) == 0).all()  # unmasked, every view would say tench
    assert results["tta/top1"] == pytest.approx(by_hand, abs=1e-12) and results["tta/views"] == "flip"
    assert results["nll"] == pytest.approx(results["loss"], abs=1e-5)  # the cut logits' cross-entropy
    assert 0 <= results["ece"] <= 1


def test_v2_index_folders_are_classes_by_number(tmp_path, monkeypatch, capsys):
    """Folders 1, 2, 10 (an image folder numbers them 0, 2, 1: '10' sorts before '2'); the head
    prefers class 10, then 2: top-1 is the share of folder 10's images, as numpy counts it."""
    image_folder(tmp_path / "v2", {"1": 1, "2": 2, "10": 3})
    model = checkpoint(tmp_path / "c.safetensors", {10: 50, 2: 40, 1: 30})
    logits, files = logits_of(model, tmp_path / "v2")
    labels = np.array([int(f.parent.name) for f in files])
    results, _ = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev", "--data",
                          tmp_path / "v2", "--split", "train")  # detected from its folder names
    assert results["imagenet_set/labels_by"] == "class-index folder names"
    expected = top_k_accuracy(logits, np.arange(1000), labels, 1)
    assert expected == 0.5 and results["top1"] == pytest.approx(expected, abs=1e-12)
    assert results["top5"] == 1.0
    by_place = {"1": 0, "10": 1, "2": 2}  # the alphabetical labels, read as classes: what must not happen
    wrong = top_k_accuracy(logits, np.arange(1000), np.array([by_place[f.parent.name] for f in files]), 1)
    assert wrong != results["top1"]


def real_by_hand(logits: np.ndarray, files: list[Path]) -> tuple[float, int]:
    """(ReaL top-1 over the files with a non-empty list in timm's real.json, images counted)."""
    real = json.loads((INFO / "imagenet_real_labels.json").read_text())
    pairs = [(int(f.name[15:23]), int(p)) for f, p in zip(files, logits.argmax(1))]
    counted = [(n, p) for n, p in pairs if real[n - 1]]
    return sum(p in real[n - 1] for n, p in counted) / len(counted), len(counted)


def suite_root(root: Path) -> None:
    """imagenet/val (validation files 1..8: ReaL's lists of 1 and 22 are empty), imagenet-r, a V2
    variant, and a folder the suite does not know."""
    number = iter(range(1, 9))
    image_folder(root / "imagenet" / "val", {SYNSETS[c]: 4 for c in (1, 2)},
                 name=lambda folder, j: f"ILSVRC2012_val_{next(number):08d}.png")
    image_folder(root / "imagenet-r", {SYNSETS[c]: 2 for c in R_CLASSES[:3]})
    image_folder(root / "imagenetv2-threshold0.7-format-val", {"1": 2, "2": 2})
    image_folder(root / "notes", {"x": 1})


def test_suite_scores_every_set_beside_the_clean_one(tmp_path, monkeypatch, capsys):
    suite_root(tmp_path / "root")
    model = checkpoint(tmp_path / "c.safetensors", {c: 5 for c in (1, 2, 4, 970, 795)})
    results, out = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev", "--suite",
                            tmp_path / "root")
    sets = results["sets"]
    assert list(sets) == ["imagenet", "imagenetv2-threshold0.7-format-val", "imagenet-r"]
    assert [sets[k]["set"] for k in sets] == ["imagenet", "imagenet-v2", "imagenet-r"]
    assert sets["imagenet"]["split"] == "validation" and sets["imagenet-r"]["imagenet_set/classes"] == 200
    for folder, classes, label in [
            ("imagenet/val", np.arange(1000), lambda f: SYNSETS.index(f.parent.name)),
            ("imagenetv2-threshold0.7-format-val", np.arange(1000), lambda f: int(f.parent.name)),
            ("imagenet-r", np.array(R_CLASSES), lambda f: SYNSETS.index(f.parent.name))]:
        logits, files = logits_of(model, tmp_path / "root" / folder)
        row = sets[folder.split("/")[0]]
        labels = np.array([label(f) for f in files])
        assert row["top1"] == pytest.approx(top_k_accuracy(logits, classes, labels, 1), abs=1e-12), folder
        assert row["images"] == len(files)
    logits, files = logits_of(model, tmp_path / "root" / "imagenet" / "val")
    top1, counted = real_by_hand(logits, files)
    assert (sets["imagenet"]["real/top1"], sets["imagenet"]["real/images"]) == (pytest.approx(top1), counted)
    assert json.loads((tmp_path / "ev" / "imagenet-r" / EVALUATE_FILE).read_text())["imagenet_set"] == (
        "imagenet-r")
    assert "ImageNet-V2" in out and "top1 - clean" in out
    # --real (timm's copy) on the val folder alone gives the same ReaL numbers
    single, _ = evaluate(monkeypatch, capsys, tmp_path / "c.safetensors", tmp_path / "ev_real", "--data",
                         tmp_path / "root" / "imagenet", "--split", "validation", "--real")
    assert (single["real/top1"], single["real/images"], single["real/matched_by"]) == (
        pytest.approx(top1), counted, "file name")


def test_suite_and_set_refusals_are_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    # two folders: an image folder of one class folder has no label column
    image_folder(tmp_path / "root" / "imagenet-r", {SYNSETS[c]: 1 for c in R_CLASSES[:2]})
    image_folder(tmp_path / "tench", {SYNSETS[0]: 1, SYNSETS[1]: 1})
    checkpoint(tmp_path / "c.safetensors", {})
    checkpoint(tmp_path / "five.safetensors", {}, num_classes=5)
    c, five = tmp_path / "c.safetensors", tmp_path / "five.safetensors"
    cases = [
        (["--ckpt", c, "--suite", tmp_path / "empty"], "none of the folders imagenet, imagenet-val, val"),
        (["--ckpt", c, "--suite", tmp_path / "empty", "--dry-run"], "none of the folders imagenet"),
        (["--ckpt", c, "--suite", tmp_path / "nope"], "not a directory"),
        (["--ckpt", five, "--suite", tmp_path / "root"], "has 5 classes: evaluate a 1000-class checkpoint"),
        (["--ckpt", c, "--suite", tmp_path / "root", "--data", tmp_path], "drop --data"),
        (["--ckpt", c, "--real", "--real-labels", tmp_path / "x.json"], "pass one"),
        (["--ckpt", five, "--real", "--dry-run"], "--real scores an ImageNet-1k head (1000 classes), but"),
        (["--ckpt", five, "--data", tmp_path / "root" / "imagenet-r", "--split", "train", "--imagenet-set",
          "imagenet-r"], "has 5 classes: evaluate a 1000-class checkpoint"),
        (["--ckpt", c, "--data", tmp_path / "tench", "--split", "train", "--imagenet-set", "imagenet-a"],
         "class folder 'n01440764' is not one of ImageNet-A's 200 classes"),
        (["--ckpt", c, "--imagenet-set", "imagenet-q"], "Invalid value for '--imagenet-set'"),
    ]
    for args, message in cases:
        code, _, err = run_vit(monkeypatch, capsys, "evaluate", *args, "--workdir", tmp_path / "w", *RUN)
        lines = [line for line in err.splitlines() if line.startswith("error:") or "Invalid value" in line]
        assert code == 2 and len(lines) == 1 and message in lines[0], (args, err)
        assert not (tmp_path / "w" / EVALUATE_FILE).exists() and "Traceback" not in err


def test_predict_names_an_imagenet_head_by_timms_lemmas(tmp_path, monkeypatch, capsys, logged):
    """A 1000-class timm file stores no names: predict prints timm's lemma for class 281 and says
    so; a 5-class file keeps printing indices."""
    image_folder(tmp_path / "imgs", {"a": 2})
    checkpoint(tmp_path / "c.safetensors", {281: 50})
    code, out, err = run_vit(monkeypatch, capsys, "predict", tmp_path / "imgs", "--ckpt",
                             tmp_path / "c.safetensors", "--json", *[f"--set={o}" for o in RUN])
    assert code == 0, err
    for record in json.loads(out):
        assert record["top"][0]["class_index"] == 281
        assert record["top"][0]["class_name"] == LEMMA[SYNSETS[281]] == "tabby, tabby cat"
    assert any("class names: timm imagenet-1k lemmas" in m for m in logged)
    checkpoint(tmp_path / "five.safetensors", {}, num_classes=5)
    code, out, err = run_vit(monkeypatch, capsys, "predict", tmp_path / "imgs", "--ckpt",
                             tmp_path / "five.safetensors", "--json", *[f"--set={o}" for o in RUN])
    assert code == 0, err
    assert all(g["class_name"] == str(g["class_index"]) for r in json.loads(out) for g in r["top"])
