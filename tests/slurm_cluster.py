"""A real one-node SLURM cluster on this machine, for tests: munge, slurmctld and slurmd (Debian's
slurm-wlm, installed by `make test` through scripts/system_deps.sh) with their configuration, state,
logs and munge's socket in one temporary directory, on free ports; its client commands (sbatch,
squeue, scontrol, scancel) reach it through SLURM_CONF. Where it cannot start (no slurm-wlm, not
root), `start` says why, for a skip."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel")


@dataclass
class Cluster:
    """The running cluster: `env` reaches it (SLURM_CONF), `root` holds its files."""

    root: Path
    env: dict

    def run(self, *args: str, check: bool = True) -> str:
        """A SLURM client command against this cluster; its stdout."""
        done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60,
                              check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as {Key: value} (JobState, Restarts, ExitCode, ...); {} once it is
        gone."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 240) -> dict:
        """Poll until the job is in one of `states`; its fields then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not {states} within {timeout} s: {self.job(job_id)}")

    def stop(self) -> None:
        """Every job cancelled (and gone: slurmd stopped under a job leaves its slurmstepd behind),
        every daemon stopped."""
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + 40
        while self.run("squeue", "-h", "-t", "RUNNING,COMPLETING", check=False).strip():
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.root / f"{name}.pid"
            if pid.is_file():
                try:
                    os.kill(int(pid.read_text().strip()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf(root: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=vitcli-test", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={root}/munge.sock", "CredType=cred/munge", f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool", f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd.pid", f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd.log",
        # no cgroups in a container: processes tracked by their parentage, tasks not bound
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2", "MpiDefault=none",
        "KillWait=30", "MinJobAge=600",
        # preemption as a cluster does it: a job of the `urgent` partition that needs the node's
        # CPUs preempts a `debug` one, which SLURM requeues (SIGTERM, then SIGKILL after KillWait),
        # or a `cancelable` one, which SLURM cancels
        "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
        f"PartitionName=cancelable Nodes={host} MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL",
        f"PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF", ""])


def start(root: Path) -> Cluster | str:
    """Start the cluster under `root`; the Cluster, or the reason it cannot start here."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing: scripts/system_deps.sh installs it)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user, and these tests do not run as root"
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (root / "slurm.conf").write_text(_conf(root, host))
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf"), "PATH": f"/usr/sbin:{os.environ['PATH']}"}
    cluster = Cluster(root, env)
    commands = [["munged", f"--key-file={key}", f"--socket={root}/munge.sock",
                 f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                 f"--seed-file={root}/munge.seed", "--force"],
                ["slurmctld", "-i"], ["slurmd"]]
    for command in commands:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode != 0:
            cluster.stop()
            return f"{command[0]} did not start: {(done.stderr or done.stdout).strip()[-300:]}"
    return _ready(cluster)


def _ready(cluster: Cluster) -> Cluster | str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "idle" in cluster.run("sinfo", "-h", "-o", "%t", check=False):
            return cluster
        time.sleep(0.3)
    logs = (cluster.root / "slurmd.log").read_text()[-300:] if (cluster.root / "slurmd.log").exists() else ""
    cluster.stop()
    return f"the node did not come up idle within 30 s: {logs}"
