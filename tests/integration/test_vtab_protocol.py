"""VTAB-1k as task_adaptation defines it, on local copies: dSprites' 0/1 pixels reach the model as
0/255, the lr sweep retrains its choice on train800val200 and tests only that model, a short local
split is an error, and --data-root finds DIR/<task> (or says every path it tried)."""

import io
import json

import datasets
import numpy as np
import torch
import yaml
from PIL import Image

from helpers import run_vit
from vitcli.data.batching import batches
from vitcli.data.decoding import decode
from vitcli.data.rows import sources, tasks
from vitcli.fewshot.evaluate import data_cfg
from vitcli.recipe.grid import point_name
from vitcli.recipe.resolve import resolve
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.vtab import task_recipe

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.batch_size=16", "data.num_workers=0", "data.eval_batch_size=100",
        "schedule.steps=2", "schedule.warmup_steps=1"]


def save(path, sizes: dict[str, int], num_classes: int = 6, size: int = 8, **columns) -> str:
    """A save_to_disk DatasetDict of random RGB images, labels cycling through the classes."""
    rng = np.random.default_rng(len(sizes))
    feats = {"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=num_classes)}
    splits = {}
    for name, n in sizes.items():
        pixels = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        rows = {"image": [Image.fromarray(p) for p in pixels], "label": [i % num_classes for i in range(n)]}
        splits[name] = datasets.Dataset.from_dict({**rows, **columns}, features=datasets.Features(feats))
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return str(path)


# ---------------------------------------------------------------- dSprites' 0/1 pixels


def dsprites_like(values: np.ndarray) -> datasets.Dataset:
    """dSprites as stored: grayscale 'L' images with the task's raw x-position column."""
    feats = datasets.Features({"image": datasets.Image(), "label_x_position": datasets.Value("int64")})
    rows = {"image": [Image.fromarray(v) for v in values], "label_x_position": list(range(len(values)))}
    ds = datasets.Dataset.from_dict(rows, feats)  # (H, W) uint8 arrays: mode "L"
    return tasks.apply_label_rule(tasks.REGISTRY["vtab/dsprites_loc"], ds)


def first_batch(ds, cfg) -> torch.Tensor:
    return next(iter(batches.eval_batches(ds, cfg, 32, 8, resize=32)))[0]  # the few-shot preprocessing


def test_zero_one_images_reach_the_model_in_full_range_for_fewshot_and_finetuning():
    task = tasks.REGISTRY["vtab/dsprites_loc"]
    assert task.binary_pixels and tasks.REGISTRY["vtab/dsprites_ori"].binary_pixels
    assert not any(t.binary_pixels for t in tasks.REGISTRY.values() if "dsprites" not in t.name)
    recipe = resolve("finetune", None, TINY, vtab=True)
    fewshot_cfg, finetune_cfg = data_cfg(task, recipe), task_recipe(recipe, task, False).data
    assert fewshot_cfg.binary_pixels and finetune_cfg.binary_pixels
    masks = np.random.default_rng(0).integers(0, 2, (4, 32, 32), dtype=np.uint8)  # 0/1, as dSprites stores
    ds = dsprites_like(masks)
    # (4, 3, H, W)
    expected = torch.from_numpy(masks * 255 / 127.5 - 1).float()[:, None].expand(-1, 3, -1, -1)
    for cfg in (fewshot_cfg, finetune_cfg):
        x = first_batch(ds, cfg)
        torch.testing.assert_close(x, expected, atol=1e-6, rtol=0)  # every pixel -1 or 1
        assert x.min() == -1 and x.max() == 1
    x = next(batches.train_batches(ds, finetune_cfg, 32, 4, seed=0))[0]  # inception crop, bilinear
    assert x.min() >= -1 and x.max() > 0.5, "training sees the full contrast too"
    unscaled = first_batch(ds, data_cfg(tasks.REGISTRY["vtab/dmlab"], recipe))
    assert unscaled.max() <= -1 + 1 / 127.5 + 1e-6, "without the flag 0/1 pixels stay at 1/255 contrast"


def test_fewshot_and_finetuning_read_a_task_with_the_same_data_settings():
    recipe = resolve("finetune", None, TINY, vtab=True)
    for task in tasks.VTAB:  # VTAB tasks fine-tune (task_recipe); every task reads through task_data
        fewshot_cfg, finetune_cfg = data_cfg(task, recipe), task_recipe(recipe, task, False).data
        for key, value in sources.task_data(task).items():
            assert getattr(fewshot_cfg, key) == getattr(finetune_cfg, key) == value, (task.name, key)
    rule = tasks.REGISTRY["vtab/clevr_count"]
    assert sources.task_data(rule)["label_column"] == "label" and sources.task_data(rule)["label_rule"]


def test_a_copy_already_stored_0_to_255_passes_unchanged():
    task = tasks.REGISTRY["vtab/dsprites_ori"]
    recipe = resolve("finetune", None, TINY, vtab=True)
    values = np.random.default_rng(1).integers(0, 2, (4, 32, 32), dtype=np.uint8) * 255
    ds = dsprites_like(values)
    plain = data_cfg(tasks.REGISTRY["vtab/dmlab"], recipe)
    assert torch.equal(first_batch(ds, data_cfg(task, recipe)), first_batch(ds, plain))
    torch.testing.assert_close(first_batch(ds, plain)[:, 0], torch.from_numpy(values / 127.5 - 1).float(),
                               atol=1e-6, rtol=0)


def _decoded(img: Image.Image, fmt: str = "PNG") -> np.ndarray:
    """The image as the batch streams decode it with data.binary_pixels: (H, W, 3) uint8."""
    buf = io.BytesIO()
    img.save(buf, fmt)
    return decode.Encoded(buf.getvalue(), binary=True).full().numpy().transpose(1, 2, 0)


def test_stretch_binary_decides_on_the_pixel_range():
    ones = np.eye(4, dtype=np.uint8)
    rgb = np.stack([ones] * 3, -1)
    assert np.array_equal(_decoded(Image.fromarray(ones)), rgb * 255)  # grey: read as RGB, then stretched
    assert np.array_equal(_decoded(Image.fromarray(rgb)), rgb * 255)
    bits = Image.fromarray(ones.astype(bool))  # mode "1": already read as 0/255
    assert np.array_equal(_decoded(bits), rgb * 255)
    palette = Image.fromarray(ones).convert("P")  # its indices are not intensities: its colours decide
    assert np.array_equal(_decoded(palette), rgb * 255)
    floats = np.array([[0.0, 0.25], [0.5, 1.0]], dtype=np.float32)
    assert np.array_equal(_decoded(Image.fromarray(floats), "TIFF")[..., 0], np.rint(floats * 255))
    assert np.array_equal(decode.stretch_binary(floats), np.rint(floats * 255))
    dark = np.stack([ones * 3] * 3, -1)  # max 3 > 1: a dark 0..255 image, never brightened
    assert np.array_equal(_decoded(Image.fromarray(dark)), dark)


# ---------------------------------------------------------------- lr sweep, then retrain on
# train800val200


def test_lr_sweep_retrains_the_chosen_lr_on_1000_images_and_tests_only_that(tmp_path, monkeypatch, capsys):
    save(tmp_path / "root" / "dmlab", {"train": 800, "validation": 200, "test": 40})
    work, lrs = tmp_path / "w", [0.001, 0.3]
    args = ["finetune", "--task", "vtab/dmlab", "--data-root", tmp_path / "root", "--workdir", work,
            "--lr-sweep", ",".join(map(str, lrs)), *TINY]
    code, out, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    result = json.loads((work / "vtab.json").read_text())["vtab/dmlab"]
    task_dir = work / "dmlab"
    runs = {lr: task_dir / point_name({"optim.lr": lr}) for lr in lrs}  # optim.lr=0.001
    vals = {lr: json.loads((runs[lr] / "summary.json").read_text())["val/top1"] for lr in lrs}
    chosen = max(lrs, key=lambda lr: vals[lr])
    final = yaml.safe_load((task_dir / "final" / "recipe.yaml").read_text())
    final_summary = json.loads((task_dir / "final" / "summary.json").read_text())
    assert result["lr"] == chosen and result["val/top1"] == vals[chosen]
    assert result["test/top1"] == final_summary["test/top1"]
    assert final["optim"]["lr"] == chosen and final["data"]["val_split"] == ""
    assert final["data"]["train_split"] == "train[:800]+validation[:200]"
    assert len(sources.load_source(final["data"]["source"], final["data"]["train_split"])) == 1000
    for lr in lrs:  # the sweep's runs train on train800 and are never tested
        swept = yaml.safe_load((runs[lr] / "recipe.yaml").read_text())["data"]
        splits = (swept["train_split"], swept["val_split"], swept["test_split"])
        assert splits == ("train[:800]", "validation[:200]", ""), lr
        assert "test/top1" not in json.loads((runs[lr] / "summary.json").read_text())
    assert "val200" in out and f"{100 * result['test/top1']:.1f}" in out

    def train_rows():
        logs = task_dir.rglob("metrics.jsonl")
        return {p.parent.name: sum("train/loss" in r for r in read_metrics(p)) for p in logs}

    before = train_rows()
    assert run_vit(monkeypatch, capsys, *args)[0] == 0
    assert train_rows() == before, "a rerun after completion trains nothing again"
    assert json.loads((work / "vtab.json").read_text())["vtab/dmlab"] == result


# ---------------------------------------------------------------- short local splits, missing tasks


def test_a_short_local_split_is_one_line_naming_task_slice_and_rows(tmp_path, monkeypatch, capsys):
    save(tmp_path / "root" / "svhn", {"train": 4000, "test": 40}, num_classes=10, size=4)
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--task", "vtab/svhn", "--data-root",
                           tmp_path / "root", "--workdir", tmp_path / "w", *TINY)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error:"), err  # a warning may precede it
    for needle in ("vtab/svhn", "train[65931:66131]", "4000 rows"):
        assert needle in err.strip().splitlines()[-1], err
    assert not (tmp_path / "w").exists()


def test_a_missing_task_says_every_path_it_tried(tmp_path, monkeypatch, capsys):
    (tmp_path / "root").mkdir()
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--task", "vtab/svhn", "--data-root",
                           tmp_path / "root", "--workdir", tmp_path / "w", *TINY)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error:"), err  # a warning may precede it
    root = tmp_path / "root"
    tried = [root / "svhn", root / "svhn_cropped", root / "vtab" / "svhn"]
    assert "vtab/svhn" in err and all(str(p) in err for p in tried), err
