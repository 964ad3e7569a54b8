"""Bad input, as users type it, across every command: exit 2, one line naming the culprit, no
traceback, and not one file created or changed (a finished run in the workdir included)."""

import json
import os
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from helpers import REPO, refused, run_vit
from vitcli.checkpoints.weights import save_weights
from vitcli.errors import OutputError
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import REMOVED_KEYS, to_dict
from vitcli.recipe.schema import ModelConfig, Recipe
from vitcli.runtime import files
from vitcli.runtime.run_files import MODEL_FILE, SUMMARY_FILE
from vitcli.runtime.workdir import check_writable

QUICK = str(REPO / "recipes/quickstart/pretrain.yaml")
SMALL = ["data.synthetic.train_size=64", "data.synthetic.val_size=32", "data.synthetic.test_size=32",
         "data.batch_size=32", "data.num_workers=0", "schedule.epochs=0", "schedule.steps=2",
         "schedule.warmup_steps=1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A finished workdir (recipe, weights, state), a torch file pickling a class that weights_only
    loading does not allow, a binary file and a plain file to trip over."""
    root = tmp_path_factory.mktemp("bad")
    cfg = ModelConfig(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    meta = {"recipe": to_dict(Recipe(model=cfg)), "model": model_spec(cfg, 10)}
    save_weights(root / "done" / MODEL_FILE, build_model(cfg, 10).state_dict(), meta)
    files.write_text(root / "done" / "recipe.yaml", "stage: pretrain\n")
    files.write_text(root / "done" / SUMMARY_FILE, '{"steps": 2}\n')  # finished, by runtime.run_dir
    torch.save({"w": torch.zeros(1), "made_in": root}, root / "weights.pt")  # a pathlib.PosixPath
    (root / "binary.yaml").write_bytes(bytes(range(256)))
    (root / "afile").write_text("not a directory")
    (root / "adir.safetensors").mkdir()
    (root / "there.safetensors").write_bytes(b"a user's file")
    (root / "twice.yaml").write_text("optim:\n  lr: 0.1\n  lr: 0.2\n")
    (root / "removed.yaml").write_text("stage: pretrain\ndata:\n  decode_device: worker\n")
    return root


def pretrain(*args):
    return ["pretrain", "-r", QUICK, *SMALL, *args]


def finetune(*args):
    return ["finetune", "-r", str(REPO / "recipes/quickstart/finetune.yaml"), *SMALL, *args]


def fewshot(*args):
    return ["eval-fewshot", "--tasks", "synthetic", "--ckpt", "{root}/done", "data.synthetic.train_size=40",
            "data.synthetic.test_size=40", "data.num_workers=0", *args]


CASES = {
    # usage errors (Typer's own click)
    "unknown command": (["pretrian"], "No such command 'pretrian'"),
    "misspelt option": (["pretrain", "--recipy", "x"], "--recipy"),
    "option not a number": (["finetune", "--res", "abc"], "'--res'"),
    "missing argument": (["plot"], "Missing argument"),
    "option without its value": (["eval-fewshot", "--shots"], "--shots"),
    # recipe files and keys
    "binary recipe": (["pretrain", "-r", "{root}/binary.yaml"], "not a text file"),
    "missing recipe": (["pretrain", "-r", "{root}/nope.yaml"], "recipe file not found"),
    "misspelt key": (pretrain("optim.lrr=0.1"), "did you mean 'optim.lr'"),
    "a sweep's values without --sweep": (pretrain("optim.lr=1e-3,3e-3"),
                                         "several values are a sweep: --sweep optim.lr=1e-3,3e-3"),
    # a removed key: why it went and what to do, the same whole line from an override and from a
    # file
    "removed key": (pretrain("data.decode_device=model"), REMOVED_KEYS["data.decode_device"]),
    "removed key in a recipe file": (["pretrain", "-r", "{root}/removed.yaml"],
                                     REMOVED_KEYS["data.decode_device"]),
    "recipe of another stage": (["pretrain", "-r", str(REPO / "recipes/finetune/cifar10.yaml")],
                                "says stage: finetune"),
    "override without =": (pretrain("optim.lr"), "not KEY=VALUE"),
    # values
    "lr zero": (pretrain("optim.lr=0"), "optim.lr must be positive"),
    "lr negative": (pretrain("optim.lr=-1e-3"), "optim.lr must be positive"),
    "lr nan": (pretrain("optim.lr=nan"), "optim.lr must be a finite number"),
    "zero heads": (pretrain("model.num_heads=0"), "model.num_heads must be positive"),
    "zero width": (pretrain("model.embed_dim=0"), "model.embed_dim must be positive"),
    "negative depth": (pretrain("model.depth=-2"), "model.depth must be positive"),
    "dropout 1.5": (pretrain("model.dropout=1.5"), "model.dropout must be in [0, 1)"),
    "log_every 0": (pretrain("run.log_every=0"), "run.log_every must be positive"),
    "ckpt_every 0": (pretrain("run.ckpt_every=0"), "run.ckpt_every must be positive"),
    "negative seed": (pretrain("run.seed=-1"), "run.seed must be >= 0"),
    "nan epochs": (pretrain("schedule.epochs=nan"), "schedule.epochs must be a finite number"),
    "infinite epochs": (pretrain("schedule.epochs=inf"), "schedule.epochs must be a finite number"),
    "negative workers": (pretrain("data.num_workers=-1"), "data.num_workers must be >= 0"),
    "label smoothing 1.5": (pretrain("optim.label_smoothing=1.5"), "optim.label_smoothing must be in [0, 1)"),
    "negative clip": (pretrain("optim.clip_grad_norm=-1"), "optim.clip_grad_norm must be >= 0"),
    "negative patch lr": (pretrain("optim.patch_embed_lr_scale=-1"),
                          "optim.patch_embed_lr_scale must be >= 0"),
    "layer decay above 1": (finetune("optim.layer_decay=1.5"),
                            "optim.layer_decay must be in (0, 1], got 1.5"),
    "layer decay zero": (pretrain("optim.layer_decay=0"), "optim.layer_decay must be in (0, 1], got 0.0"),
    "layer decay with mpp": (pretrain("objective=mpp", "optim.layer_decay=0.75"),
                             "optim.layer_decay=0.75 is for supervised training"),
    "mixup odd micro-batch": (pretrain("data.mixup_alpha=0.2", "data.batch_size=33"), "even micro-batch"),
    "bad randaugment": (pretrain("data.randaugment=rand-mag9"), "data.randaugment: cannot parse"),
    "cutmix odd micro-batch": (pretrain("data.cutmix_alpha=1.0", "data.batch_size=33"),
                               "data.cutmix_alpha=1.0 needs an even micro-batch"),
    "two per-image policies": (pretrain("data.randaugment=rand-m9", "data.three_augment=true"),
                               "data.three_augment are two per-image policies"),
    "jitter without 3-Augment": (pretrain("data.color_jitter=0.3"), "set data.three_augment: true"),
    "erasing 1.5": (pretrain("data.erasing=1.5"), "data.erasing must be in [0, 1]"),
    "erasing mode typo": (pretrain("data.erasing=0.25", "data.erasing_mode=pixels"),
                          "data.erasing_mode: 'pixels' is not one of pixel, rand, const"),
    "mix mode typo": (pretrain("data.mixup_alpha=0.8", "data.mix_mode=pairs"),
                      "data.mix_mode: 'pairs' is not one of batch, pair, elem"),
    "mixing without labels": (pretrain("objective=mpp", "data.cutmix_alpha=1.0"),
                              "data.cutmix_alpha=1.0 mixes labels, but objective: mpp"),
    "zero erasing boxes": (pretrain("data.erasing=0.25", "data.erasing_count=0"),
                           "data.erasing_count must be positive"),
    # values read as typed: no YAML 1.1 guesses (base 60, hex, yes/on)
    "a one-minute time limit": (pretrain("slurm.time=1:00"),
                                "slurm.signal_seconds=90 is not inside slurm.time=1:00 (60 s)"),
    "hex grid": (pretrain("init.grid=0x4"), "init.grid='0x4': expected HxW"),
    "yes for a bool": (pretrain("data.hflip=yes"), "data.hflip: write true or false, not 'yes'"),
    # a value that would leave its line of the batch script, and a job that cannot start its
    # processes
    "newline in a partition": (pretrain("slurm.partition=gpu\ntouch owned"),
                               "slurm.partition: 'gpu\\ntouch owned' holds the control character '\\n'"),
    "more processes than GPUs": (pretrain("slurm.procs_per_node=3", "slurm.gpus_per_node=2"),
                                 "slurm.procs_per_node=3 is more than slurm.gpus_per_node=2"),
    "distillation type typo": (pretrain("distill.type=sofft"),
                               "distill.type: 'sofft' is not one of none, hard, soft"),
    "distillation alpha 1.5": (pretrain("distill.alpha=1.5"), "distill.alpha must be in [0, 1]"),
    "distillation without a teacher": (pretrain("distill.type=hard"), "distill.type=hard needs a teacher"),
    "a teacher that is not there": (pretrain("distill.teacher={root}/nope", "distill.type=soft"),
                                    "distill.teacher: checkpoint not found"),
    "teacher of other classes": (pretrain("distill.teacher={root}/done", "distill.type=hard",
                                          "data.synthetic.num_classes=4"),
                                 "has a 10-class head, but the student has 4 classes"),
    "image size vs patch": (pretrain("model.img_size=30"), "model.img_size=30 is not a multiple of 4"),
    "warmup past the end": (pretrain("schedule.warmup_steps=5"), "schedule.warmup_steps=5"),
    "fewer classes than labels": (pretrain("model.num_classes=3"), "model.num_classes=3"),
    "missing data": (pretrain("data.source=/no/such/dataset"), "/no/such/dataset"),
    # the four that slipped past the recipe check (issue 19), and the checks that ran late
    "key given twice": (["pretrain", "-r", "{root}/twice.yaml"], "twice.yaml: line 3: 'lr' is given twice"),
    "negative synthetic size": (pretrain("data.synthetic.train_size=-5"),
                                "data.synthetic.train_size must be >= 0"),
    "empty source": (pretrain("data.source="), "data.source is empty"),
    "batch larger than the split": (pretrain("data.synthetic.train_size=16"),
                                    "data.batch_size=32 is larger than the train split (16 images"),
    "no recipe, no length": (["pretrain"], "set schedule.steps or schedule.epochs (both are 0)"),
    "stream without steps": (pretrain("data.streaming=true", "schedule.steps=0", "schedule.epochs=1"),
                             "data.streaming=true needs schedule.steps"),
    "stream of a slice": (pretrain("data.streaming=true", "data.train_split=train[:50%]"), "slices and '+'"),
    "lr sweep without a dev split": (finetune("--lr-sweep", "0.1,0.2", "data.val_split="),
                                     "needs a dev split"),
    "few-shot without weights": (["eval-fewshot", "--tasks", "synthetic"], "eval-fewshot needs weights"),
    "few-shot without tasks": (["eval-fewshot", "--ckpt", "{root}/done"], "no tasks: pass --tasks"),
    "unknown task inside pretraining": (pretrain("fewshot.tasks=vtab/cifar10O", "fewshot.every=1"),
                                        "did you mean 'vtab/cifar100'"),
    "no such column": (pretrain("data.image_column=pixels"), "pixels"),
    # fine-tuning flags and starting weights
    "init missing": (finetune("--init", "{root}/nowhere"), "checkpoint not found"),
    "init pickle": (finetune("--init", "{root}/weights.pt"), "pickled pathlib"),
    "task outside vtab": (finetune("--task", "cifar10"), "not a VTAB-1k task"),
    "lr sweep not numbers": (finetune("--lr-sweep", "abc"), "--lr-sweep"),
    "lr sweep zero": (finetune("--lr-sweep", "0,0.1"), "positive learning rates"),
    "res vs checkpoint patch": (finetune("--init", "{root}/done", "--res", "30"), "model.img_size=30"),
    # sweeps (--sweep): every point resolved and checked before the first trains
    "sweep unknown key": (pretrain("--sweep", "optim.lrr=0.1,0.2"), "did you mean 'optim.lr'"),
    "sweep wrong type": (pretrain("--sweep", "model.depth=1,two"), "--sweep model.depth: expected int"),
    "sweep key twice": (pretrain("--sweep", "run.seed=0,1", "--sweep", "run.seed=2"),
                        "--sweep run.seed: given twice"),
    "sweep without values": (pretrain("--sweep", "run.seed="), "--sweep run.seed: no values"),
    "sweep bad last point": (pretrain("--sweep", "model.img_size=32,64,30"),
                             "sweep point model.img_size=30: model.img_size=30 is not a multiple of 4"),
    "sweep the device": (pretrain("--sweep", "run.device=cpu,cuda"), "--sweep run.device: cannot be swept"),
    "sweep point out of range": (pretrain("--sweep", "run.seed=0,1", "--sweep-point", "2"),
                                 "--sweep-point 2: the sweep has 2 points"),
    "sweep point without a sweep": (pretrain("--sweep-point", "0"), "--sweep-point runs one point"),
    "sweep with --task": (finetune("--sweep", "run.seed=0,1", "--task", "vtab/dmlab"), "--sweep with --task"),
    "sweep with --lr-sweep": (finetune("--sweep", "run.seed=0,1", "--lr-sweep", "0.1"),
                              "--sweep with --lr-sweep"),
    "sweep a key an option sets": (finetune("--res", "64", "--sweep", "model.img_size=32,64"),
                                   "--sweep model.img_size: an option of this command sets it too"),
    # few-shot
    "shots 0": (fewshot("--shots", "0"), "fewshot.shots must be >= 1"),
    "shots negative": (fewshot("--shots", "-5"), "fewshot.shots must be >= 1"),
    "shots empty": (fewshot("--shots", ""), "fewshot.shots is empty"),
    "seeds 0": (fewshot("--seeds", "0"), "fewshot.seeds must be positive"),
    "unknown task": (fewshot("--tasks", "vtab/cifar10O"), "did you mean 'vtab/cifar100'"),
    "l2 not a number": (fewshot("--l2", "lots"), "fewshot.l2_reg"),
    "ckpt missing": (["eval-fewshot", "--tasks", "synthetic", "--ckpt", "{root}/nope.safetensors"],
                     "not found"),
    "custom task without its test split": (
        ["eval-fewshot", "--tasks", "mine", "--ckpt", "{root}/done", "fewshot.custom.name=mine",
         "fewshot.custom.source=synthetic", "fewshot.custom.test_split=holdout", "data.num_workers=0"],
        "fewshot.custom.test_split='holdout': synthetic: no split 'holdout'"),
    # file system
    "workdir is a file": (pretrain("--workdir", "{root}/afile"), "is a file, not a directory"),
    "workdir below a file": (pretrain("--workdir", "{root}/afile/run"), "is a file"),
    "fewshot workdir is a file": (fewshot("--workdir", "{root}/afile"), "is a file, not a directory"),
    "finished run, --no-resume": (pretrain("--workdir", "{root}/done", "--no-resume"),
                                  "holds a finished run"),
    "finished run, typo after --no-resume": (pretrain("--workdir", "{root}/done", "--no-resume",
                                                      "--overwrite", "data.source=/no/such"), "/no/such"),
    "resize out is a directory": (["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--out",
                                   "{root}/adir.safetensors"], "is a directory"),
    "resize out below a file": (["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--out",
                                 "{root}/afile/x.safetensors"], "is a file"),
    "resize out is its source": (["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--out",
                                  "{root}/done/model.safetensors"], "is the checkpoint it reads"),
    "resize out exists": (["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--out",
                           "{root}/there.safetensors"], "exists; name a new file, or pass --overwrite"),
    "resize method": (["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--method", "nearest"],
                      "--method"),
    "resize grid": (["resize-posemb", "--ckpt", "{root}/done", "--grid", "3x", "--out",
                     "{root}/g.safetensors"], "--grid"),
    "resize res vs patch": (["resize-posemb", "--ckpt", "{root}/done", "--res", "30"], "--res=30"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_and_touches_nothing(case, root, monkeypatch, capsys):
    args, fragment = CASES[case]
    args = [a.format(root=root) for a in args]
    if "--workdir" not in args and args[0] in ("pretrain", "finetune", "eval-fewshot"):
        args = [args[0], "--workdir", str(root / "new"), *args[1:]]
    err = refused(monkeypatch, capsys, root, *args)
    assert fragment in err, err


# Refused only by the run: these need the data read (dry runs read none) or a workdir (dry runs name
# none)
RUN_ONLY = {"fewer classes than labels", "missing data", "no such column", "workdir is a file",
            "workdir below a file", "fewshot workdir is a file", "finished run, --no-resume",
            "finished run, typo after --no-resume", "custom task without its test split",
            "teacher of other classes"}  # the student's classes are the data's
BOTH_WAYS = [c for c, (args, _) in CASES.items()
             if args[0] in ("pretrain", "finetune", "eval-fewshot") and c not in RUN_ONLY]


@pytest.mark.parametrize("case", BOTH_WAYS)
def test_the_dry_run_refuses_what_the_run_refuses_with_the_same_line(case, root, tmp_path, monkeypatch,
                                                                       capsys):
    """What `--dry-run` accepts, the run accepts: each bad input is refused both ways, exit 2, the
    same line, and the run's workdir holds nothing after."""
    command, *rest = [a.format(root=root) for a in CASES[case][0]]
    monkeypatch.chdir(tmp_path)
    dry = run_vit(monkeypatch, capsys, command, "--dry-run", *rest)
    workdir = tmp_path / "w"
    run = run_vit(monkeypatch, capsys, command, "--workdir", workdir, *rest)
    assert dry[0] == run[0] == 2 and dry[2] == run[2], (dry, run)
    assert CASES[case][1] in run[2] and not dry[1], run
    assert not workdir.exists() or not any(workdir.iterdir()), "a refused run wrote into its workdir"
    assert sorted(tmp_path.iterdir()) == ([workdir] if workdir.exists() else [])


def test_a_batch_larger_than_a_loaded_split_is_refused_before_the_workdir_is_written(tmp_path, monkeypatch,
                                                                                     capsys):
    """Files on disk: the split is counted when loaded, still before recipe.yaml is written."""
    data = tmp_path / "eight"
    images = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(8)]
    datasets.Dataset.from_dict({"image": images, "label": list(range(8))}).save_to_disk(str(data))
    args = [a for a in pretrain(f"data.source={data}", "data.val_split=", "data.test_split=")]
    code, _, err = run_vit(monkeypatch, capsys, *args, "--workdir", tmp_path / "w")
    assert code == 2 and "data.batch_size=32 is larger than the train split (8 images" in err, err
    assert not (tmp_path / "w").exists()


def test_a_bare_vit_shows_the_help_and_exits_2(monkeypatch, capsys):
    code, out, err = run_vit(monkeypatch, capsys)
    assert code == 2 and "pretrain" in out and err.strip() == ""


def test_shots_larger_than_every_class_take_what_there_is_and_say_so(tmp_path, root, monkeypatch, capsys):
    """Not bad input: as big_vision, each class gives what it has; every row and the table say how
    short."""
    args = [a.format(root=root) for a in fewshot("--shots", "1000", "--workdir", str(tmp_path / "w"))]
    code, out, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    runs = json.loads((tmp_path / "w" / "results.json").read_text())["runs"]
    assert runs and all(r["short_classes"] == r["classes"] == 10 and r["examples"] == 40 for r in runs)
    assert "* synthetic 1000-shot: 10 of 10 classes" in out and "examples, not 10000" in out


def test_an_unwritable_location_is_named(tmp_path, monkeypatch):
    """Tests run as root, where every directory is writable; the decision itself is os.access's."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(OutputError, match=f"{tmp_path} is not writable by this user"):
        check_writable(tmp_path / "run", "workdir")
