"""Several processes: one run through torchrun (Gloo on CPU), one set of files, and only rank 0 writes or talks."""

import os
import subprocess
import sys
from pathlib import Path

from vitcli.checkpoints import files
from vitcli.dist import setup
from vitcli.metrics import console, read_metrics, stdout
from vitcli.models import build_model, model_spec
from vitcli.recipe import ModelConfig
from vitcli.resolve import resolve
from vitcli.stages import sweep as sweep_mod
from vitcli.stages import vtab as vtab_mod
from vitcli.stages.fewshot import eval_fewshot

REPO = Path(__file__).resolve().parents[1]


def test_torchrun_two_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "vitcli.cli",
           "pretrain", "--recipe", str(REPO / "recipes/quickstart/pretrain.yaml"), "--workdir", str(tmp_path),
           "schedule.epochs=0", "schedule.steps=6", "schedule.warmup_steps=1", "run.log_every=1",
           "data.synthetic.train_size=256", "data.synthetic.val_size=64", "data.synthetic.test_size=64",
           "data.batch_size=32", "data.micro_batch_size=8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 7)), "rank 0 logs each step once"
    final = [r for r in rows if "test/top1" in r]
    assert len(final) == 1 and 0 <= final[0]["test/top1"] <= 1
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "state-6.pt").is_file()


def test_a_rank_other_than_0_computes_but_writes_and_prints_nothing(tmp_path, monkeypatch, capsys):
    """As torchrun starts rank 1: eval-fewshot (reports, feature cache), the lr sweep and the VTAB driver
    produce their results in memory, and leave no file and no console line; rank 0 does both."""
    monkeypatch.setenv("RANK", "1")  # world size 1, so there is no group to join, but this is not rank 0
    monkeypatch.setattr(console, "quiet", False)  # restored after the test: dist.setup flips it
    monkeypatch.setattr(stdout, "quiet", False)
    init = tmp_path / "pre"
    cfg = ModelConfig(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, mlp_dim=64)
    files.save_weights(init / files.MODEL_FILE, build_model(cfg, 4).state_dict(), {"model": model_spec(cfg, 4)})
    before = sorted(tmp_path.rglob("*"))

    r = resolve("eval-fewshot", None, ["fewshot.tasks=synthetic", "fewshot.shots=1", "fewshot.seeds=1",
                                       f"init.checkpoint={init}", "data.synthetic.train_size=40",
                                       "data.synthetic.test_size=40", "data.num_workers=0"])
    assert len(eval_fewshot(r, tmp_path / "fewshot")) == 1

    monkeypatch.setattr(sweep_mod, "run_training", lambda recipe, *a, **k: {"val/top1": recipe.optim.lr})
    monkeypatch.setattr(vtab_mod, "run_training", lambda recipe, *a, **k: {"test/top1": 0.5})
    ft = resolve("finetune", None, ["schedule.steps=10", "schedule.warmup_steps=1", "data.val_split=validation"])
    dist = setup("cpu")
    assert sweep_mod.sweep(ft, tmp_path / "sweep", [0.1, 0.2], dist)["best_lr"] == 0.2
    assert list(vtab_mod.run_vtab(ft, tmp_path / "vtab", vtab_mod.vtab_tasks("vtab/dmlab"), dist)) == ["vtab/dmlab"]

    assert sorted(tmp_path.rglob("*")) == before
    out = capsys.readouterr()
    assert (out.out, out.err) == ("", "")
