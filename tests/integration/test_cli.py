"""The command line: instant help, dry runs, and bad input as one red line with exit code 2."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO, machine, run_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.cli import entry
from vitcli.cli.commands import COMMANDS
from vitcli.errors import DataError, Interrupted, Terminated
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.checks import get
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import ModelConfig, Recipe
from vitcli.runtime import precision
from vitcli.runtime.run_files import SUMMARY_FILE
from vitcli.stages import finetune as finetune_stage

QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")



def test_cli_module_does_not_import_torch():
    probe = "import sys, vitcli.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_the_cli_imports_under_a_typer_without_the_flag_label_hook():
    # typer 0.27.2 (the lent GPU's image) has no TyperOption.display_type_rich: `vit` failed at
    # import there. The stand-in: a TyperOption without it, in a process of its own
    probe = ("import click, typer.core\n"
             "typer.core.TyperOption = type('TyperOption', (click.Option,), {})\n"
             "import vitcli.cli\nprint(vitcli.cli.app.info.name)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "vit"


def test_help_lists_the_stages(monkeypatch, capsys):
    code, out, _ = run_vit(monkeypatch, capsys, "--help")
    assert code == 0
    for cmd in ("pretrain", "finetune", "eval-fewshot", "resize-posemb"):
        assert cmd in out


def test_each_commands_summary_is_one_line_where_the_terminal_is_wide_enough(monkeypatch, capsys):
    """A docstring wrapped at 100 columns in the source is not wrapped again in the help."""
    monkeypatch.setenv("COLUMNS", "250")
    code, out, _ = run_vit(monkeypatch, capsys, "--help")
    rows = [line.strip("│ ").split(maxsplit=1) for line in out.splitlines()
            if line.startswith("│")]
    summaries = {row[0]: row[1].strip() for row in rows if len(row) == 2 and row[0] in COMMANDS}
    assert code == 0 and set(summaries) == set(COMMANDS), out
    for name, summary in summaries.items():
        assert summary.endswith("."), f"{name}'s summary breaks mid-sentence: {summary!r}"


def test_dry_run_prints_resolved_recipe_with_overrides(monkeypatch, capsys):
    code, out, _ = run_vit(monkeypatch, capsys, "pretrain", "--recipe", QUICK, "--dry-run",
                           "optim.lr=1e-4", "data.batch_size=64")
    assert code == 0
    resolved = yaml.safe_load(out)
    assert resolved["optim"]["lr"] == pytest.approx(1e-4)
    assert resolved["data"]["batch_size"] == 64
    assert resolved["model"]["embed_dim"] == 64  # from the file


def test_dry_run_fills_paper_model_sizes(monkeypatch, capsys):
    code, out, _ = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", "model.name=ViT-L/16",
                           "schedule.steps=100", "schedule.warmup_steps=10")
    assert code == 0
    m = yaml.safe_load(out)["model"]
    assert ((m["embed_dim"], m["depth"], m["num_heads"], m["mlp_dim"], m["patch_size"])
            == (1024, 24, 16, 4096, 16))


def test_dry_run_says_what_each_auto_chooses_here_and_why(monkeypatch, capsys):
    """On stderr, so stdout stays the YAML; deciding imports torch, once every check has passed."""
    monkeypatch.setattr(precision, "detect_bf16", machine(False))
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", "run.device=cpu",
                             "schedule.steps=100", "schedule.warmup_steps=10")
    assert code == 0
    run = yaml.safe_load(out)["run"]
    assert run["precision"] == "auto" and run["compile"] == "auto"  # what a recipe says, as it says it
    assert "# run.precision: auto -> fp32 (auto: CPU has only AVX2: bf16 would be emulated)" in err
    assert "# run.compile: auto -> false (auto: the CPU gains nothing, measured 0.89x" in err
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--recipe", QUICK, "--dry-run")
    assert code == 0 and "auto ->" not in err  # the quickstart pins both


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["optim.lrr=0.1"], "did you mean 'optim.lr'"),
        (["data.batch_size=abc"], "data.batch_size: expected int"),
        (["model.name=ViT-B/61", "--dry-run"], "ViT-B/16"),
        (["data.batch_size=100", "data.micro_batch_size=32"], "not divisible"),
        (["data.source=/no/such/dataset"], "/no/such/dataset"),
        (["data.image_column=pixels"], "pixels"),
    ],
)
def test_bad_input_is_one_line_exit_2(monkeypatch, capsys, tmp_path, args, fragment):
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--recipe", QUICK, "--workdir",
                           str(tmp_path / "w"), "schedule.epochs=0", "schedule.steps=3",
                           "schedule.warmup_steps=1", "data.synthetic.train_size=64",
                           "data.batch_size=32", *args)
    assert code == 2, err
    assert fragment in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w" / "model.safetensors").exists()


def test_malformed_recipe_names_the_line(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  depth: 2\n   heads: 3\n")
    code, _, err = run_vit(monkeypatch, capsys, "pretrain", "--recipe", str(bad), "--dry-run")
    assert code == 2 and "line 3" in err and "bad.yaml" in err


def test_debug_env_shows_the_traceback(tmp_path):
    env = {"VITCLI_DEBUG": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "vitcli.cli", "pretrain", "--dry-run", "optim.lrr=1"],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "RecipeError" in proc.stderr


@pytest.mark.parametrize("rank,says", [("0", True), ("1", False)])
def test_a_signal_stop_is_reported_once_under_torchrun(monkeypatch, capsys, rank, says):
    """Every rank stops at the same agreed step with the same message: rank 0 prints it, the others
    only exit with its code (torchrun would otherwise show it once per process)."""
    def stopped(**kwargs):
        raise Interrupted("SIGTERM at step 3/9: checkpoint written in w; run the same command again",
                          exit_code=143)

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(entry, "app", stopped)
    code, out, err = run_vit(monkeypatch, capsys, "pretrain")
    assert code == 143 and out == ""
    assert ("SIGTERM at step 3/9" in err) == says


@pytest.mark.parametrize("stop, code, says", [
    (Interrupted("stopped by SIGINT at step 28/60: checkpoint written in w; run the same command again",
                 exit_code=130), 130, "stopped by SIGINT at step 28/60"),
    (KeyboardInterrupt(), 130, "interrupted (Ctrl-C)"), (Terminated(), 143, "terminated (SIGTERM)")],
    ids=["the loop's stop", "ctrl-c", "sigterm"])
def test_a_stop_asked_for_is_one_plain_line_not_an_error(monkeypatch, capsys, stop, code, says):
    """Ctrl-C stops cleanly and says where the checkpoint is: it was once told as `error: SIGINT at
    ...`. The exit code still tells a script that the command did not finish."""
    def stopped(**kwargs):
        raise stop

    monkeypatch.setattr(entry, "app", stopped)
    exit_code, _, err = run_vit(monkeypatch, capsys, "pretrain")
    lines = err.strip().splitlines()
    assert exit_code == code and len(lines) == 1 and lines[0].startswith(says), err
    assert "error" not in err.lower() and "Traceback" not in err


def tiny_checkpoint(path: Path) -> Path:
    """Weights with our metadata, so a recipe resolves from them without a network."""
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    save_weights(path, build_model(cfg, 4).state_dict(), {"recipe": to_dict(Recipe(model=cfg)),
                                                         "model": model_spec(cfg, 4)})
    return path


@pytest.mark.parametrize("command, driver, extra, handed", [
    (["pretrain"], "vitcli.stages.run.one_run", ["schedule.steps=10", "schedule.warmup_steps=1"],
     {"resume": None, "overwrite": False}),
    (["finetune", "--lr-sweep", "0.01,0.03", "--no-resume"], "vitcli.stages.finetune.finetune",
     ["schedule.steps=10", "schedule.warmup_steps=1"],
     {"resume": False, "overwrite": False, "lrs": [0.01, 0.03], "chosen": None}),
    (["eval-fewshot", "--tasks", "synthetic"], "vitcli.stages.fewshot.eval_fewshot",
     ["--ckpt", "{ckpt}", "--overwrite"], {"overwrite": True}),
])
def test_a_command_hands_its_stage_the_parsed_flags_and_prints_what_it_returns(
        monkeypatch, capsys, tmp_path, command, driver, extra, handed):
    """The thin CLI: parse, call the stage once, print its return value as JSON (rank 0 only),
    name no file."""
    calls, checks = [], []
    monkeypatch.setattr(driver,
                        lambda recipe, workdir, **flags: calls.append((workdir, flags)) or {"x/top1": 0.5})
    check = finetune_stage.check_flags
    monkeypatch.setattr(finetune_stage, "check_flags", lambda *a: checks.append(a) or check(*a))
    extra = [a.format(ckpt=tiny_checkpoint(tmp_path / "c.safetensors")) for a in extra]
    code, out, err = run_vit(monkeypatch, capsys, *command, "--workdir", tmp_path, "--json", *extra)
    assert code == 0, err
    assert calls == [(tmp_path, handed)]
    assert yaml.safe_load(out) == {"x/top1": 0.5}
    assert len(checks) == (command[0] == "finetune")  # the flags are checked once, before the dry run
    monkeypatch.setenv("RANK", "1")
    code, out, err = run_vit(monkeypatch, capsys, *command, "--workdir", tmp_path, "--json", *extra)
    assert code == 0 and out == "", err


def test_json_is_what_the_run_wrote_in_summary_json(monkeypatch, capsys, tmp_path):
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--recipe", QUICK, "--workdir", tmp_path,
                             "--json", "schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1",
                             "data.synthetic.train_size=64", "data.synthetic.val_size=32",
                             "data.synthetic.test_size=32", "data.batch_size=32", "data.num_workers=0")
    assert code == 0, err
    assert out == (tmp_path / SUMMARY_FILE).read_text()
    assert json.loads(out)["steps"] == 2 and "test/top1" in json.loads(out)


def test_the_startup_benchmark_reports_each_command():
    """bench/startup.py (make bench-startup) times whole `vit` processes; here its schema, not the
    time."""
    done = subprocess.run([sys.executable, str(REPO / "bench/startup.py"), "--runs", "1"],
                          capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    assert {"help", "misspelt_key", "dry_run_quickstart", "targets"} <= set(report)
    assert report["misspelt_key"]["command"] == "vit pretrain --dry-run model.nmae=x"
    assert all(report[k]["median_s"] > 0 and report[k]["peak_rss_mb"] > 0 for k in ("help", "misspelt_key"))


# ---------------------------------------------------------------- each command, the one dispatcher


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "c.safetensors")


def handed(ckpt: Path, tmp: Path) -> dict:
    """command -> (its arguments, the stage function it hands over to, what that receives after the
    recipe, and what the recipe it receives says by dotted key; None: it receives none)."""
    from vitcli.data.rows.prepare import Options

    return {
        "evaluate": (
            ["evaluate", "--ckpt", ckpt, "--workdir", tmp / "w", "--split", "test[:8]", "--tta", "multicrop",
             "--tta", "flip", "--tta", "multicrop", "--calibrate-on", "validation"],
            "vitcli.stages.evaluate.evaluate", ((tmp / "w",), {"real_path": None, "real": None,
                                                               "tta": ("flip", "multicrop"),
                                                               "calibrate_on": "validation",
                                                               "overwrite": False}),
            {"stage": "evaluate", "init.checkpoint": str(ckpt), "data.test_split": "test[:8]",
             "model.num_classes": 4, "model.img_size": 32}),
        "predict": (
            ["predict", tmp / "a.png", "--ckpt", ckpt, "--top-k", "3", "--batch-size", "2"],
            "vitcli.stages.predict.predict", (([tmp / "a.png"], 3), {}),
            {"stage": "predict", "data.eval_batch_size": 2, "model.num_classes": 4}),
        "resize-posemb": (
            ["resize-posemb", "--ckpt", ckpt, "--res", "64", "--method", "bicubic", "--old-grid", "4x4",
             "--dry-run"],
            "vitcli.stages.resize.run_resize",
            ((str(ckpt),), {"out": None, "res": 64, "grid": None, "old_grid": "4x4", "patch": None,
                            "method": "bicubic", "overwrite": False, "dry_run": True}),
            None),
        "inspect": (
            ["inspect", "--ckpt", ckpt, "--out", tmp / "o", "--images", "4"],
            "vitcli.stages.inspect.inspect", ((tmp / "o",), {"split": "test", "images": 4}),
            {"stage": "inspect", "init.checkpoint": str(ckpt), "data.source": "synthetic",
             "data.label_column": "", "model.num_classes": 0, "model.img_size": 32}),
        "plot": (
            ["plot", tmp / "a", tmp / "b", "--out", tmp / "c.png"],
            "vitcli.stages.plot.plot", (([tmp / "a", tmp / "b"], tmp / "c.png"), {}), None),
        "prepare-data": (
            ["prepare-data", "synthetic", "--out", tmp / "p", "--max-size", "24", "--splits",
             "train", "--format", "png", "--dry-run", "data.synthetic.train_size=64"],
            "vitcli.stages.prepare.prepare_data",
            ((tmp / "p",), {"splits": "train", "options": Options(max_size=24, format="png"),
                            "overwrite": False, "dry_run": True}),
            {"stage": "prepare-data", "data.source": "synthetic", "data.train_split": "",
             "data.synthetic.train_size": 64}),
        "export": (
            ["export", "--ckpt", ckpt, "--format", "hf", "--out", tmp / "e", "--overwrite",
             "--results", tmp / "ev", "--results", tmp / "fs"],
            "vitcli.stages.export.export",
            (("hf", tmp / "e"), {"overwrite": True, "dry_run": False,
                                 "results": [tmp / "ev", tmp / "fs"]}),
            {"stage": "export", "init.checkpoint": str(ckpt), "model.num_classes": 0,
             "model.img_size": 32}),
        "eval-fewshot --list-tasks": (
            ["eval-fewshot", "--list-tasks"], "vitcli.stages.fewshot.print_registry", ((), {}),
            None),
    }


HANDED = sorted(handed(Path("c"), Path(".")))


def stub(monkeypatch, target: str, returns) -> list:
    """The stage at `target` replaced by one that records what it receives, prints a table and
    returns `returns`; the list of its calls."""
    from vitcli.runtime.metrics import stdout

    calls = []

    def stage(*args, **kwargs):
        calls.append((args, kwargs))
        stdout.print("a table")
        return returns

    monkeypatch.setattr(target, stage)
    return calls


@pytest.mark.parametrize("command", HANDED)
def test_each_command_resolves_its_own_stage_and_hands_the_recipe_over(command, ckpt, tmp_path,
                                                                        monkeypatch, capsys):
    """Each command resolves its recipe under its own stage name (no stage resolves one) and calls
    its stage function once with the recipe and its flags, parsed; the stage's table is shown."""
    args, target, (positional, named), says = handed(ckpt, tmp_path)[command]
    calls = stub(monkeypatch, target, {"x": 1})
    code, out, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    assert out == "a table\n"
    ((received, kwargs),) = calls
    if says is not None:
        recipe, *received = received
        assert {key: get(recipe, key) for key in says} == says
    assert (tuple(received), kwargs) == (positional, named)


