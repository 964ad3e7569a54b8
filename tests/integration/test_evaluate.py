"""`vit evaluate` and `vit predict` on tiny runs: the numbers agree with what training reported,
ReaL accuracy with a hand count over the files' own predictions (matched by file name and by row
order), predict with evaluate row by row, class names travel in the checkpoint, and bad input is one
line, exit 2, with nothing written."""

import io
import json
import math

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from torchvision.transforms.v2 import functional as TF

from helpers import export_npz, run_vit, tiny_vit
from vitcli.checkpoints.complete import complete, trained_with
from vitcli.checkpoints.transfer import load_for_eval
from vitcli.checkpoints.weights import save_weights
from vitcli.data.decoding import bad_images
from vitcli.data.rows import sources
from vitcli.data.rows.synthetic import class_names, make_synthetic
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import to_dict
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig, Recipe, SyntheticConfig
from vitcli.runtime.dist import setup
from vitcli.runtime.run_files import CONFUSION_PLOT, EVALUATE_FILE, MODEL_FILE
from vitcli.stages.evaluate import predictions
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.num_workers=0", "data.batch_size=32", "data.val_split=",
        "schedule.warmup_steps=1", "run.log_every=5", "run.precision=fp32", "run.device=cpu"]
SYNTH = ["data.synthetic.num_classes=6", "data.synthetic.train_size=128", "data.synthetic.test_size=48"]
NAMES = ["cat", "dog", "eel"]
FP32 = ["run.precision=fp32", "run.device=cpu"]  # as the runs measured their test top-1


