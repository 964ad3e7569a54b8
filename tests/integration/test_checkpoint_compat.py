"""A checkpoint written by an earlier commit of this repository resumes on HEAD with bit-identical
losses (torchtitan's scripts/checkpoint_compat_test.py, the idea): the earlier vitcli is built from
git history in the test, not kept as a binary in the tree. And a checkpoint in a format this vitcli
cannot read is refused by name, never passed over for an older one.

What is compared: the earlier commit trains STEPS steps uninterrupted and checkpoints halfway; HEAD
resumes that halfway checkpoint in a workdir of its own and trains the rest. Every logged loss after
the checkpoint, and the final weights, must be equal, bit for bit. The training maths of the two
commits must then agree: a commit that changes them on purpose moves OLD to itself, and says so.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO
from vitcli.checkpoints import state
from vitcli.checkpoints.weights import load_weights
from vitcli.runtime.run_files import MODEL_FILE

# The commit that landed issue 45 (DINO; 2026-11-29): the last before checkpoints carried a format
# number, so its checkpoints are format 0.
OLD = "b9b9279af80833288b4998526a3836d2a53e1d5c"
STEPS, HALF = 8, 4
TINY = ["schedule.epochs=0", f"schedule.steps={STEPS}", "schedule.warmup_steps=2", "run.log_every=1",
        f"run.ckpt_every={HALF}", "run.keep_checkpoints=4", "data.synthetic.train_size=64",
        "data.val_split=", "data.test_split=", "data.batch_size=8", "model.depth=1", "model.embed_dim=32",
        "model.num_heads=2", "model.mlp_dim=64", "run.precision=fp32"]
RECIPES = {"supervised": "recipes/quickstart/pretrain.yaml",
           "dino": "recipes/quickstart/pretrain_dino.yaml"}
EXTRA = {"supervised": ["data.mixup_alpha=0.2", "model.dropout=0.1"],
         "dino": ["dino.local_crops=2", "dino.out_dim=64", "dino.hidden_dim=64", "dino.bottleneck_dim=32",
                  "dino.koleo_group=4"]}


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    """The earlier commit's sources, from this repository's history."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{OLD}^{{commit}}"],
                           capture_output=True, check=False)
    if found.returncode:
        pytest.skip(f"commit {OLD[:9]} is not in this clone (a shallow clone): git fetch --unshallow")
    root = tmp_path_factory.mktemp("old")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD, "src", "recipes"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def vit(src: Path, recipe: Path, workdir: Path, *extra: str) -> subprocess.CompletedProcess:
    """`vit pretrain` of the sources under `src` (their own package, not the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "VITCLI_FAULTS": ""}
    return subprocess.run([sys.executable, "-m", "vitcli.cli", "pretrain", "-r", str(recipe),
                           "--workdir", str(workdir), *extra], capture_output=True, text=True,
                          env=env, timeout=600, check=False)


def losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


@pytest.mark.parametrize("objective", ["supervised", "dino"])
def test_a_checkpoint_of_an_earlier_commit_resumes_on_head_bit_identically(old_tree, tmp_path, objective):
    args = TINY + EXTRA[objective]
    old = vit(old_tree / "src", old_tree / RECIPES[objective], tmp_path / "old", *args)
    assert old.returncode == 0, old.stderr[-3000:]
    halfway = state.checkpoint_path(tmp_path / "old", HALF)
    assert "format" not in torch.load(halfway, weights_only=True)  # really the earlier layout

    resumed = tmp_path / "head"
    resumed.mkdir()
    for path in (halfway, halfway.with_name(halfway.name + ".sha256")):
        shutil.copy2(path, resumed / path.name)
    head = vit(REPO / "src", REPO / RECIPES[objective], resumed, *args)
    assert head.returncode == 0, head.stderr[-3000:]
    said = "".join(head.stderr.split())  # the console wraps long paths anywhere
    assert f"{halfway.name}atstep{HALF}" in said and "resumingfrom" in said, head.stderr[-2000:]

    before, after = losses(tmp_path / "old"), losses(resumed)
    assert sorted(after) == list(range(HALF + 1, STEPS + 1))
    assert {s: before[s] for s in after} == after
    theirs, ours = load_weights(tmp_path / "old" / MODEL_FILE)[0], load_weights(resumed / MODEL_FILE)[0]
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # HEAD's own checkpoints carry their format
    assert torch.load(state.checkpoint_path(resumed, STEPS), weights_only=True)["format"] == state.FORMAT


def test_a_checkpoint_in_a_newer_format_is_refused_not_passed_over(tmp_path):
    args = TINY + EXTRA["supervised"]
    recipe = REPO / RECIPES["supervised"]
    first = vit(REPO / "src", recipe, tmp_path, *args, f"schedule.steps={HALF}")
    assert first.returncode == 0, first.stderr[-3000:]
    # a later vitcli's checkpoint: a format number this one does not know, sealed by its checksum
    newest = state.checkpoint_path(tmp_path, HALF)
    saved = torch.load(newest, weights_only=True)
    state.save_state(newest, {**saved, "format": state.FORMAT + 1})
    shutil.copy2(newest, state.checkpoint_path(tmp_path, 2))  # an older one it could fall back to
    state.save_state(state.checkpoint_path(tmp_path, 2), {**saved, "step": 2})
    again = vit(REPO / "src", recipe, tmp_path, *args, f"schedule.steps={STEPS}")
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    assert f"checkpoint format {state.FORMAT + 1}, written by a newer vitcli: upgrade vitcli" in line, line
    assert newest.name in line and "resuming" not in again.stderr
    assert sorted(p.name for p in state.checkpoints(tmp_path)) == sorted([newest.name, "state-2.pt"])
