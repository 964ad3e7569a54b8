"""cluster/launch.py, the SLURM job's torchrun: torchrun itself exits 1 whatever a rank exited
with; the launch exits with the cause, so the requeue rule tells a hang (errors.HUNG_EXIT_CODE) or a
rank killed by SIGKILL (an OOM kill) from a bug. Two real processes under torchrun (no process
group), rank 1 failing."""

import os
import subprocess
import sys

from vitcli.cluster.launch import exit_code
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


def test_the_launch_exits_with_what_the_failed_rank_did_where_torchrun_says_1(tmp_path):
    hang = f"sys.exit({HUNG_EXIT_CODE})"
    assert run(tmp_path, "torch.distributed.run", hang).returncode == 1
    for failing, code in ((hang, HUNG_EXIT_CODE), ("os.kill(os.getpid(), signal.SIGKILL)", 137)):
        done = run(tmp_path, "vitcli.cluster.launch", failing)
        assert done.returncode == code and f"the launch exits {code}" in done.stderr, done.stderr[-2000:]


def test_the_cause_is_the_ranks_own_failure_before_the_deaths_that_follow_it():
    assert exit_code([1, -15]) == 1  # a bug; torchrun then stopped the other rank
    assert exit_code([-15, HUNG_EXIT_CODE]) == HUNG_EXIT_CODE  # the stopped rank reported first
    assert exit_code([-9, -15]) == 137 and exit_code([143, -9]) == 137
    assert exit_code([HUNG_EXIT_CODE, -9]) == HUNG_EXIT_CODE
    assert exit_code([2, HUNG_EXIT_CODE]) == 2  # a rank's own error outranks a hang
    assert exit_code([-11]) == 139 and exit_code([]) == 1