def three_class_images(n: int, seed: int) -> tuple[list, list[int]]:
    """n built-in images relabelled into 3 classes (shape index mod 3): a dataset of other names."""
    ds = make_synthetic(SyntheticConfig(num_classes=6, test_size=n, seed=seed), "test")
    return list(ds["image"]), [y % 3 for y in ds["label"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A pretraining on the built-in data (6 classes), and its fine-tune onto a saved 3-class
    dataset named cat/dog/eel; with their summaries."""
    root = tmp_path_factory.mktemp("evaluate")
    pre = one_run(resolve("pretrain", None, TINY + SYNTH + ["schedule.steps=20", "data.eval_batch_size=16"]),
                  root / "pre")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    splits = {}
    for split, (n, seed) in {"train": (64, 1), "test": (40, 2)}.items():
        images, labels = three_class_images(n, seed)
        splits[split] = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
    datasets.DatasetDict(splits).save_to_disk(str(root / "pets"))
    ft_recipe = resolve("finetune", None, TINY + [
        f"data.source={root / 'pets'}", "schedule.steps=8", "optim.lr=0.03", "data.eval_batch_size=16",
        f"init.checkpoint={root / 'pre'}"], complete=complete)
    ft = one_run(ft_recipe, root / "ft")
    return {"root": root, "pre": (root / "pre", pre), "ft": (root / "ft", ft)}


def meta_names(workdir):
    with safe_open(str(workdir / MODEL_FILE), framework="pt") as f:
        return json.loads(f.metadata()["model"])["class_names"]


def test_checkpoints_store_the_class_names_of_their_head(runs):
    assert meta_names(runs["pre"][0]) == class_names(6)
    assert meta_names(runs["ft"][0]) == NAMES  # the new dataset's, not the pretraining's


def test_class_names_of_a_stream_and_of_a_head_of_another_width():
    r = resolve("pretrain", None, [*TINY, *SYNTH, "data.streaming=true", "schedule.steps=2"])
    stream = sources.load_stream(r.data)
    assert isinstance(stream, datasets.IterableDataset)
    assert sources.class_names(r.data, stream, 6) == class_names(6)
    assert sources.class_names(r.data, stream, 7) is None  # data.num_classes wider than the names


@pytest.mark.parametrize("run", ["pre", "ft"])
def test_evaluate_equals_the_test_top1_training_reported(runs, run, tmp_path, monkeypatch, capsys):
    workdir, summary = runs[run]
    # no run.precision: the checkpoint's own (fp32), not auto's choice, which may be bf16 on this
    # CPU
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", workdir, "--workdir", tmp_path / "ev",
                             "--json", "run.device=cpu")
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "ev" / "recipe.yaml").read_text())["run"]["precision"] == "fp32"
    results = json.loads(out)
    assert results["top1"] == summary["test/top1"]
    assert results["loss"] == pytest.approx(summary["test/loss"], abs=1e-5)  # batches of another size
    assert json.loads((tmp_path / "ev" / EVALUATE_FILE).read_text()) == results
    names = NAMES if run == "ft" else class_names(6)
    assert [row["name"] for row in results["per_class"]] == names
    counts = sum(row["images"] for row in results["per_class"])
    right = sum(row["images"] * row["top1"] for row in results["per_class"])
    assert counts == results["images"] and right / counts == pytest.approx(results["top1"], abs=1e-12)
    assert ("top5" in results) == (len(names) >= 5)
    # figsize: max(4, 0.32 K + 2.5) inches high, 1.2 more wide for the colour bar, at 120 dpi
    side = max(4.0, 0.32 * len(names) + 2.5)
    assert Image.open(tmp_path / "ev" / CONFUSION_PLOT).size == (round((side + 1.2) * 120), round(side * 120))


def test_dry_run_prints_the_checkpoints_own_preprocessing(runs, monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", runs["ft"][0], "--dry-run")
    assert code == 0, err
    assert "stage: evaluate\n" in out and "  img_size: 32\n" in out and "  num_classes: 3\n" in out
    assert f"  source: {runs['root'] / 'pets'}\n" in out
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", runs["ft"][0], "--dry-run",
                             "model.img_size=64")  # a recipe key overrides what the checkpoint says
    assert code == 0 and "  img_size: 64\n" in out


def split_predictions(runs, split: str) -> tuple[np.ndarray, np.ndarray]:
    """evaluate's own per-row pass over a split of the fine-tune's data: (top classes (N, 3),
    probs)."""
    ckpt = str(runs["ft"][0])
    r = resolve("evaluate", None, [*FP32, f"data.test_split={split}"], {"init.checkpoint": ckpt},
                complete=complete, base=trained_with)
    model = load_for_eval(r, r.model.num_classes)
    ds = sources.load_split(r.data, split)
    _, top, probs, _, _ = predictions(model, ds, r, setup("cpu"), bad_images.Skipped(), 3)
    return top, probs


def test_predict_gives_evaluates_top1_row_by_row_with_class_names(runs, tmp_path, monkeypatch, capsys,
                                                                  logged):
    images, _ = three_class_images(40, 2)  # the fine-tune's test split
    folder = tmp_path / "imgs"
    (folder / "sub").mkdir(parents=True)
    for i, image in enumerate(images[:12]):
        image.save(folder / ("sub" if i % 2 else "") / f"{i:02d}.png")  # PNG: the same pixels
    (folder / "broken.png").write_bytes(b"not an image")
    code, out, err = run_vit(monkeypatch, capsys, "predict", folder, "--ckpt", runs["ft"][0], "--json",
                             "--top-k", "3", "--batch-size", "5", *[f"--set={o}" for o in FP32])
    assert code == 0, err
    assert [m for m in logged if "broken.png" in m] == [  # named once, by its path
        (f"[yellow]warning: {folder / 'broken.png'}: cannot decode (UnidentifiedImageError: cannot "
         "identify image file); skipped")]
    records = {r["path"]: r["top"] for r in json.loads(out)}
    top, probs = split_predictions(runs, "test[:12]")
    for i in range(12):
        guesses = records[str(folder / ("sub" if i % 2 else "") / f"{i:02d}.png")]
        assert [g["class_index"] for g in guesses] == top[i].tolist()
        assert [g["class_name"] for g in guesses] == [NAMES[c] for c in top[i]]
        assert [g["probability"] for g in guesses] == pytest.approx(probs[i].tolist(), abs=1e-6)
    code, out, err = run_vit(monkeypatch, capsys, "predict", folder / "00.png", "--ckpt", runs["ft"][0],
                             "--csv", "--top-k", "2", *[f"--set={o}" for o in FP32])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "path,rank,class_index,class_name,probability" and len(lines) == 3
    assert lines[1].startswith(f"{folder / '00.png'},1,{top[0][0]},{NAMES[top[0][0]]},")


# ReaL lists for the 8 validation images: image 2 has no valid label (left out), images 3 and 6 two
# each
REAL = [[0], [], [1, 2], [2], [0, 1], [2, 0], [1], [0]]


def real_by_hand(predicted: dict[int, int]) -> tuple[float, int]:
    """(ReaL top-1, images counted) from each file number's top-1 prediction."""
    counted = [n for n in predicted if REAL[n - 1]]
    return sum(predicted[n] in REAL[n - 1] for n in counted) / len(counted), len(counted)


def test_real_accuracy_matched_by_file_name_and_by_row_order(runs, tmp_path, monkeypatch, capsys):
    images, labels = three_class_images(8, 3)
    folder = tmp_path / "imagenet" / "val"
    order = [5, 2, 8, 1, 7, 3, 6, 4]  # file numbers shuffled over the class folders
    for i, n in enumerate(order):
        (folder / NAMES[labels[i]]).mkdir(parents=True, exist_ok=True)
        images[i].save(folder / NAMES[labels[i]] / f"ILSVRC2012_val_{n:08d}.JPEG")
    real = tmp_path / "real.json"
    real.write_text(json.dumps(REAL))
    code, out, err = run_vit(monkeypatch, capsys, "predict", folder, "--ckpt", runs["ft"][0], "--json",
                             *[f"--set={o}" for o in FP32])
    assert code == 0, err
    predicted = {int(r["path"][-13:-5]): r["top"][0]["class_index"] for r in json.loads(out)}
    top1, counted = real_by_hand(predicted)
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", runs["ft"][0], "--data",
                             tmp_path / "imagenet", "--split", "validation", "--real-labels", real,
                             "--workdir", tmp_path / "by_name", "--json", *FP32)
    assert code == 0, err
    results = json.loads(out)
    assert (results["real/top1"], results["real/images"], results["real/matched_by"]) == (
        pytest.approx(top1, abs=1e-12), counted, "file name")
    # the same images saved in file-number order, without their file names: matched by row order
    decoded = {n: Image.open(next(folder.glob(f"*/ILSVRC2012_val_{n:08d}.JPEG"))).convert("RGB")
               for n in range(1, 9)}
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    datasets.Dataset.from_dict({"image": [decoded[n] for n in range(1, 9)],
                                "label": [labels[order.index(n)] for n in range(1, 9)]},
                               features=features).save_to_disk(str(tmp_path / "ordered"))
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", runs["ft"][0], "--data",
                             tmp_path / "ordered", "--split", "train", "--real-labels", real, "--workdir",
                             tmp_path / "by_order", *FP32)
    assert code == 0, err
    results = json.loads((tmp_path / "by_order" / EVALUATE_FILE).read_text())
    assert results["real/matched_by"] == "row order"
    assert "ReaL labels matched by row order" in " ".join(out.split())  # as rich wraps it
    assert results["real/top1"] == pytest.approx(top1, abs=1e-12) and results["real/images"] == counted


