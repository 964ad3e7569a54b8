"""Processes and devices, in one place. Multi-process and multi-node runs come from `torchrun`.

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (runtime.launcher reads them); without them we are a
single process. Only rank 0 talks (progress, tables) and writes files; everything else computes and
joins the all-reduces.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist

from vitcli.runtime.launcher import LaunchEnv
from vitcli.runtime.metrics import console, stdout


@dataclass(frozen=True)
class Dist:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # Gloo group for what the processes agree on (stop flags, checkpoint due) and wait for
    # (checkpoint writes) on the CPU: on NCCL they would wait for the GPU stream every step, and
    # under its 10-minute watchdog. None: the default group (already Gloo, or a single process).
    control: object = None

    @property
    def is_main(self) -> bool:
        """True on the one process that logs and writes."""
        return self.rank == 0


# How long a process waits at `barrier` for the others, behind rank 0's file writes. A ViT-H/14's
# checkpoint (632M parameters, fp32 weights and Adam's two slots: 7.6 GB), written and then read
# back for its checksum on storage at 5 MB/s, takes about 50 minutes: far past the 10 minutes after
# which NCCL's watchdog kills a job waiting in one of its collectives. A process that dies is
# noticed at once (Gloo's connection closes); this bounds only a hung one.
BARRIER_TIMEOUT = timedelta(hours=2)


def pick_device(pref: str, local_rank: int = 0, visible: int | None = None) -> torch.device:
    """`auto` takes CUDA when this process sees a GPU, else the CPU; which GPU, of the `visible`
    ones (default torch.cuda.device_count()), is the local rank's.

    torchrun on one node shows every process all the node's GPUs (local rank i takes cuda:i); srun
    with --gpus-per-task, or CUDA_VISIBLE_DEVICES set per process, shows each process its own GPU
    alone (cuda:0 for every local rank). local_rank % visible is right in both, and in between.
    """
    visible = torch.cuda.device_count() if visible is None else visible
    if pref == "cuda" or (pref == "auto" and visible):
        # run.device=cuda on a host without CUDA was refused at resolve (checkpoints.complete)
        return torch.device("cuda", local_rank % max(visible, 1))
    return torch.device("cpu")


# This process's place in a job of several once setup has joined its process group; `leave` ends it.
_joined: Dist | None = None


def setup(device_pref: str = "auto") -> Dist:
    """Join torchrun's process group, if any (NCCL on GPU, Gloo on CPU); `leave` leaves it."""
    global _joined
    launch = LaunchEnv.read()
    world, rank, local_rank = launch.world_size, launch.rank, launch.local_rank
    device = pick_device(device_pref, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        enable_tf32()
    if world > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group(**group_args(device), **attempt_store(os.environ))
    control = torch_dist.new_group(backend="gloo") if world > 1 and device.type == "cuda" else None
    # rank 0 talks: every log line and table, in one switch
    console.quiet = stdout.quiet = rank != 0
    here = Dist(rank, world, local_rank, device, control)
    if world > 1:
        _joined = here
    crowded = device.type == "cpu" and oversubscription(
        torch.get_num_threads(), launch.local_world_size, len(os.sched_getaffinity(0)))
    if crowded:
        console.log(f"[yellow]warning: {crowded}")
    if restarts_unsafe(os.environ):
        console.log(f"[yellow]warning: {restarts_unsafe(os.environ)}")
    return here


# torchrun's agent serves its workers one store for every attempt (torch >= 2.5, pytorch#135712):
# a restarted rank can read the addresses its dead predecessors left there and fail to connect.
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def attempt_store(env) -> dict:
    """init_process_group's store, rank and world size where torchrun's agent serves the store on
    one node: its keys under the attempt's number (TORCHELASTIC_RESTART_COUNT), so an attempt after
    a restart never reads the last one's. {} elsewhere (env://: the store is new each attempt, or,
    across nodes, the agents' counts of restarts can differ: restarts_unsafe)."""
    if env.get(AGENT_STORE) != "True" or env.get("GROUP_WORLD_SIZE", "1") != "1":
        return {}
    store, rank, world = next(torch_dist.rendezvous("env://"))
    prefix = f"vitcli/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return {"store": torch_dist.PrefixStore(prefix, store), "rank": rank, "world_size": world}


def restarts_unsafe(env) -> str | None:
    """The warning for torchrun's --max-restarts across nodes with the agent's shared store (a
    restarted attempt may meet the last one's keys: each node's agent counts its own restarts, so
    no attempt number is common to them); None where restarts are safe."""
    if env.get(AGENT_STORE) != "True" or env.get("GROUP_WORLD_SIZE", "1") == "1":
        return None
    if env.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    return ("torchrun --max-restarts across nodes: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
            "torchrun, or a restarted attempt may read the last one's addresses and fail to "
            "connect (pytorch#135712; docs/cluster.md)")


def oversubscription(threads: int, processes: int, cores: int) -> str | None:
    """The warning for `processes` on this machine, each computing with `threads` threads, on
    `cores` cores; None while they fit. Threads beyond the cores wait for each other at every
    parallel op: measured 2026-11-25 on 2 cores (with other work running), two processes of the
    quickstart model trained at 80-490 img/s each with 2 threads and 550-1290 with 1, 2.5-7x slower;
    one process of 2 threads beside the same work was not slower than of 1, so other jobs are not
    counted here."""
    if threads * processes <= cores:
        return None
    fits = max(1, cores // processes)
    return (f"{processes} process{'es' if processes > 1 else ''} x {threads} threads on {cores} cores: "
            f"the threads wait for each other (2.5-7x slower, measured on 2 cores); set "
            f"OMP_NUM_THREADS={fits} (torchrun sets 1 unless told otherwise)")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without stalling the host: a CPU tensor bound for CUDA is copied
    asynchronously from page-locked memory (pinned here unless the DataLoader pinned it). A copy
    from pageable memory is not asynchronous: CUDA waits for everything queued on the stream first,
    so a 16-byte tensor of flips would stall the loop until the last backward finished, and that
    wait is counted as waiting for data."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def group_args(device: torch.device) -> dict:
    """init_process_group's arguments for a process on `device`: NCCL bound to its GPU, else Gloo.

    `device_id` binds NCCL to that GPU and makes its communicator at once: a GPU or network that
    fails does so here rather than in the first collective, and a barrier or a new group knows this
    process's GPU (without it torch guesses one from the rank and warns that the devices used are
    "currently unknown").
    """
    if device.type == "cuda":
        return {"backend": "nccl", "device_id": device}
    return {"backend": "gloo"}


def leave(failed: bool = False) -> None:
    """Leave the process group that setup joined, if any: once, as the command ends, however it ends
    (cli.main). After a command that every rank finished, each first waits for the others (rank 0
    may still be writing its files): a rank that tears its group down while another still uses it
    can abort that one.

    Left to the interpreter's exit, NCCL warns "destroy_process_group() was not called" and may
    hang, and Gloo now and then aborts the process (SIGABRT, "terminate called without an active
    exception": 2 of 12 2-process launches here whose ranks ended half a second apart). After a
    `failed` command (an error, a second signal) another rank may wait in a collective that this one
    will never join: NCCL's graceful destroy would wait with it, so the group is aborted instead, as
    torch's warning advises for failures.
    """
    global _joined
    joined, _joined = _joined, None
    if joined is None or not torch_dist.is_initialized():
        return
    if not failed:
        try:
            barrier(joined)
            torch_dist.destroy_process_group()
        except RuntimeError:
            # This rank's outcome is decided (a rank that failed reports its own): a peer that left
            # the barrier first and closed its sockets can reset this one's last read ("Connection
            # reset by peer", once in six full test runs here, a SIGINT to torchrun's two ranks),
            # which must not turn an agreed stop or a success into an error
            with contextlib.suppress(Exception):
                torch_dist.destroy_process_group()
        return
    with contextlib.suppress(Exception):  # the error being reported is the one that matters
        if torch_dist.get_backend() == "nccl":
            torch_dist.distributed_c10d._abort_process_group()
        else:  # Gloo has no abort, and its destroy waits for no other rank
            torch_dist.destroy_process_group()


def enable_tf32() -> None:
    """fp32 matmuls on CUDA's tensor cores as TF32 (10-bit mantissa products, fp32 accumulation): up
    to 8x an A100's or H100's fp32 rate, and the precision ViT training is routinely run at. torch's
    default for matmuls is full fp32 ("highest"); cuDNN convolutions (the patch embedding) already
    default to TF32. Called for a CUDA device only: a CPU run keeps full fp32."""
    torch.set_float32_matmul_precision("high")


def all_reduce_sum(values: list[float], dist: Dist) -> list[float]:
    """Sum a few numbers across processes (counts for accuracy, losses for logging)."""
    return _all_reduce(values, dist, torch_dist.ReduceOp.SUM)


def all_reduce_max(values: list[float], dist: Dist) -> list[float]:
    """Element-wise maximum across processes (a flag any rank raised), on the CPU: no device
    sync."""
    return _all_reduce(values, dist, torch_dist.ReduceOp.MAX, control=True)


def _all_reduce(values: list[float], dist: Dist, op, control: bool = False) -> list[float]:
    if dist.world_size == 1:
        return values
    device = torch.device("cpu") if control else dist.device
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=op, group=dist.control if control else None)
    return t.tolist()


def all_gather(obj, dist: Dist) -> list:
    """Every rank's `obj` (picklable: tensors, numbers, arrays), in rank order, on every rank."""
    if dist.world_size == 1:
        return [obj]
    out = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj, group=dist.control)
    return out


def wrap(model: torch.nn.Module, dist: Dist) -> torch.nn.Module:
    """DistributedDataParallel when there are several processes, the model itself otherwise."""
    if dist.world_size == 1:
        return model
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def barrier(dist: Dist) -> None:
    """Wait for every process, e.g. while rank 0 writes the checkpoint the others will read: on the
    Gloo `control` group, for up to BARRIER_TIMEOUT. A CPU wait, so no NCCL collective sits queued
    under the watchdog's 10 minutes; a rank that never arrives is named in the error."""
    if dist.world_size > 1:
        torch_dist.monitored_barrier(group=dist.control, timeout=BARRIER_TIMEOUT)
