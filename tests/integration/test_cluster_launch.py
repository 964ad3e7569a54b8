"""cluster/launch.py, the SLURM job's torchrun: torchrun itself exits 1 whatever a rank exited
with; the launch exits with the cause, so the requeue rule tells a hang (errors.HUNG_EXIT_CODE) or a
rank killed by SIGKILL (an OOM kill) from a bug. Two real processes under torchrun (no process
group), rank 1 failing."""

import os
import subprocess
import sys

from vitcli.cluster.requeue import EXITS_ENV, cause, node_exits
from vitcli.errors import HUNG_EXIT_CODE

RANK = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    {}
time.sleep(1)  # rank 0 outlives it: torchrun then stops it with SIGTERM
"""


def run(tmp_path, module: str, failing: str) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK.format(failing))
    return subprocess.run([sys.executable, "-m", module, "--standalone", "--nproc-per-node=2", str(script)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_launch_exits_with_what_the_failed_rank_did_where_torchrun_says_1(tmp_path, monkeypatch):
    hang = f"sys.exit({HUNG_EXIT_CODE})"
    assert run(tmp_path, "torch.distributed.run", hang).returncode == 1
    for failing, code in ((hang, HUNG_EXIT_CODE), ("os.kill(os.getpid(), signal.SIGKILL)", 137)):
        exits = tmp_path / f"exits-{code}"
        monkeypatch.setenv(EXITS_ENV, str(exits))
        monkeypatch.setenv("SLURM_NODEID", "3")
        done = run(tmp_path, "vitcli.cluster.launch", failing)
        assert done.returncode == code and f"the launch exits {code}" in done.stderr, done.stderr[-2000:]
        assert node_exits(exits) == [code] and (exits / "node3").is_file()  # what requeue.end reads


def test_the_cause_is_a_hang_or_a_kill_before_the_failures_that_follow_them():
    assert cause([1, -15]) == 1  # a bug; torchrun then stopped the other rank
    assert cause([-15, HUNG_EXIT_CODE]) == HUNG_EXIT_CODE  # the stopped rank reported first
    assert cause([-9, -15]) == 137 and cause([143, -9]) == 137
    # a rank whose peer was SIGKILLed fails in its collective with an error of its own
    assert cause([1, -9]) == 137 and cause([2, HUNG_EXIT_CODE]) == HUNG_EXIT_CODE
    assert cause([-11]) == 139 and cause([143, 143]) == 143 and cause([]) == 1
