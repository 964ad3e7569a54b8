"""A finished evaluation is read-only to its own repetition: `vit eval-fewshot` and `vit evaluate`
run again with the same request print the stored results and touch no file (bytes and mtimes);
another request into the workdir is one line, exit 2, naming the difference, another --workdir and
--overwrite; --overwrite evaluates again and keeps the finished results in previous-<time>/; a run
stopped before its results.json is completed by the same command. And `vit evaluate` says when the
split's class names are not the checkpoint's."""

import json
import shutil
from pathlib import Path

import datasets
import pytest

from helpers import run_vit
from vitcli.data.rows.synthetic import class_names, make_synthetic
from vitcli.fewshot import features, protocols, report
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import SyntheticConfig
from vitcli.runtime import precision
from vitcli.runtime.files import sha256_of
from vitcli.stages import evaluate as evaluate_stage
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.val_size=32", "data.synthetic.test_size=32", "data.batch_size=32",
        "data.num_workers=0", "schedule.steps=2", "schedule.warmup_steps=1", "fewshot.every=0"]
EVAL = ["run.device=cpu", "run.precision=fp32", "data.num_workers=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished tiny pretraining on the built-in data's 4 classes (its head names them)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    one_run(resolve("pretrain", None, TINY), workdir)
    return workdir


def tree(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under `root` by relative path: its sha256 and its mtime."""
    return {str(p.relative_to(root)): (sha256_of(p), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def fewshot(ckpt, workdir, *extra):
    return ["eval-fewshot", "--ckpt", ckpt, "--tasks", "synthetic", "--shots", "2", "--seeds", "1",
            "--workdir", workdir, *EVAL, "data.synthetic.train_size=40", "data.synthetic.test_size=20",
            *extra]


def finished_fewshot(monkeypatch, capsys, ckpt, workdir) -> dict:
    """eval-fewshot run into `workdir`; its tree()."""
    code, _, err = run_vit(monkeypatch, capsys, *fewshot(ckpt, workdir))
    assert code == 0, err
    return tree(workdir)


def nothing_computed(monkeypatch):
    """From here on, extracting features or scoring a protocol fails the test."""
    def fail(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(features, "extract", fail)
    monkeypatch.setattr(protocols, "task_rows", fail)
    monkeypatch.setattr(evaluate_stage, "predictions", fail)


def test_eval_fewshot_again_prints_the_stored_tables_and_touches_no_file(run, tmp_path, monkeypatch, capsys):
    args = fewshot(run, tmp_path / "w", "--protocols", "fewshot,linear")
    code, first, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    done = tree(tmp_path / "w")
    nothing_computed(monkeypatch)
    code, again, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "holds this few-shot evaluation, finished: nothing to do" in " ".join(err.split())
    assert again == first  # the same tables, the linear probe's included, and the same list of files
    assert tree(tmp_path / "w") == done
    code, as_json, err = run_vit(monkeypatch, capsys, *args, "--json")
    assert code == 0 and json.loads(as_json) == json.loads((tmp_path / "w/results.json").read_text())
    assert tree(tmp_path / "w") == done


def test_the_same_checkpoint_named_otherwise_or_copied_is_the_same_request(run, tmp_path, monkeypatch,
                                                                          capsys):
    done = finished_fewshot(monkeypatch, capsys, run, tmp_path / "w")
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(run / "model.safetensors", copy)  # another path, another mtime, the same bytes
    nothing_computed(monkeypatch)
    for ckpt in (run / "model.safetensors", copy):
        code, _, err = run_vit(monkeypatch, capsys, *fewshot(ckpt, tmp_path / "w"), "data.num_workers=2")
        assert code == 0 and "nothing to do" in err, err  # data.num_workers: how it runs, not what
    assert tree(tmp_path / "w") == done


def test_another_request_is_one_line_and_overwrite_keeps_the_finished_results(run, tmp_path, monkeypatch,
                                                                            capsys):
    done = finished_fewshot(monkeypatch, capsys, run, tmp_path / "w")
    for extra, named in ((["--shots", "3"], "fewshot.shots"), (["--l2", "auto"], "fewshot.l2_reg")):
        code, out, err = run_vit(monkeypatch, capsys, *fewshot(run, tmp_path / "w"), *extra)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert named in err and "--workdir" in err and "--overwrite" in err, err
    assert tree(tmp_path / "w") == done
    extracted = counted(monkeypatch, features, "extract")
    code, _, err = run_vit(monkeypatch, capsys, *fewshot(run, tmp_path / "w"), "--shots", "3", "--overwrite")
    assert code == 0, err
    assert extracted == []  # the feature cache is kept: the same features, scored again
    (kept,) = (tmp_path / "w").glob("previous-*")
    assert {name: digest for name, (digest, _) in tree(kept).items()} == {
        name: digest for name, (digest, _) in done.items() if not name.startswith("features")}
    assert json.loads((tmp_path / "w/results.json").read_text())["summary"][0]["shots"] == 3


def counted(monkeypatch, module, name) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_rewritten_checkpoint_is_another_request(run, tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "c.safetensors"
    shutil.copyfile(run / "model.safetensors", ckpt)
    code, _, err = run_vit(monkeypatch, capsys, *fewshot(ckpt, tmp_path / "w"))
    assert code == 0, err
    one_run(resolve("pretrain", None, TINY + ["run.seed=1"]), tmp_path / "other")
    shutil.copyfile(tmp_path / "other/model.safetensors", ckpt)  # same path and size, other weights
    code, _, err = run_vit(monkeypatch, capsys, *fewshot(ckpt, tmp_path / "w"))
    assert code == 2 and "rewritten since" in err and "--overwrite" in err, err


@pytest.mark.parametrize("command", ["eval-fewshot", "evaluate"])
def test_a_run_stopped_before_its_results_is_completed_by_the_same_command(command, run, tmp_path,
                                                                           monkeypatch, capsys):
    def stopped(*a, **k):
        raise KeyboardInterrupt

    # Ctrl-C while its figure is drawn: after results.csv or reliability.png, before results.json
    module, name = ((report, "write_fewshot_figure") if command == "eval-fewshot"
                    else (evaluate_stage, "write_confusion"))
    args = fewshot(run, tmp_path / "w") if command == "eval-fewshot" else [
        "evaluate", "--ckpt", run, "--workdir", tmp_path / "w", *EVAL]
    with monkeypatch.context() as patch:
        patch.setattr(module, name, stopped)
        code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 130 and not (tmp_path / "w/results.json").exists(), err
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0 and "nothing to do" not in err, err
    assert json.loads((tmp_path / "w/results.json").read_text())["inputs"]
    assert not list((tmp_path / "w").glob(".*.tmp"))  # no temporary of the stopped write left


def test_evaluate_again_prints_the_stored_results_and_overwrite_evaluates_again(run, tmp_path, monkeypatch,
                                                                               capsys):
    args = ["evaluate", "--ckpt", run, "--workdir", tmp_path / "w", *EVAL]
    code, first, err = run_vit(monkeypatch, capsys, *args, "--json")
    assert code == 0, err
    results = json.loads(first)
    assert results["weights"] == "live" and results["inputs"]["checkpoint"]["sha256"] == sha256_of(
        run / "model.safetensors")
    done = tree(tmp_path / "w")
    with monkeypatch.context() as patch:
        nothing_computed(patch)
        code, again, err = run_vit(monkeypatch, capsys, *args, "--json")
        assert code == 0 and again == first and "holds this evaluation, finished" in " ".join(err.split())
        code, table, err = run_vit(monkeypatch, capsys, *args)
        assert code == 0 and "per-class top-1" in table, err
        code, out, err = run_vit(monkeypatch, capsys, *args, "--tta", "flip")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "tta" in err and "--overwrite" in err, err
    assert tree(tmp_path / "w") == done
    code, out, err = run_vit(monkeypatch, capsys, *args, "--tta", "flip", "--overwrite", "--json")
    assert code == 0 and "tta/top1" in json.loads(out), err
    (kept,) = (tmp_path / "w").glob("previous-*")
    assert tree(kept) == {name: value for name, value in done.items()}  # moved whole: bytes and mtimes


def test_evaluate_says_when_the_split_names_its_classes_otherwise(run, tmp_path, monkeypatch, capsys):
    own = class_names(4)  # the head's, from the built-in data
    cases = {"fashion": (["tshirt", "trouser", "pullover", "dress"],
                         f"label 0: '{own[0]}' in the checkpoint, 'tshirt' in the split"),
             "respelt": ([name.upper().replace("_", "-") for name in own], None),
             "permuted": (own[::-1], "the same names in another order"),
             "integers": (None, None)}
    ds = make_synthetic(SyntheticConfig(num_classes=4, test_size=12), "test")
    for name, (names, warned) in cases.items():
        label = datasets.ClassLabel(names=names) if names else datasets.Value("int64")
        split = ds.cast(datasets.Features({"image": datasets.Image(), "label": label}))
        datasets.DatasetDict({"test": split}).save_to_disk(str(tmp_path / name))
        code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", run, "--data", tmp_path / name,
                                 "--workdir", tmp_path / f"w-{name}", *EVAL, "--json")
        assert code == 0, err
        err = " ".join(err.split())
        found = json.loads(out).get("class_names/differ")
        if warned:
            assert err.count("warning:") == 1 and warned in err
            assert "is this the data it was trained on?" in err
            assert found == 4  # reversed, every class is at another index
        else:
            assert "class names" not in err and found is None, (name, err)


def test_evaluate_records_that_it_scored_the_ema_weights(tmp_path, monkeypatch, capsys):
    one_run(resolve("pretrain", None, TINY + ["ema.decay=0.9", "ema.save=ema"]), tmp_path / "ema")
    capsys.readouterr()  # the training's report
    code, out, err = run_vit(monkeypatch, capsys, "evaluate", "--ckpt", tmp_path / "ema", "--workdir",
                             tmp_path / "w", *EVAL, "--json")
    assert code == 0 and json.loads(out)["weights"] == "ema", err


def test_what_auto_precision_chose_stands_when_it_would_choose_otherwise_now(run, tmp_path, monkeypatch,
                                                                             capsys):
    """auto's bf16 probe times a matmul: on a busy machine (or on a GPU, where inference's auto
    asks it) it may flip, and the request has not changed."""
    args = [a for a in fewshot(run, tmp_path / "w") if a != "run.precision=fp32"]  # eval-fewshot: auto
    choose_for = precision.choose_for
    for native, says in ((False, "inference in fp32 (stand-in)"), (True, "nothing to do")):
        def chosen(stage, pref, device, trained=None, detect=None, native=native):
            if pref != "auto":
                return choose_for(stage, pref, device, trained, detect)
            return ("bf16" if native else "fp32"), "stand-in"  # as a GPU's auto would flip

        monkeypatch.setattr(precision, "choose_for", chosen)
        code, _, err = run_vit(monkeypatch, capsys, *args)
        assert code == 0 and says in err, err
    code, _, err = run_vit(monkeypatch, capsys, *args, "run.precision=bf16")  # asked for: another request
    assert code == 2 and "run.precision: 'fp32' there, 'bf16' now" in err, err