def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, monkeypatch, capsys, logged):
    ft, pre = runs["ft"][0], runs["pre"][0]
    (tmp_path / "notjson.json").write_text("{")
    (tmp_path / "flat.json").write_text("[1, 2]")
    (tmp_path / "long.json").write_text(json.dumps([[0]] * 41))
    (tmp_path / "empty").mkdir()
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    headless = tmp_path / "headless.safetensors"  # as masked patch prediction exports its ViT
    save_weights(headless, build_model(cfg, 0).state_dict(), {"model": model_spec(cfg, 0)})
    work = tmp_path / "w"
    cases = [
        (["evaluate", "--workdir", work], "evaluate needs weights: pass --ckpt"),
        (["evaluate", "--ckpt", tmp_path / "nope", "--workdir", work], "checkpoint not found"),
        (["evaluate", "--ckpt", headless, "--workdir", work], "has no classification head"),
        (["predict", tmp_path / "empty", "--ckpt", headless], "has no classification head"),
        (["evaluate", "--ckpt", ft, "--split", "nope", "--workdir", work], "no split 'nope'"),
        (["evaluate", "--ckpt", ft, "--real-labels", tmp_path / "notjson.json", "--workdir", work],
         "not a JSON file"),
        (["evaluate", "--ckpt", ft, "--real-labels", tmp_path / "flat.json", "--dry-run"],
         "entry 0 is 1, not a list of class indices"),
        (["evaluate", "--ckpt", ft, "--real-labels", tmp_path / "long.json", "--workdir", work],
         "has 41 entries, but the split has 40 rows and no ILSVRC2012_val_* file names"),
        (["evaluate", "--ckpt", ft, "--workdir", pre], "pre holds a pretrain run; `vit evaluate` writes"),
        (["evaluate", "--ckpt", pre, "--data", runs["root"] / "pets", "--workdir", work],
         "has label 2, but the head of"),  # fine: 6 classes > 2; the inverse below
        (["evaluate", "--ckpt", ft, "--splt", "test"], "No such option: --splt"),
        (["evaluate", "--ckpt", ft, "data.splt=test"], "unknown recipe key 'data.splt'"),
        (["predict", tmp_path / "nothere.png", "--ckpt", ft], "nothere.png: no such file or directory"),
        (["predict", tmp_path / "empty", "--ckpt", ft], "no image files"),
        (["predict", tmp_path / "empty", "--ckpt", ft, "--json", "--csv"], "--json and --csv"),
        (["predict", tmp_path / "notjson.json", "--ckpt", ft],
         f"none of the 1 image file(s) decodes ({tmp_path / 'notjson.json'}: UnidentifiedImageError"),
    ]
    for args, message in cases:
        code, _, err = run_vit(monkeypatch, capsys, *args)
        if "has label 2" in message:  # the 6-class head reads the 3-class data: a run, not an error
            assert code == 0, err
            work.joinpath(EVALUATE_FILE).unlink()
            continue
        assert code == 2, (args, err)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0], (args, err)  # warnings may precede it
        assert not work.joinpath(EVALUATE_FILE).exists() and "Traceback" not in err
    code, _, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ft, "--data", "synthetic", "--workdir",
                           work)  # the built-in data has 10 classes; the head 3
    assert code == 2 and "has label 9, but the head of" in err and not work.joinpath(EVALUATE_FILE).exists()
    assert not [m for m in logged if "notjson.json" in m]  # predict named it in its error alone


