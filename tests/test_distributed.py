"""Two processes through torchrun (Gloo on CPU): one run, one set of files, written by rank 0."""

import os
import subprocess
import sys
from pathlib import Path

from vitcli.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]


def test_torchrun_two_processes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "vitcli.cli",
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
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "state.pt").is_file()
