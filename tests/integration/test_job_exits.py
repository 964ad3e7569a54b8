"""How a torchrun job ends, each way it can end: every rank leaves its process group (left to the
exit, NCCL prints "destroy_process_group() was not called" and may hang, Gloo now and then aborts)
and exits with the command's code, and an error that every rank meets is told once, by rank 0. Two
Gloo processes on a one-block model; exit_ranks.py reports how each rank left."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vitcli
from helpers import REPO

HERE = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TINY = ["pretrain", "-r", str(REPO / "recipes/quickstart/pretrain.yaml"), "schedule.epochs=0",
        "schedule.warmup_steps=1", "run.log_every=1", "data.synthetic.train_size=64",
        "data.val_split=", "data.test_split=", "data.batch_size=16", "data.num_workers=0",
        "model.depth=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64"]
# torch's words (NCCL) for a group left to the exit
UNDESTROYED = "destroy_process_group() was not called"
# a traceback frame in either is our process's
OURS = (str(Path(vitcli.__file__).parent), "exit_ranks.py")


def torchrun(out: Path, *overrides: str) -> subprocess.Popen:
    """`vit pretrain` under torchrun on 2 processes, in a session of its own (a signal can go to
    torchrun alone); each rank's report lands in OUT, the run in OUT/run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "exit_ranks.py"), str(out), *TINY, "--workdir", str(out / "run"), *overrides]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)


def exits(out: Path) -> list[dict]:
    """How rank 0 and rank 1 left: {"code": exit code, "left_group": whether its group was gone}."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_run_that_finishes_leaves_its_group_on_every_rank(tmp_path):
    proc = torchrun(tmp_path, "schedule.steps=2")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert exits(tmp_path) == [{"code": 0, "left_group": True}] * 2
    assert UNDESTROYED not in err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["sigint", "sigterm"])
def test_a_signalled_run_leaves_its_group_on_every_rank(tmp_path, sig, code):
    """The signal goes to torchrun, which sends it on to every rank (as for a scheduler's SIGTERM):
    both ranks stop at the same step with a checkpoint, rank 0 says so once, both exit 128 + it."""
    proc = torchrun(tmp_path, "schedule.steps=100000", "run.ckpt_every=100000")
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert exits(tmp_path) == [{"code": code, "left_group": True}] * 2, err[-3000:]
    assert err.count("run the same command again to resume") == 1 and "error:" not in err, err[-3000:]
    assert UNDESTROYED not in err


def test_an_error_every_rank_meets_is_told_once_by_rank_0(tmp_path):
    """A loss gone non-finite (optim.lr=1e30) stops both ranks at the same step with the same
    TrainingError: rank 0 prints the one red line, rank 1 nothing, and both leave their group and
    exit 2, with no traceback of ours. torchrun then prints its own traceback and failure summary
    and exits 1 whatever its workers' codes (nothing a worker can change); its summary shows each
    failed rank's line in place of its "To enable traceback" hint."""
    proc = torchrun(tmp_path, "schedule.steps=20", "optim.lr=1e30")
    _, err = proc.communicate(timeout=300)
    said = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and "loss became nan" in said[0], err[-3000:]
    assert exits(tmp_path) == [{"code": 2, "left_group": True}] * 2
    frames = [line for line in err.splitlines() if line.lstrip().startswith('File "')]
    assert frames and not [line for line in frames if any(path in line for path in OURS)], frames
    assert proc.returncode == 1
    summary = err.split("ChildFailedError", 1)[1]
    assert re.search(r"exitcode\s*:\s*2", summary) and "loss became nan" in summary
    assert UNDESTROYED not in err
