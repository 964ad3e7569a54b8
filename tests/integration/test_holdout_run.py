"""data.holdout in a run: training reads the rows kept, `data.val_split=holdout` evaluates the
held-out ones; a recipe whose holdout keys do not fit together is refused by `--dry-run` and the
run alike, one line, exit 2, nothing written. The big_vision recipe, shrunk, runs with its own."""

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

from helpers import REPO, run_vit
from vitcli.checkpoints.complete import complete
from vitcli.data.rows import holdout, sources, tasks
from vitcli.evaluators import heldout
from vitcli.fewshot.evaluate import data_cfg
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import DataConfig
from vitcli.runtime.metrics import read_metrics
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.mlp_dim=64", "data.source=synthetic",
        "data.synthetic.num_classes=4", "data.synthetic.train_size=96",
        "data.synthetic.img_size=32", "data.batch_size=8", "data.num_workers=0",
        "schedule.epochs=1", "schedule.warmup_steps=1", "run.log_every=1", "run.eval_every=0",
        "run.precision=fp32", "run.compile=false", "fewshot.every=0"]
BIG_VISION = REPO / "recipes/bigvision/vit_s16_i1k.yaml"


def test_a_run_trains_on_the_rows_kept_and_validates_on_the_rows_held_out(tmp_path, monkeypatch):
    evaluated = {}
    init = heldout.SplitEvaluator.__init__

    def recording(self, prefix, ds, *args, **kwargs):
        evaluated[prefix] = ds
        init(self, prefix, ds, *args, **kwargs)

    monkeypatch.setattr(heldout.SplitEvaluator, "__init__", recording)
    r = resolve("pretrain", None, [*TINY, "data.holdout=0.25", "data.val_split=holdout",
                                   "data.test_split="], complete=complete)
    summary = one_run(r, tmp_path)
    whole = sources.load_split(dataclasses.replace(r.data, holdout=0.0), "train")
    kept, held = holdout.split_rows(np.array(whole["label"]), 0.25)
    assert (len(kept), len(held)) == (72, 24)
    assert summary["steps"] == len(kept) // 8  # one epoch of the kept rows, not of all 96
    val = evaluated["val"]
    assert val["label"] == [whole["label"][i] for i in held]
    assert all(np.array_equal(np.asarray(a), np.asarray(whole[int(i)]["image"]))
               for a, i in zip(val["image"], held))
    assert any("val/top1" in row for row in read_metrics(tmp_path / "metrics.jsonl"))


QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")
HELD = ["data.holdout=0.1", "data.val_split=holdout"]
REFUSED = {  # overrides -> the line's fragment
    "holdout nothing reads": (["data.holdout=0.01"], "out of training that nothing reads"),
    "holdout split without holdout": (["data.val_split=holdout"], "but data.holdout is 0"),
    "holdout of everything": (["data.holdout=1", "data.val_split=holdout"],
                              "data.holdout must be in [0, 1)"),
    "holdout mixed into a split": ([*HELD, "data.test_split=holdout+test"],
                                   "data.test_split='holdout+test'"),
    "holdout of a stream": ([*HELD, "data.streaming=true"], "set data.streaming=false"),
    "holdout without labels": ([*HELD, "data.label_column=", "objective=mae"], "needs labels"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_holdout_keys_that_do_not_fit_are_refused_by_the_dry_run_and_the_run(
        case, tmp_path, monkeypatch, capsys):
    overrides, fragment = REFUSED[case]
    monkeypatch.chdir(tmp_path)
    command = ["pretrain", "-r", QUICK]
    dry = run_vit(monkeypatch, capsys, *command, "--dry-run", *overrides)
    run = run_vit(monkeypatch, capsys, *command, "--workdir", tmp_path / "w", *overrides)
    assert dry[0] == run[0] == 2 and dry[2] == run[2], (dry, run)
    assert fragment in run[2] and len(run[2].strip().splitlines()) == 1, run[2]
    assert not any(tmp_path.iterdir()), "a refused run wrote a file"


@pytest.fixture(scope="module")
def big_vision_run(tmp_path_factory):
    """recipes/bigvision/vit_s16_i1k.yaml as shipped but for its size (a one-block network at 32 px,
    the built-in data, two steps): its RandAugment, mixup, pre-logits and big_vision's decay train,
    and its val split is the 1% of train it holds out (1 of 96 images), evaluated at the end."""
    workdir = tmp_path_factory.mktemp("bigvision")
    shrink = ["model.name=custom", "model.representation_size=32", "data.test_split=test",
              "data.synthetic.test_size=32", "schedule.epochs=0", "schedule.steps=2",
              "data.batch_size=16"]
    r = resolve("pretrain", BIG_VISION, [*TINY, *shrink], complete=complete)
    assert (r.data.holdout, r.data.val_split, r.data.randaugment) == (0.01, "holdout",
                                                                      "rand-m10-n2")
    return workdir, one_run(r, workdir)


def test_the_big_vision_recipe_runs_its_first_steps_validating_on_its_holdout(big_vision_run):
    workdir, summary = big_vision_run
    rows = read_metrics(workdir / "metrics.jsonl")
    assert summary["steps"] == 2 and [row["step"] for row in rows if "train/loss" in row] == [1, 2]
    assert any("val/top1" in row for row in rows) and (workdir / "model.safetensors").is_file()


def test_vit_evaluate_of_a_run_with_a_holdout_reads_its_test_split_and_its_holdout(
        big_vision_run, tmp_path, monkeypatch, capsys):
    """The run's recipe hands `vit evaluate` its splits and data.holdout (checkpoints.complete's
    TRAINED_DATA): its test split is evaluated as ever, and `--split holdout` is the run's own
    held-out rows, whether or not data.holdout is typed again."""
    ckpt = ["evaluate", "--ckpt", big_vision_run[0], "--json"]
    code, out, err = run_vit(monkeypatch, capsys, *ckpt, "-w", tmp_path / "test")
    assert code == 0 and json.loads(out)["images"] == 32, err
    code, out, err = run_vit(monkeypatch, capsys, *ckpt, "-w", tmp_path / "held", "--split", "holdout")
    assert code == 0 and json.loads(out)["images"] == 1, err
    code, out, err = run_vit(monkeypatch, capsys, *ckpt, "-w", tmp_path / "again",
                             "--split", "holdout", "data.holdout=0.01")
    assert code == 0 and json.loads(out)["images"] == 1, err


def test_a_class_sorted_image_folder_holds_out_every_class(tmp_path):
    """The case the key is for: a folder lists its images class by class, so a tail slice would be
    the last class; the holdout takes the same share of each."""
    for c in ("ant", "bee", "cat"):
        (tmp_path / "train" / c).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (8, 8), (i * 40, 0, 0)).save(tmp_path / "train" / c / f"{i}.png")
    cfg = DataConfig(source=str(tmp_path), holdout=0.25, val_split="holdout")
    held, kept = sources.load_split(cfg, "holdout"), sources.load_split(cfg, "train")
    assert sorted(held["label"]) == [0, 1, 2]
    assert sorted(kept["label"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert "held out by data.holdout" in sources.origin(held)
    plain = sources.load_split(DataConfig(source=str(tmp_path)), "train")
    assert len(plain) == 12 and "data.holdout" not in sources.origin(plain)


def test_a_few_shot_task_reads_its_whole_train_split_under_a_recipe_with_a_holdout():
    """data.holdout is the recipe's own data's: a few-shot (or VTAB) task read through the same
    data settings gets none of its rows held out."""
    r = resolve("pretrain", BIG_VISION, complete=complete, inputs=False)
    cfg = data_cfg(tasks.synthetic_task(4), r)
    assert cfg.holdout == 0 and r.data.holdout == 0.01
    assert len(sources.load_split(cfg, "train")) == cfg.synthetic.train_size
