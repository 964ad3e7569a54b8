"""Starting weights that are not what their name or folder says, through every command that reads
one: exit 2, one line naming the file and what would help, nothing written. A torch.save file named
.safetensors (torch itself then reads it as safetensors: "header too large", naming no file), an
empty or cut-short one (a .pt or .npz cut short too: not "a pickle"), a transformers folder of
another model, without config.json or without weights, a config.json value of the wrong type,
and an init.grid (or --old-grid) that contradicts the grid the checkpoint's metadata states,
which only a file without one may be told."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import REPO, refused, run_vit
from vitcli.checkpoints.read import read_checkpoint
from vitcli.checkpoints.weights import load_weights, save_weights
from vitcli.models.zoo import build_model, model_spec
from vitcli.recipe.layers import to_dict
from vitcli.recipe.schema import ModelConfig, Recipe
from vitcli.runtime.run_files import MODEL_FILE

SMALL = ["data.synthetic.train_size=64", "data.synthetic.val_size=32",
         "data.synthetic.test_size=32", "data.batch_size=32", "data.num_workers=0",
         "schedule.epochs=0", "schedule.steps=2", "schedule.warmup_steps=1"]
FINETUNE = str(REPO / "recipes/quickstart/finetune.yaml")
RENAMED = "is not a safetensors file (it starts like a PyTorch pickle/zip: rename it .pt or .pth"
HF_CLS = "vit.embeddings.cls_token"  # transformers' name of the class token


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A finished workdir whose metadata says img_size 32 at patch 4 (an 8x8 grid), its weights as a
    torch.save file (zip and legacy) under a .safetensors name, empty and cut short, and folders
    that are not the transformers ViT folders they look like."""
    root = tmp_path_factory.mktemp("ckpts")
    cfg = ModelConfig(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    sd = build_model(cfg, 10).state_dict()
    meta = {"recipe": to_dict(Recipe(model=cfg)), "model": model_spec(cfg, 10)}
    save_weights(root / "done" / MODEL_FILE, sd, meta)
    torch.save(sd, root / "torch.safetensors")
    torch.save(sd, root / "legacy.safetensors", _use_new_zipfile_serialization=False)
    (root / "empty.safetensors").write_bytes(b"")
    whole = (root / "done" / MODEL_FILE).read_bytes()
    (root / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    (root / "stub.safetensors").write_bytes(whole[:5])
    torch.save(sd, root / "whole.pt")
    (root / "cut.pt").write_bytes((root / "whole.pt").read_bytes()[:1000])
    (root / "cut.npz").write_bytes((root / "whole.pt").read_bytes()[:1000])  # a zip, as .npz are
    timm_file = str(root / "timm.safetensors")  # the same tensors, no metadata
    save_file({k: v.contiguous() for k, v in sd.items()}, timm_file)
    (root / "unfinished").mkdir()  # a run stopped at step 6: no model.safetensors yet
    for name in ("recipe.yaml", "metrics.jsonl", "state-6.pt", "state-6.pt.sha256"):
        (root / "unfinished" / name).write_text("")
    _folder(root / "swin", {"model_type": "swin"}, {"embeddings.norm.weight": torch.ones(2)})
    _folder(root / "noconfig", None, {HF_CLS: torch.zeros(1, 1, 32)})
    (root / "noconfig" / "README.md").write_text("a model card\n")
    (root / "bin").mkdir()
    torch.save({HF_CLS: torch.zeros(1, 1, 32)}, root / "bin" / "pytorch_model.bin")
    _folder(root / "noweights", {"model_type": "vit"}, None)
    _folder(root / "string", {"model_type": "vit", "num_hidden_layers": "2"}, {"x": torch.zeros(1)})
    return root


def _folder(path: Path, config: dict | None, tensors: dict | None) -> None:
    path.mkdir()
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(path / MODEL_FILE))


def finetune(ckpt, *args):
    return ["finetune", "-r", FINETUNE, *SMALL, "--init", ckpt, *args]


# how each command that reads a checkpoint is given one
COMMANDS = {
    "finetune": finetune,
    "evaluate": lambda ckpt: ["evaluate", "--ckpt", ckpt, "data.source=synthetic",
                              "data.num_workers=0"],
    "predict": lambda ckpt: ["predict", "--ckpt", ckpt, "{root}/empty.safetensors"],
    "export": lambda ckpt: ["export", "--ckpt", ckpt, "--format", "timm", "--out",
                            "{root}/exported"],
    "eval-fewshot": lambda ckpt: ["eval-fewshot", "--ckpt", ckpt, "--tasks", "synthetic"],
    "resize-posemb": lambda ckpt: ["resize-posemb", "--ckpt", ckpt, "--res", "64"],
}
CASES = {
    **{f"torch.save zip named .safetensors, {cmd}": (
        args("{root}/torch.safetensors"), f"{{root}}/torch.safetensors {RENAMED}")
       for cmd, args in COMMANDS.items()},
    "torch.save legacy file named .safetensors": (
        finetune("{root}/legacy.safetensors"), f"{{root}}/legacy.safetensors {RENAMED}"),
    "empty .safetensors": (
        COMMANDS["evaluate"]("{root}/empty.safetensors"),
        "{root}/empty.safetensors is empty (0 bytes), not a safetensors file"),
    "cut-short .safetensors": (
        finetune("{root}/cut.safetensors"), "{root}/cut.safetensors is cut short: "),
    "cut-short torch.save .pt": (
        finetune("{root}/cut.pt"),
        ("{root}/cut.pt begins as a zip archive (torch.save and .npz files are) but its end is "
         "missing or damaged: cut short at 1000 bytes")),
    "cut-short .npz": (
        COMMANDS["evaluate"]("{root}/cut.npz"), "{root}/cut.npz begins as a zip archive"),
    "5-byte .safetensors": (
        COMMANDS["predict"]("{root}/stub.safetensors"),
        "{root}/stub.safetensors is cut short: 5 bytes (an interrupted copy"),
    **{f"an unfinished run's workdir, {cmd}": (
        COMMANDS[cmd]("{root}/unfinished"),
        ("{root}/unfinished holds an unfinished run (its newest checkpoint is of step 6; "
         "model.safetensors is written at its end): run the command that started it again"))
       for cmd in ("finetune", "evaluate", "export")},
    "transformers folder of a Swin": (
        COMMANDS["evaluate"]("{root}/swin"),
        ("{root}/swin/config.json says model_type 'swin': vit reads transformers folders of "
         "model_type 'vit'")),
    "its weights file, passed alone": (
        finetune("{root}/swin/model.safetensors"), "says model_type 'swin'"),
    "transformers weights without config.json": (
        COMMANDS["evaluate"]("{root}/noconfig"),
        (f"{{root}}/noconfig/model.safetensors holds transformers' ViT tensors ({HF_CLS}) but no "
         "config.json")),
    "a pytorch_model.bin without config.json": (
        COMMANDS["eval-fewshot"]("{root}/bin"),
        "{root}/bin has no model.safetensors (it holds pytorch_model.bin): pass"),
    "a ViT config.json without weights": (
        COMMANDS["export"]("{root}/noweights"),
        ("{root}/noweights is a transformers ViT folder (config.json) without its weights (it "
         "holds config.json)")),
    "config.json value of the wrong type": (
        COMMANDS["evaluate"]("{root}/string"),
        ("{root}/string/config.json: num_hidden_layers holds the string \"2\", but transformers' "
         "ViTConfig declares a positive integer (unquoted)")),
    "init.grid against the metadata": (
        finetune("{root}/done", "init.grid=4x16"),
        ("init.grid=4x16 contradicts {root}/done/model.safetensors, whose metadata "
         "(model.img_size 32, patch 4) gives the grid 8x8; leave init.grid unset to take the "
         "checkpoint's own")),
    "--old-grid against the metadata": (
        ["resize-posemb", "--ckpt", "{root}/done", "--res", "64", "--old-grid", "4x16"],
        "--old-grid=4x16 contradicts {root}/done/model.safetensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_not_what_it_says_is_one_line_exit_2_writing_nothing(case, root, monkeypatch,
                                                                           capsys):
    args, fragment = CASES[case]
    args = [a.format(root=root) for a in args]
    if args[0] in ("finetune", "eval-fewshot"):
        args = [args[0], "--workdir", str(root / "new"), *args[1:]]
    err = refused(monkeypatch, capsys, root, *args)
    assert fragment.format(root=root) in " ".join(err.split()), err


def test_the_renamed_file_reads_under_the_name_the_message_gives(root, tmp_path):
    """The advice helps: the same bytes named .pt are the workdir's weights."""
    want, _ = load_weights(root / "done" / MODEL_FILE)
    for name in ("torch", "legacy"):
        (tmp_path / f"{name}.pt").write_bytes((root / f"{name}.safetensors").read_bytes())
        got = read_checkpoint(str(tmp_path / f"{name}.pt")).state_dict
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_grid_the_metadata_agrees_with_is_accepted(root, tmp_path, monkeypatch, capsys):
    args = finetune(root / "done", "init.grid=8x8", "--dry-run", "--workdir", tmp_path / "w")
    code, _, err = run_vit(monkeypatch, capsys, *args)
    assert code == 0, err
    assert not (tmp_path / "w").exists()


def test_a_file_without_grid_metadata_is_told_its_grid(root, tmp_path, monkeypatch, capsys):
    """The same 64-row table in a timm file (no metadata; a square table reads as 8x8) is resized
    from the 4x16 grid --old-grid (init.grid's flag) says; our own file refuses it (above)."""
    code, out, err = run_vit(monkeypatch, capsys, "resize-posemb", "--ckpt",
                             root / "timm.safetensors", "--old-grid", "4x16", "--grid", "8x8",
                             "--out", tmp_path / "o.safetensors", "--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out)["grid"].startswith("4x16 -> 8x8"), out