def test_predict_names_each_file_that_does_not_decode_once(runs, tmp_path, monkeypatch, capsys, logged):
    """None of two files decodes: the error names the first by its path, a warning the other."""
    first, other = tmp_path / "a.png", tmp_path / "b.png"
    first.write_bytes(b"")
    other.write_bytes(b"not an image")
    code, _, err = run_vit(monkeypatch, capsys, "predict", tmp_path, "--ckpt", runs["ft"][0])
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(error) == 1, err
    assert f"none of the 2 image file(s) decodes ({first}: " in error[0] and str(other) not in error[0]
    warning = f"[yellow]warning: {other}: cannot decode (UnidentifiedImageError: cannot identify image file)"
    assert [m for m in logged if str(other) in m] == [f"{warning}; skipped"]
    assert not [m for m in logged if str(first) in m] and "1 other named above" in error[0]


def eval_pixels(img: Image.Image, size: int, crop_pct: float) -> torch.Tensor:
    """timm's eval preprocessing written out with torchvision: the shorter side to floor(size /
    crop_pct) (antialiased bilinear), centre crop `size`, x / 127.5 - 1 -> (3, size, size)."""
    x = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)  # (3, H, W) uint8
    x = TF.center_crop(TF.resize(x, [math.floor(size / crop_pct)], antialias=True), [size, size])
    return x.float() / 127.5 - 1


def test_foreign_checkpoints_evaluate_as_timm_computes_them(tmp_path, monkeypatch, capsys):
    """A timm safetensors file and the same network as a Google .npz: evaluate's top-1 and loss
    equal a plain timm forward over the split's images prepared by the eval transform, at the file's
    native 32 px."""
    model = tiny_vit(img_size=32, num_classes=5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "timm.safetensors"))
    export_npz(model, tmp_path / "vit.npz")
    # a timm file does not say its heads (the .npz kernels do): the recipe names them
    data = ["model.num_heads=2", "data.synthetic.num_classes=5", "data.synthetic.test_size=30",
            "data.num_workers=0", *FP32]
    ds = make_synthetic(SyntheticConfig(num_classes=5, test_size=30), "test")
    with torch.no_grad():
        logits = model(torch.stack([eval_pixels(img, 32, 1.0) for img in ds["image"]]))  # (30, 5)
    labels = torch.tensor(ds["label"])
    expected_top1 = (logits.argmax(-1) == labels).sum().item() / len(labels)
    expected_loss = torch.nn.functional.cross_entropy(logits, labels).item()
    for name in ("timm.safetensors", "vit.npz"):
        code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", tmp_path / name, "--workdir",
                                 tmp_path / name.split(".")[0], "--json", *data)
        assert code == 0, err
        results = json.loads(out)
        assert results["top1"] == pytest.approx(expected_top1, abs=1e-12), name
        assert results["loss"] == pytest.approx(expected_loss, abs=1e-5), name
        assert [row["name"] for row in results["per_class"]] == class_names(5)  # the split's ClassLabel


