"""Sweeps over any recipe key (`--sweep KEY=V1,V2`): one run per point in WORKDIR/<point>, each with
its values in its recipe; one table and CSV of every point's final metrics, the best on the dev
split marked; a rerun skips every finished point and touches no file; `--sweep-point I` runs one
point and the run that finishes the last writes the table; a point that diverges is recorded as
failed and the others still run."""

import csv
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from helpers import REPO, run_vit
from vitcli.errors import TrainingError
from vitcli.recipe.grid import Point
from vitcli.recipe.resolve import resolve
from vitcli.runtime import dist as dist_mod
from vitcli.runtime.run_files import MODEL_FILE, RECIPE_FILE, SUMMARY_FILE, SWEEP_CSV, SWEEP_FILE
from vitcli.stages import sweep as sweep_mod

QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")
# the quickstart's network (64 wide, 32 px) at depth 1, two steps on 32 images, evaluated at the end
TINY = ["model.depth=1", "schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1",
        "data.synthetic.train_size=32", "data.synthetic.val_size=16", "data.synthetic.test_size=16",
        "data.batch_size=16", "run.log_every=1", "run.eval_every=2", "run.ckpt_every=2"]
GRID = ["--sweep", "optim.lr=1e-3,3e-3", "--sweep", "run.seed=0,1"]
NAMES = ["optim.lr=0.001,run.seed=0", "optim.lr=0.001,run.seed=1", "optim.lr=0.003,run.seed=0",
         "optim.lr=0.003,run.seed=1"]


def pretrain(workdir: Path, *args) -> list:
    return ["pretrain", "-r", QUICK, "--workdir", workdir, *TINY, *args]


def snapshot(root: Path) -> dict:
    return {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(root.rglob("*"))}


def csv_rows(workdir: Path) -> list[dict]:
    with open(workdir / SWEEP_CSV) as f:
        return list(csv.DictReader(f))


def test_a_2x2_sweep_trains_each_point_tabulates_them_and_a_rerun_touches_nothing(tmp_path, monkeypatch,
                                                                                    capsys):
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *GRID))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*NAMES, SWEEP_CSV, SWEEP_FILE])
    summaries = {}
    for name in NAMES:  # each point trained with its own values, the rest of the command's recipe kept
        saved = yaml.safe_load((tmp_path / name / RECIPE_FILE).read_text())
        assert name == f"optim.lr={saved['optim']['lr']},run.seed={saved['run']['seed']}"
        assert saved["schedule"]["steps"] == 2 and saved["model"]["depth"] == 1
        summaries[name] = json.loads((tmp_path / name / SUMMARY_FILE).read_text())

    rows = csv_rows(tmp_path)
    assert [r["point"] for r in rows] == NAMES  # the product in order, the last key fastest
    assert list(rows[0])[:6] == ["point", "optim.lr", "run.seed", "status", "val/top1", "val/loss"]
    for r in rows:  # every final metric of the point's own summary.json, exactly
        metrics = {k: v for k, v in summaries[r["point"]].items() if "/" in k}
        assert {k: r[k] for k in metrics} == {k: str(v) for k, v in metrics.items()}
        assert r["status"] == "finished"
    table = json.loads((tmp_path / SWEEP_FILE).read_text())
    dev = {name: s["val/top1"] for name, s in summaries.items()}
    assert table["best"] == max(dev, key=dev.get) and table["keys"] == ["optim.lr", "run.seed"]
    assert [p["run.seed"] for p in table["points"]] == [0, 1, 0, 1] and table["failed"] == []
    assert "sweep of 4 points, best on val/top1 marked *" in out
    assert "pretrain finished in" not in out, "a point's own table: the sweep's alone is printed"
    best_row = NAMES.index(table["best"])
    assert any(line.lstrip("│ ").startswith(f"{best_row} *") for line in out.splitlines()), out

    before = snapshot(tmp_path)
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *GRID))
    assert code == 0, err
    assert snapshot(tmp_path) == before, "a rerun of a finished sweep touches no file"
    assert [f"point {name}: finished, skipped" in " ".join(err.split()) for name in NAMES] == [True] * 4
    assert "sweep of 4 points" in out


def test_sweep_point_runs_one_point_and_the_last_to_finish_writes_the_table(tmp_path, monkeypatch, capsys):
    seeds = ["--sweep", "run.seed=0,1"]
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *seeds, "--sweep-point", "1", "--json"))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.seed=1"]  # no table: point 0 has not run
    assert [p["status"] for p in json.loads(out)["points"]] == ["pending", "finished"]
    assert "1 of 2 points finished" in " ".join(err.split())

    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, *seeds, "--sweep-point", "0"))
    assert code == 0, err
    rows = csv_rows(tmp_path)
    assert [(r["point"], r["status"]) for r in rows] == [("run.seed=0", "finished"),
                                                          ("run.seed=1", "finished")]
    first = json.loads((tmp_path / "run.seed=1" / SUMMARY_FILE).read_text())
    assert rows[1]["test/top1"] == str(first["test/top1"])  # read back from the point another task ran