@pytest.mark.parametrize("command", [c for c in HANDED if c != "plot"])
def test_json_is_what_the_stage_returned_printed_by_rank_0_alone(command, ckpt, tmp_path,
                                                                   monkeypatch, capsys):
    args, target, _, _ = handed(ckpt, tmp_path)[command]
    returned = {"top1": 0.5, "files": ["a", "b"]}
    stub(monkeypatch, target, returned)
    code, out, err = run_vit(monkeypatch, capsys, *args, "--json")
    assert code == 0 and json.loads(out) == returned, err  # the table went nowhere
    monkeypatch.setenv("RANK", "1")
    code, out, err = run_vit(monkeypatch, capsys, *args, "--json")
    assert code == 0 and out == "", err


def test_csv_spreads_each_record_over_one_row_per_rank(ckpt, tmp_path, monkeypatch, capsys):
    args, target, _, _ = handed(ckpt, tmp_path)["predict"]
    top = [{"rank": 1, "class_index": 2, "class_name": "cat, tabby", "probability": 0.123456789},
           {"rank": 2, "class_index": 0, "class_name": "dog", "probability": 0.1}]
    records = [{"path": "a.png", "top": top}, {"path": "b.png", "top": top[:1]}]
    calls = stub(monkeypatch, target, records)
    code, out, err = run_vit(monkeypatch, capsys, *args, "--csv")
    assert code == 0, err
    assert out == ("path,rank,class_index,class_name,probability\n"
                   'a.png,1,2,"cat, tabby",0.123457\na.png,2,0,dog,0.1\n'
                   'b.png,1,2,"cat, tabby",0.123457\n')
    code, out, err = run_vit(monkeypatch, capsys, *args, "--csv", "--json")
    assert code == 2 and out == "" and "--json and --csv" in err and len(calls) == 1, err


