"""One resolve step: what a command runs is exactly what its `--dry-run` prints, for every shipped
recipe and for stages that start from a checkpoint; the command decides the stage; a checkpoint's
heads come from evidence.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import timm
import yaml
from safetensors.torch import save_file
from timm.models.vision_transformer import VisionTransformer

from helpers import REPO, run_vit
from vitcli.checkpoints.complete import complete
from vitcli.checkpoints.transfer import load_init
from vitcli.checkpoints.weights import load_weights, save_weights
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import to_dict, to_yaml
from vitcli.recipe.resolve import resolve
from vitcli.recipe.schema import ModelConfig, Recipe
from vitcli.runtime.dist import setup
from vitcli.runtime.run_files import MODEL_FILE

QUICK = REPO / "recipes/quickstart/pretrain.yaml"
SHIPPED = sorted(p.relative_to(REPO) for p in (REPO / "recipes").rglob("*.yaml"))
DRIVERS = {"pretrain": "vitcli.stages.run.one_run", "finetune": "vitcli.stages.finetune.finetune",
           "eval-fewshot": "vitcli.stages.fewshot.eval_fewshot"}
SMALL_DATA = ["data.synthetic.train_size=64", "data.synthetic.val_size=32", "data.synthetic.test_size=32",
              "data.batch_size=32", "data.num_workers=0", "schedule.epochs=0", "schedule.steps=2",
              "schedule.warmup_steps=1"]
LENGTH = "schedule.steps=1000"  # a finetune command must say how long to train (its warmup is 500 steps)


def stage_of(path: Path) -> str:
    text = (REPO / path).read_text()
    return next((s for s in ("finetune", "pretrain") if f"stage: {s}" in text), "eval-fewshot")


def ours(workdir: Path, num_classes: int = 5) -> Path:
    """A vitcli workdir: custom ViT at 32 px, patch 8, width 32, 2 heads (none of them the
    defaults)."""
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    meta = {"recipe": to_dict(Recipe(model=cfg)), "model": model_spec(cfg, num_classes)}
    save_weights(workdir / MODEL_FILE, build_model(cfg, num_classes).state_dict(), meta)
    return workdir


def timm_file(path: Path, width: int, heads: int, patch: int, img_size: int) -> Path:
    """A plain timm safetensors file, one block: no metadata, so the architecture is read off the
    tensors."""
    model = VisionTransformer(img_size=img_size, patch_size=patch, embed_dim=width, depth=1, num_heads=heads,
                              mlp_ratio=1.0, num_classes=3)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"format": "pt"})
    return path


def dry_run(monkeypatch, capsys, *args) -> dict:
    code, out, err = run_vit(monkeypatch, capsys, *args, "--dry-run")
    assert code == 0, err
    return yaml.safe_load(out)


# ---------------------------------------------------------------- checked before torch is imported

HEAVY = ("torch", "timm", "datasets", "torchvision")


def imported_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `code`."""
    probe = f"import sys\n{code}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in done.stdout.strip().split(",") if m]


def test_the_recipe_package_imports_no_torch():
    assert imported_after("import vitcli.recipe.resolve") == []


def test_a_recipe_is_resolved_and_checked_without_torch():
    """Every key and value of a shipped recipe, overrides included, is checked with torch never
    imported; a misspelt key is reported the same way."""
    resolved = ("from vitcli.recipe.resolve import resolve\n"
                f"resolve('pretrain', {str(QUICK)!r}, ['optim.lr=3e-3'])")
    assert imported_after(resolved) == []
    misspelt = ("from vitcli.errors import RecipeError\nfrom vitcli.recipe.resolve import resolve\n"
                "try:\n    resolve('pretrain', None, ['model.nmae=x'])\nexcept RecipeError:\n    pass")
    assert imported_after(misspelt) == []


# ---------------------------------------------------------------- dry run == what runs


@pytest.mark.parametrize("path", SHIPPED, ids=str)
def test_every_shipped_recipe_hands_its_driver_exactly_what_its_dry_run_prints(path, monkeypatch, capsys,
                                                                               tmp_path):
    stage = stage_of(path)
    # as its header's command: eval-fewshot scores the weights --ckpt names
    ckpt = ["--ckpt", ours(tmp_path / "pre")] if stage == "eval-fewshot" else []
    code, printed, err = run_vit(monkeypatch, capsys, stage, "--recipe", REPO / path, *ckpt, "--dry-run")
    assert code == 0, err
    handed = []
    monkeypatch.setattr(DRIVERS[stage], lambda recipe, *a, **k: handed.append(recipe))
    code, _, err = run_vit(monkeypatch, capsys, stage, "--recipe", REPO / path, *ckpt,
                           "--workdir", tmp_path / "w")
    assert code == 0, err
    assert to_yaml(handed[0]) == printed


def run_and_compare(monkeypatch, capsys, workdir: Path, *args) -> dict:
    """Dry-run a command, run it for real into `workdir`, and require recipe.yaml to equal the dry
    run."""
    code, printed, err = run_vit(monkeypatch, capsys, *args, "--dry-run")
    assert code == 0, err
    code, _, err = run_vit(monkeypatch, capsys, *args, "--workdir", workdir)
    assert code == 0, err
    assert (workdir / "recipe.yaml").read_text() == printed
    return yaml.safe_load(printed)


def test_pretrain_writes_the_recipe_its_dry_run_printed(monkeypatch, capsys, tmp_path):
    run_and_compare(monkeypatch, capsys, tmp_path / "w", "pretrain", "-r",
                    REPO / "recipes/quickstart/pretrain.yaml", *SMALL_DATA)


