"""`make soak`: one training run, on Gloo ranks under torchrun, meets injected faults of every kind vit
claims to survive, and must end with the weights of a run that met none: bit for bit, with the NaN's
rollback given to that run as the skip it recorded (data.skip_steps). One JSON report: each fault,
what brought the run back, the steps it trained again and the seconds it cost.

The faults, and who meets them (docs/faults.md):
- in the ranks, through VITCLI_FAULTS (vitcli.runtime.faults): a rank SIGKILLed (an OOM, a lost
  process), a rank hung in the step's collective (the watchdog's exit 75), a crash, a SIGKILL in the
  middle of a checkpoint write, a full disk at a checkpoint, a damaged newest checkpoint (met at the
  next restart), a NaN loss (rolled back in the process), the object store failing between a
  checkpoint's data and its checksum object; torchrun's --max-restarts brings the ranks back;
- by this driver, as a cluster does: a preemption's SIGTERM (the ranks checkpoint and exit 143, and
  the driver launches the same command again, as a requeue), the object store stopped and started
  again, and a node lost with its local disk (every process SIGKILLed, the workdir's checkpoints
  deleted: the same command resumes from the bucket, run.ckpt_dir).

The S3 store is moto's server in this process (the tests' own, tests/integration/test_object_store.py).

    python bench/soak.py --out bench/soak.json            # the full soak (make soak)
    python bench/soak.py --quick --out /tmp/soak.json     # the size tests/integration/test_soak.py runs
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes/quickstart/pretrain.yaml"
BUCKET = "soak"
# the ranks' environment: offline, a core's thread each
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "PYTHONPATH": str(REPO / "src"), "AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak",
       "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class Fault:
    """One fault of the plan: `kind` at `step` on `rank`; `by`: "rank" (VITCLI_FAULTS) or "driver"."""

    kind: str
    step: int
    rank: int = 0
    by: str = "rank"

    @property
    def entry(self) -> str:
        return f"{self.kind}@{self.step}:rank={self.rank}"


@dataclass(frozen=True)
class Size:
    """How long the run is and what it trains."""

    steps: int
    ckpt_every: int
    args: tuple[str, ...]
    faults: tuple[Fault, ...]
    ranks: int = 2


TINY = ("model.depth=1", "model.embed_dim=32", "model.num_heads=2", "model.mlp_dim=64",
        "data.synthetic.train_size=256", "data.batch_size=16", "data.micro_batch_size=8")
QUICK = Size(steps=48, ckpt_every=4, args=TINY, faults=(
    Fault("kill", 6, 1), Fault("hang", 11, 1), Fault("nan", 14), Fault("enospc", 16),
    Fault("corrupt", 20), Fault("crash", 22), Fault("store", 24), Fault("sigterm", 27, by="driver"),
    Fault("kill_write", 32), Fault("store_restart", 34, by="driver"), Fault("node_lost", 38, by="driver")))
FULL = Size(steps=400, ckpt_every=20, args=("model.depth=2", "model.embed_dim=64", "model.num_heads=4",
                                             "model.mlp_dim=128", "data.synthetic.train_size=2048",
                                             "data.batch_size=32", "data.micro_batch_size=16"), faults=(
    Fault("kill", 37, 1), Fault("hang", 71, 0), Fault("nan", 95), Fault("enospc", 120),
    Fault("corrupt", 140), Fault("crash", 151, 1), Fault("store", 180), Fault("sigterm", 203, by="driver"),
    Fault("kill_write", 240), Fault("store_restart", 262, by="driver"), Fault("spike", 290),
    Fault("kill", 318, 0), Fault("node_lost", 350, by="driver")))


# the driver's faults after which the same command is launched again (a requeue)
ENDS_LAUNCH = ("sigterm", "node_lost")


def command(size: Size, workdir: Path, uri: str, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """torchrun on one node, restarting every rank from the last checkpoint when one fails."""
    keys = ["schedule.epochs=0", f"schedule.steps={size.steps}", "schedule.warmup_steps=2",
            "run.log_every=1", f"run.ckpt_every={size.ckpt_every}", "run.keep_checkpoints=3",
            "run.ckpt_every_minutes=0", "data.val_split=", "data.test_split=", "data.num_workers=0",
            "run.precision=fp32", "model.dropout=0.1", "data.mixup_alpha=0.2",
            # the watchdog's bound, small for a tiny model's steps (docs/faults.md)
            "run.hang_floor_s=4", "run.hang_factor=10", "run.hang_start_s=90",
            # a loss 20x the median of the last 20 read is a spike (the spike fault: 1000x)
            "run.spike_factor=20", *size.args, *extra]
    if uri:
        keys.append(f"run.ckpt_dir={uri}")
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={size.ranks}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=8",
            "--monitor-interval=0.5", "-m", "vitcli", "pretrain", "--recipe", str(RECIPE),
            "--workdir", str(workdir), *keys]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_step(workdir: Path) -> int:
    """The step of metrics.jsonl's last train row (0 before any)."""
    try:
        lines = (workdir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a row being written
        if "train/loss" in row:
            return int(row["step"])
    return 0


def tree(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun's ranks sit in sessions of their own)."""
    found, frontier = [pid], [pid]
    while frontier:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", ",".join(map(str, frontier))],
                             capture_output=True, text=True, check=False).stdout
        frontier = [int(p) for p in out.split()]
        found += frontier
    return found


def kill_all(pid: int) -> None:
    for p in tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Timeline:
    """What the driver saw: (time, last step) at each poll, each launch's exit, each driver fault."""

    polls: list[tuple[float, int]] = field(default_factory=list)
    launches: list[dict] = field(default_factory=list)
    acted: dict[str, float] = field(default_factory=dict)

    def reached(self, since: float) -> int:
        """The furthest step the run had logged by `since`."""
        return max((s for t, s in self.polls if t <= since), default=0)

    def relaunched(self, since: float) -> float:
        """When the first launch after `since` began (a fault that ends a launch is paid for from
        then: the old one may log a step more on its way out)."""
        return next((x["start"] for x in self.launches if x["start"] > since), since)

    def recovered(self, step: int, since: float) -> float | None:
        """When the run first logged a step past `step` after `since`: the fault's cost is the time
        from the fault to then (the restart or rollback, and the steps trained again)."""
        return next((t for t, s in self.polls if t > since and s > step), None)


class Store:
    """moto's S3 server in this process, one port for its life (stopped, it refuses connections;
    started again, it answers with what it held)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer  # the soak's own need: moto, in the dev extra

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise

        self._server_type = ThreadedMotoServer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.start()
        import s3fs

        s3fs.S3FileSystem(key="soak", secret="soak", client_kwargs={"endpoint_url": self.url}).mkdir(BUCKET)

    def start(self) -> None:
        self.server = self._server_type(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


def drive(size: Size, workdir: Path, store: Store | None, log, relaunches: int = 4) -> Timeline:
    """The faulted run to its end: relaunched after a driver's fault as a scheduler's requeue
    would, at most `relaunches` times."""
    env = {**ENV, "VITCLI_FAULTS": ",".join(f.entry for f in size.faults if f.by == "rank")}
    if store:
        env["AWS_ENDPOINT_URL"] = store.url
    uri = f"s3://{BUCKET}/{workdir.name}" if store else ""
    pending = sorted((f for f in size.faults if f.by == "driver"), key=lambda f: f.step)
    line = Timeline()
    for attempt in range(relaunches + 1):
        started = time.time()
        proc = subprocess.Popen(command(size, workdir, uri, free_port()), env=env, stdout=log, stderr=log,
                                start_new_session=True)
        while proc.poll() is None:
            step = last_step(workdir)
            line.polls.append((time.time(), step))
            if pending and step >= pending[0].step:
                _act(pending.pop(0), proc, workdir, store, line)
            time.sleep(0.02)  # a tiny model's step takes ~15 ms: the driver acts within a step or two
        line.polls.append((time.time(), last_step(workdir)))  # what it logged on its way out
        line.launches.append({"attempt": attempt, "rc": proc.returncode, "start": started,
                              "s": round(time.time() - started, 1)})
        if proc.returncode == 0:
            return line
        if store and store.server is None:
            store.start()
    raise RuntimeError(f"the soak's run did not finish in {relaunches + 1} launches: {line.launches}")


def _act(fault: Fault, proc: subprocess.Popen, workdir: Path, store: Store | None, line: Timeline) -> None:
    """A fault the cluster, not a rank, brings."""
    line.acted[fault.entry] = time.time()
    if fault.kind == "sigterm":  # a preemption: torchrun forwards it to every rank
        proc.send_signal(signal.SIGTERM)
    elif fault.kind == "node_lost":
        kill_all(proc.pid)
        for path in workdir.glob("state-*"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    elif fault.kind == "store_restart" and store:
        store.stop()
        time.sleep(3)
        store.start()


def reference(size: Size, workdir: Path, skips: list[str], log) -> None:
    """The run that met nothing, given the faulted run's recorded skips up front."""
    extra = (f"data.skip_steps=[{','.join(skips)}]",) if skips else ()
    cmd = command(size, workdir, "", free_port(), extra)
    subprocess.run(cmd, env={**ENV, "VITCLI_FAULTS": ""}, stdout=log, stderr=log, check=True)


def recorded_skips(workdir: Path) -> list[str]:
    """The faulted run's rollbacks, as data.skip_steps' windows: each record holds every window so
    far (merged), so the last one says them all."""
    path = workdir / "rollbacks.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [f"{first}-{last}" for first, last in rows[-1]["skips"]] if rows else []


def compare(a: Path, b: Path) -> tuple[bool, int]:
    """(the two runs' final weights are equal bit for bit, how many tensors)."""
    sys.path.insert(0, str(REPO / "src"))
    import torch

    from vitcli.checkpoints.weights import load_weights

    x, y = load_weights(a / "model.safetensors")[0], load_weights(b / "model.safetensors")[0]
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), len(x)


