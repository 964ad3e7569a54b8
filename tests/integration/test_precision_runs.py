"""run.precision=auto in a run: the choice announced and recorded, and a resume on a machine that
chooses differently; inference in fp32 on a CPU unless asked, and said (the choice itself:
unit/test_precision.py)."""

import json

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import machine, run_vit
from vitcli.checkpoints import manager
from vitcli.errors import RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime import precision
from vitcli.stages.run import one_run

TINY = ["model.img_size=32", "model.patch_size=8", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
        "model.mlp_dim=64", "data.synthetic.num_classes=4", "data.synthetic.train_size=64",
        "data.synthetic.img_size=32", "data.batch_size=16", "data.num_workers=0", "schedule.warmup_steps=1",
        "data.val_split=", "data.test_split=", "run.ckpt_every=1"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("native,expected", [(True, "bf16"), (False, "fp32")])
def test_a_run_announces_and_records_its_choice(tmp_path, monkeypatch, capsys, native, expected):
    monkeypatch.setattr(precision, "detect_bf16", machine(native))
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=2"]), tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["run/precision"] == expected
    assert yaml.safe_load((tmp_path / "recipe.yaml").read_text())["run"]["precision"] == expected
    assert manager.latest_good_state(tmp_path)[1]["recipe"]["run"]["precision"] == expected
    assert f"{expected} (auto: CPU has" in capsys.readouterr().err.replace("\n", " ")


def test_resuming_auto_on_a_machine_that_chooses_differently_warns_and_continues(
        tmp_path, monkeypatch, logged):
    monkeypatch.setattr(precision, "detect_bf16", machine(True))
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=3"]), tmp_path)  # trained at bf16 to step 3
    monkeypatch.setattr(precision, "detect_bf16", machine(False))
    logged.clear()  # the message as given: rich would shorten a long tmp_path on the terminal
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=3"]), tmp_path, resume=True)
    assert any("trained at bf16" in m for m in logged), logged
    # an explicit precision other than the checkpoint's is a change to what is trained: refused
    with pytest.raises(RecipeError, match="run.precision"):
        one_run(resolve("pretrain", None, TINY + ["schedule.steps=3", "run.precision=fp32"]), tmp_path)


def test_predict_on_a_cpu_computes_in_fp32_unless_asked_and_says_which(tmp_path, monkeypatch, capsys):
    """A checkpoint trained where auto chose bf16 (an AMX or AVX-512 bf16 CPU) is still read in fp32
    by `vit predict` on a CPU; run.precision=bf16 asks for bf16, and gets it."""
    monkeypatch.setattr(precision, "detect_bf16", machine(True))
    one_run(resolve("pretrain", None, TINY + ["schedule.steps=2"]), tmp_path / "run")
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    capsys.readouterr()
    probabilities, said = {}, {}
    for asked in ((), ("--set", "run.precision=fp32"), ("--set", "run.precision=bf16")):
        code, out, err = run_vit(monkeypatch, capsys, "predict", tmp_path / "0.png", tmp_path / "1.png",
                                 tmp_path / "2.png", "--ckpt", tmp_path / "run", "--json", *asked)
        assert code == 0, err
        probabilities[asked[1:]] = [g["probability"] for r in json.loads(out) for g in r["top"]]
        said[asked[1:]] = err.replace("\n", " ")
    assert "inference in fp32 (run.precision=auto on cpu)" in said[()]
    assert "inference in bf16 (run.precision=bf16)" in said[("run.precision=bf16",)]
    assert probabilities[()] == probabilities[("run.precision=fp32",)]
    assert probabilities[()] != probabilities[("run.precision=bf16",)]  # bf16 rounds what fp32 keeps