def test_an_image_that_does_not_decode_is_left_out_and_counted(runs, tmp_path, monkeypatch, capsys,
                                                                logged):
    """Row 3 of 10 is not an image: evaluate scores the other 9, counts it and names it once (by row
    and split; by its path in an image folder); the 9 score as they do in a split without it (top-1
    over the same rows)."""
    images, labels = three_class_images(10, 4)
    encoded = []
    for i, image in enumerate(images):
        if i == 3:
            encoded.append({"bytes": b"not an image", "path": None})
            continue
        out = io.BytesIO()
        image.save(out, "PNG")
        encoded.append({"bytes": out.getvalue(), "path": None})
        (tmp_path / "folder" / "train" / NAMES[labels[i]]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / "train" / NAMES[labels[i]] / f"{i}.png").write_bytes(encoded[-1]["bytes"])
    broken = tmp_path / "folder" / "train" / NAMES[labels[3]] / "3.png"
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_bytes(b"not an image")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    with_bad = datasets.Dataset.from_dict({"image": encoded, "label": labels}, features=features)
    with_bad.save_to_disk(str(tmp_path / "bad"))
    with_bad.select([i for i in range(10) if i != 3]).save_to_disk(str(tmp_path / "good"))
    got = {}
    for name in ("bad", "good", "folder"):
        code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", runs["ft"][0], "--data",
                                 tmp_path / name, "--split", "train", "--workdir", tmp_path / f"ev_{name}",
                                 "--json", *FP32)
        assert code == 0, err
        got[name] = json.loads(out)
    assert got["bad"]["skipped_images"] == got["folder"]["skipped_images"] == 1
    assert "skipped_images" not in got["good"]
    for name in (f"row 3 of {tmp_path / 'bad'} split 'train'", str(broken)):
        assert len([m for m in logged if name in m]) == 1, logged  # named once, not once per rank's tally
    assert got["bad"]["images"] == got["good"]["images"] == 9
    assert got["bad"]["top1"] == got["good"]["top1"] and got["bad"]["per_class"] == got["good"]["per_class"]


def test_predict_gives_sigmoid_probabilities_for_a_sigmoid_loss_model(tmp_path, monkeypatch, capsys):
    """A checkpoint trained with optim.loss=sigmoid: predict's probabilities are each class's
    sigmoid of the logits a plain forward gives (they need not sum to 1), its crop the stored
    data.eval_crop_pct."""
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64,
                      head_zero_init=False)
    torch.manual_seed(1)
    model = build_model(cfg, 4).eval()
    trained = Recipe(model=cfg)
    trained.optim.loss, trained.data.eval_crop_pct = "sigmoid", 0.875
    save_weights(tmp_path / "sig.safetensors", model.state_dict(),
                 {"recipe": to_dict(trained), "model": model_spec(cfg, 4)})
    images, _ = three_class_images(3, 5)
    for i, image in enumerate(images):
        image.resize((40, 40)).save(tmp_path / f"{i}.png")  # 40 px: the 0.875 crop changes the pixels
    code, out, err = run_vit(monkeypatch, capsys, "predict", tmp_path, "--ckpt", tmp_path / "sig.safetensors",
                             "--json", "--top-k", "4", *[f"--set={o}" for o in FP32])
    assert code == 0, err
    for i, record in enumerate(json.loads(out)):
        with torch.no_grad():
            x = eval_pixels(Image.open(tmp_path / f"{i}.png"), 32, 0.875)  # (3, 32, 32)
            probs = model(x[None]).sigmoid()[0]  # (4,)
        order = probs.argsort(descending=True).tolist()
        assert [g["class_index"] for g in record["top"]] == order
        assert [g["probability"] for g in record["top"]] == pytest.approx(probs[order].tolist(), abs=1e-6)
        assert [g["class_name"] for g in record["top"]] == [str(c) for c in order]  # no names stored