def test_finetune_from_a_checkpoint_dry_runs_the_checkpoints_network(monkeypatch, capsys, tmp_path):
    """It used to print the default ViT-B/16 sizes, and `--res 40` (fine for patch 8) failed the dry
    run."""
    init = ours(tmp_path / "pre")
    resolved = run_and_compare(monkeypatch, capsys, tmp_path / "w", "finetune", "-r",
                               REPO / "recipes/quickstart/finetune.yaml", "--init", init, "--res", 40,
                               *SMALL_DATA, "run.eval_every=0")
    m = resolved["model"]
    assert (m["img_size"], m["patch_size"], m["embed_dim"], m["depth"], m["num_heads"]) == (40, 8, 32, 1, 2)


def test_eval_fewshot_dry_runs_at_the_checkpoints_native_resolution(monkeypatch, capsys, tmp_path):
    init = ours(tmp_path / "pre")
    resolved = run_and_compare(monkeypatch, capsys, tmp_path / "w", "eval-fewshot", "-r",
                               REPO / "recipes/quickstart/fewshot.yaml", "--ckpt", init, "--shots", 1,
                               "--seeds", 1, "data.synthetic.train_size=60", "data.synthetic.test_size=60")
    assert resolved["stage"] == "eval-fewshot"
    m = resolved["model"]
    assert (m["img_size"], m["patch_size"], m["num_heads"], m["num_classes"]) == (32, 8, 2, 0)  # no head


# ---------------------------------------------------------------- the command decides the stage


@pytest.mark.parametrize("command, path, says", [
    ("pretrain", "recipes/finetune/cifar10.yaml", "finetune"),
    ("finetune", "recipes/quickstart/pretrain.yaml", "pretrain"),
    ("eval-fewshot", "recipes/quickstart/pretrain.yaml", "pretrain"),
])
def test_a_recipe_for_another_stage_is_one_line_naming_both(monkeypatch, capsys, command, path, says):
    code, _, err = run_vit(monkeypatch, capsys, command, "--recipe", REPO / path, "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"says stage: {says}" in err and f"vit {command}" in err


def test_finetune_task_outside_vtab_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--task", "cifar10", "--workdir", tmp_path / "w",
                           *SMALL_DATA)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--task cifar10" in err and "not a VTAB-1k task" in err
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------- heads from evidence, never width
# // 64


def test_a_vit_h_width_timm_file_gets_the_papers_16_heads(monkeypatch, capsys, tmp_path):
    """ViT-H/14 is width 1280 with 16 heads; width // 64 said 20, and strict loading could not
    notice."""
    init = timm_file(tmp_path / "h14.safetensors", width=1280, heads=16, patch=14, img_size=56)
    m = dry_run(monkeypatch, capsys, "finetune", "--init", init, "--res", 56, LENGTH)["model"]
    assert (m["embed_dim"], m["num_heads"], m["patch_size"]) == (1280, 16, 14)


def test_a_width_outside_table_1_without_evidence_asks_for_the_heads(monkeypatch, capsys, tmp_path):
    init = timm_file(tmp_path / "w96.safetensors", width=96, heads=4, patch=8, img_size=32)
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", init, "--res", 32, LENGTH, "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.num_heads" in err and "96" in err
    m = dry_run(monkeypatch, capsys, "finetune", "--init", init, "--res", 32, LENGTH,
                "model.num_heads=4")["model"]
    assert (m["embed_dim"], m["num_heads"]) == (96, 4)


def test_the_load_table_says_where_the_heads_came_from(tmp_path):
    init = timm_file(tmp_path / "t192.safetensors", width=192, heads=3, patch=8, img_size=32)
    r = resolve("finetune", None, [f"init.checkpoint={init}", "model.img_size=32", *SMALL_DATA],
                complete=complete)
    rows = dict(load_init(build_model(r.model, 10), r, 10, setup("cpu")))
    assert "3 heads (paper Table 1 (width 192))" in rows["architecture"], rows


def test_a_named_non_vit_timm_model_finetunes_from_its_own_file(monkeypatch, capsys, tmp_path):
    """No patch embedding to read, but the recipe names the network: its head (`fc`) is swapped for
    zeros."""
    theirs = timm.create_model("test_resnet", num_classes=3)
    init = tmp_path / "resnet.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(init),
              metadata={"format": "pt"})
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", init, "--res", 32,
                           "model.name=test_resnet", "--workdir", tmp_path / "w", *SMALL_DATA)
    assert code == 0, err
    tuned, _ = load_weights(tmp_path / "w" / MODEL_FILE)
    assert tuned["fc.weight"].shape == (10, theirs.num_features)
    words = err.split()  # the table wraps its rows at the console's width
    assert "zero-initialised" in words and "3-class" in words, err
    code, _, err = run_vit(monkeypatch, capsys, "finetune", "--init", init, "--res", 32, LENGTH, "--dry-run")
    assert code == 2 and "cannot infer the architecture" in err and "model.name" in err


@pytest.mark.parametrize("name", ["test_vit", "test_resnet"])
def test_eval_fewshot_reads_a_foreign_file_of_a_named_network(monkeypatch, capsys, tmp_path, name):
    """The file's head (any size, any name) is not needed: few-shot reads the pre-logits."""
    theirs = timm.create_model(name, num_classes=7)
    init = tmp_path / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(init),
              metadata={"format": "pt"})
    code, _, err = run_vit(monkeypatch, capsys, "eval-fewshot", "--ckpt", init, f"model.name={name}",
                           "model.img_size=32", "--tasks", "synthetic", "--shots", 1, "--seeds", 1,
                           "data.synthetic.train_size=40", "data.synthetic.test_size=40",
                           "data.num_workers=0", "--workdir", tmp_path / "w")
    assert code == 0, err
    assert (tmp_path / "w" / "results.json").is_file()