def test_the_dry_run_prints_the_commands_recipe_and_lists_the_points(tmp_path, monkeypatch, capsys):
    code, plain, _ = run_vit(monkeypatch, capsys, *pretrain(tmp_path / "w", "--dry-run"))
    assert code == 0
    code, out, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path / "w", *GRID, "--sweep-point", "2",
                                                             "--dry-run"))
    assert code == 0 and out == plain
    listed = [line.split(": ", 1)[1] for line in err.splitlines() if line.startswith("#   ")]
    assert [name.removesuffix("  <- --sweep-point") for name in listed] == NAMES
    assert listed[2].endswith("<- --sweep-point") and "4 points" in err
    assert not (tmp_path / "w").exists()


def fake_training(fails: dict, calls: list):
    """run_training as the sweep calls it, for stand-in points: a summary whose val/top1 is the
    rate, or the error `fails` gives for that rate."""

    def train(recipe, workdir, dist, resume=None, overwrite=False, skip_note="", table=True):
        calls.append(workdir.name)
        if recipe.optim.lr in fails:
            raise fails[recipe.optim.lr]
        return {"steps": 2, "val/top1": recipe.optim.lr, "test/top1": 1 - recipe.optim.lr}

    return train


@pytest.mark.parametrize("error", [TrainingError("loss became nan at step 2"),
                                   torch.OutOfMemoryError("CUDA out of memory")])
def test_a_failed_point_is_recorded_the_others_run_and_the_sweep_exits_2(error, tmp_path, monkeypatch,
                                                                          capsys):
    calls = []
    monkeypatch.setattr(sweep_mod, "run_training", fake_training({0.5: error}, calls))
    code, _, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, "--sweep", "optim.lr=0.1,0.5,0.2"))
    assert calls == ["optim.lr=0.1", "optim.lr=0.5", "optim.lr=0.2"], "the point after the failure ran"
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: sweep: 1 of 3 points failed, "
                                                                 "first optim.lr=0.5"), err
    rows = csv_rows(tmp_path)
    assert [r["status"] for r in rows] == ["finished", "failed", "finished"]
    assert rows[1]["val/top1"] == "" and str(error) in rows[1]["error"]
    assert json.loads((tmp_path / SWEEP_FILE).read_text())["best"] == "optim.lr=0.2"  # of those that finished


def test_a_failed_sweep_point_fails_its_task_and_writes_no_table(tmp_path, monkeypatch, capsys):
    calls = []
    fails = {0.5: TrainingError("loss became nan")}
    monkeypatch.setattr(sweep_mod, "run_training", fake_training(fails, calls))
    code, _, err = run_vit(monkeypatch, capsys, *pretrain(tmp_path, "--sweep", "optim.lr=0.1,0.5",
                                                           "--sweep-point", "1"))
    assert code == 2 and "loss became nan" in err and calls == ["optim.lr=0.5"]
    assert not (tmp_path / SWEEP_CSV).exists()


def test_the_lr_sweep_chooses_among_the_rates_that_trained(tmp_path, monkeypatch):
    """A rate that diverges is an outcome of the learning-rate sweep: left out of the choice,
    recorded."""
    calls = []
    fails = {0.9: TrainingError("loss became inf")}
    monkeypatch.setattr(sweep_mod, "run_training", fake_training(fails, calls))
    r = resolve("finetune", None, ["schedule.steps=10", "schedule.warmup_steps=1",
                                   "data.val_split=validation"])
    summary = sweep_mod.lr_sweep(r, tmp_path, [0.1, 0.9, 0.3], dist_mod.setup("cpu"))
    assert summary["best_lr"] == 0.3 and summary["dev/top1"] == 0.3 and summary["test/top1"] == 1 - 0.3
    assert summary["failed"] == ["optim.lr=0.9"]
    assert [r["status"] for r in csv_rows(tmp_path)] == ["finished", "failed", "finished"]
    assert not (tmp_path / MODEL_FILE).exists()