def report(size: Size, faulted: Path, line: Timeline, same: bool, tensors: int, seconds: dict) -> dict:
    """Each fault: when it fired, when the run was past its step again, and the seconds between."""
    fired = {}
    path = faulted / "faults-fired.jsonl"
    for row in map(json.loads, path.read_text().splitlines() if path.exists() else []):
        fired[row["fault"]] = row.get("time")
    fired.update(line.acted)
    rows = []
    for fault in size.faults:
        at = fired.get(fault.entry)
        since = line.relaunched(at) if at and fault.kind in ENDS_LAUNCH else at
        reached = max(fault.step, line.reached(since)) if at else fault.step
        back = line.recovered(reached, since) if at else None
        rows.append({**asdict(fault), "fired": at is not None, "at_step": reached,
                     "recovered_s": None if back is None else round(back - at, 2)})
    return {"steps": size.steps, "ranks": size.ranks, "faults": rows,
            "kinds": len({f.kind for f in size.faults}), "bit_identical": same, "tensors": tensors,
            "launches": line.launches, **seconds}


def soak(size: Size, root: Path, with_store: bool = True) -> dict:
    """The faulted run and the reference beside it, under `root`; the report."""
    store = Store() if with_store else None
    faulted, clean = root / "faulted", root / "reference"
    with open(root / "soak.log", "w") as log:
        t0 = time.time()
        line = drive(size, faulted, store, log)
        t1 = time.time()
        reference(size, clean, recorded_skips(faulted), log)
        t2 = time.time()
    if store:
        store.stop()
    same, tensors = compare(faulted, clean)
    return report(size, faulted, line, same, tensors, {"faulted_s": round(t1 - t0, 1),
                                                        "reference_s": round(t2 - t1, 1)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test's size")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--keep", type=Path, help="keep the runs here (else a temporary directory)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="vit-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    result = soak(QUICK if args.quick else FULL, root)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(0 if result["bit_identical"] else 1)


if __name__ == "__main__":
    main()