@pytest.mark.parametrize("raised, code, line", [
    (DataError("no image decodes"), 2, "error: no image decodes"),
    (RuntimeError("a bug"), 1, "error: RuntimeError: a bug (set VITCLI_DEBUG=1 for the traceback)"),
])
def test_a_stage_error_is_one_line_and_its_exit_code(raised, code, line, ckpt, tmp_path,
                                                     monkeypatch, capsys):
    def fails(*args, **kwargs):
        raise raised

    for command in ("export", "resize-posemb"):
        args, target, _, _ = handed(ckpt, tmp_path)[command]
        monkeypatch.setattr(target, fails)
        assert run_vit(monkeypatch, capsys, *args, "--json") == (code, "", line + "\n")


def test_a_dry_run_of_a_workdir_stage_prints_the_recipe_and_never_runs_it(monkeypatch, capsys):
    calls = stub(monkeypatch, "vitcli.stages.run.one_run", {})
    code, out, err = run_vit(monkeypatch, capsys, "pretrain", "--dry-run", "--json",
                             "schedule.steps=10", "schedule.warmup_steps=1")
    assert code == 0 and yaml.safe_load(out)["stage"] == "pretrain" and calls == [], err


def test_without_workdir_a_stage_runs_in_a_new_one_named_by_it(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    evaluated = stub(monkeypatch, "vitcli.stages.evaluate.evaluate", {})
    assert run_vit(monkeypatch, capsys, "evaluate", "--ckpt", ckpt)[0] == 0
    scored = stub(monkeypatch, "vitcli.stages.fewshot.eval_fewshot", {})
    args = ["eval-fewshot", "--ckpt", ckpt, "--tasks", "synthetic"]
    assert run_vit(monkeypatch, capsys, *args)[0] == 0
    (((_, evaluate_dir), _),), (((_, fewshot_dir), _),) = evaluated, scored
    assert re.fullmatch(r"runs/evaluate-\d{8}-\d{6}", str(evaluate_dir))
    assert re.fullmatch(r"runs/fewshot-\d{8}-\d{6}", str(fewshot_dir))


@pytest.mark.parametrize("args", [["inspect", "RUN", "--out", "figs"],
                                  ["resize-posemb", "RUN", "--res", "384"],
                                  ["export", "RUN", "--format", "hf", "--out", "x"]])
def test_a_checkpoint_given_by_position_is_refused_naming_ckpt(args, monkeypatch, capsys):
    """`vit inspect RUN` and `vit resize-posemb RUN` were the documented form; the checkpoint is
    --ckpt."""
    code, out, err = run_vit(monkeypatch, capsys, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"named by --ckpt, not by position: `vit {args[0]} --ckpt RUN ...`" in err


def test_the_cli_names_each_stage_by_import_not_by_string():
    """Static tools and test_layout see which stage each command runs: no importlib in the CLI."""
    for path in (REPO / "src/vitcli/cli").glob("*.py"):
        assert "importlib" not in path.read_text().replace("importlib.metadata", ""), path