def test_a_sweep_the_checkpoint_would_ignore_or_into_a_single_run_is_refused(tmp_path, monkeypatch,
                                                                              capsys):
    """`--sweep model.depth=1,3` of a fine-tune trains the checkpoint's depth at every point:
    refused before anything is written (by --dry-run too), naming the key and the checkpoint. A
    sweep into the workdir of a single run would fill it around that run: refused, the run's files
    untouched."""
    single = tmp_path / "pretrain"
    code, _, err = run_vit(monkeypatch, capsys, *pretrain(single))  # model.depth=1
    assert code == 0, err
    ft = ["finetune", "-r", str(REPO / "recipes/quickstart/finetune.yaml"), "--init", single,
          "--workdir", tmp_path / "ft", "schedule.steps=2", "schedule.warmup_steps=1"]
    for dry in ([], ["--dry-run"]):
        code, _, err = run_vit(monkeypatch, capsys, *ft, "--sweep", "model.depth=1,3", *dry)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"error: --sweep model.depth: the starting checkpoint {single} fixes "
                              "it (point model.depth=3 would run model.depth=1)"), err
    assert not (tmp_path / "ft").exists()

    before = snapshot(single)
    lr_sweep = [*ft[:5], "--workdir", single, *ft[-2:], "--lr-sweep", "0.1,0.2"]
    # run here, or submitted as a job array; and their dry runs
    for way in ([], ["--slurm"], ["--dry-run"], ["--slurm", "--dry-run"]):
        for args in (pretrain(single, "--sweep", "run.seed=0,1", *way), [*lr_sweep, *way]):
            code, out, err = run_vit(monkeypatch, capsys, *args)
            assert code == 2 and f"{single} holds a finished" in " ".join(err.split()), err
            assert out == "" and snapshot(single) == before, (way, out)


def test_the_table_is_readable_at_100_columns(tmp_path):
    """The swept keys, the dev and test metrics and the status, every cell on one line at 100
    columns, a failed point's error whole below the table; the other metrics only in sweep.csv."""
    keys = ["optim.lr", "model.drop_path", "data.mixup_alpha"]
    error = ("TrainingError: loss became nan at step 41 of 400 (lr 0.3); lower optim.lr or set "
             "clip_grad_norm")
    metrics = {"steps": 400, "val/loss": 1.234567, "test/top1": 0.6001, "test/loss": 1.3,
               "train/loss": 0.9876, "train/img_per_s": 1234.5678, "mem/main_peak_mb": 4321.0,
               "fewshot/cifar100/5shot": 0.4, "train/mfu": 0.00123}
    rows = []
    for i, (lr, drop, mix) in enumerate([(0.001, 0.0, 0.2), (0.003, 0.1, 0.2), (0.3, 0.1, 0.8)]):
        point = Point(f"p{i}", {"optim.lr": lr, "model.drop_path": drop, "data.mixup_alpha": mix})
        summary = {**metrics, "val/top1": 0.61234 + i / 100}
        rows.append(sweep_mod.row(point, None, error) if lr == 0.3 else
                    sweep_mod.row(point, summary))
    summary = sweep_mod.table(rows, keys)
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(sweep_mod._rich_table(summary, "sweep of 3 points"))
    lines = console.export_text().splitlines()
    said = " ".join(" ".join(lines).split())
    assert max(len(line) for line in lines) <= 100
    header = next(line for line in lines if "optim.lr" in line)
    assert all(name in header for name in [*keys, "val/top1", "test/top1", "status"])
    more = len([k for k in metrics if "/" in k]) + 1 - 2  # val/top1 too, all but val/ and test/top1
    assert "train/img_per_s" not in said
    assert f"{more} more metrics of each point in sweep.csv" in said
    body = [line for line in lines if line.startswith("│") and line.lstrip("│ ")[:1].isdigit()]
    assert len(body) == 3, "a row a point: no cell wraps"
    assert "0.6223" in body[1] and "0.6001" in body[1] and "finished" in body[1]  # numbers whole
    assert body[2].rstrip(" │").endswith("failed")
    assert f"2 failed: {error.partition(': ')[2]}" in said, said
    assert error in as_csv_error(summary)


def test_a_narrow_tables_title_is_one_line():
    """Two columns of metrics are narrower than the learning-rate sweep's title: it stays whole."""
    rows = [sweep_mod.row(Point(f"optim.lr={lr}", {"optim.lr": lr}),
                          {"val/top1": lr, "test/top1": lr}) for lr in (0.1, 0.3)]
    title = "learning-rate sweep (chosen on dev)"
    console = Console(width=100, record=True, file=io.StringIO())
    console.print(sweep_mod._rich_table(sweep_mod.table(rows, ["optim.lr"]), title))
    assert f"{title}, best on val/top1 marked *" in console.export_text().splitlines()[0]


def as_csv_error(summary: dict) -> str:
    rows = csv.DictReader(io.StringIO(sweep_mod.as_csv(summary)))
    return next(r["error"] for r in rows if r["error"])
