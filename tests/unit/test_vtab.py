"""VTAB-1k fine-tuning on local data: the protocol's splits, derived labels, and the summary
table."""

import json
import sys

import datasets
import numpy as np
from PIL import Image

from vitcli import cli
from vitcli.data.rows.sources import load_split
from vitcli.recipe.schema import DataConfig


def images(n, seed, size=32):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def test_label_rule_derives_labels_from_raw_columns(tmp_path):
    x_pos = list(range(32))  # dSprites: 32 x positions -> 16 location classes
    ds = datasets.Dataset.from_dict({"image": images(32, 0), "label_x_position": x_pos},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label_x_position": datasets.Value("int64")}))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "d"))
    cfg = DataConfig(source=str(tmp_path / "d"), label_rule="dsprites_location", num_classes=16)
    labels = load_split(cfg, "train[:32]")["label"]
    assert labels == [x // 2 for x in x_pos]


def test_finetune_task_runs_the_protocol_on_local_data(tmp_path, monkeypatch, capsys):
    feats = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=6)})
    splits = {name: datasets.Dataset.from_dict({"image": images(n, i, 8), "label": [j % 6 for j in range(n)]},
                                               features=feats)  # train800 and val200 need these sizes
              for i, (name, n) in enumerate([("train", 800), ("validation", 200), ("test", 24)])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "root" / "vtab" / "dmlab"))  # the older layout
    tiny = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
            "model.num_heads=2", "model.mlp_dim=64", "data.batch_size=16", "data.num_workers=0",
            "schedule.steps=3", "schedule.warmup_steps=1"]
    monkeypatch.setattr(sys, "argv", ["vit", "finetune", "--task", "vtab/dmlab", "--data-root",
                                      str(tmp_path / "root"), "--workdir", str(tmp_path / "w"), *tiny])
    try:
        cli.main()
    except SystemExit as e:
        assert e.code in (0, None), capsys.readouterr().err
    results = json.loads((tmp_path / "w" / "vtab.json").read_text())
    assert list(results) == ["vtab/dmlab"] and 0 <= results["vtab/dmlab"]["test/top1"] <= 1
    recipe = (tmp_path / "w" / "dmlab" / "recipe.yaml").read_text()
    assert "train_split: train[:800]+validation[:200]" in recipe and "test_split: test" in recipe
    assert "VTAB-1k" in capsys.readouterr().out
