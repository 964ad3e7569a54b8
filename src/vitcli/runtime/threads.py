"""CPU threads on a machine shared with other work: measured once as a CPU run starts, one line of
advice when fewer threads would be faster.

torch takes as many threads as the process may use cores, and every parallel op ends in a barrier at
which the threads wait for each other: a thread that another job's process holds off its core holds
all of them up. On a 2-core machine shared with other work, a run with torch's 2 threads trained ~6x
slower than with OMP_NUM_THREADS=1 and said nothing (issue 39). dist.oversubscription warns when
this run's own processes need more threads than there are cores; this counts the rest of the
machine, from its load average, and when that leaves fewer cores than the run would use, times a few
small ops at 1 thread and at the run's count (0.2-0.8 s) and advises the faster one. The measurement
decides, not the load: a loaded machine on which the threads still pay says nothing. Loader workers
count in the demand, but they are not yet running when the ops are timed, so only the other jobs'
contention is measured; and contention comes and goes, so the advice is the start's: measured on 2
shared cores, the quickstart at 2 threads trained at 119-181 img/s where 1 thread gave 763-878 (load
~5, advised), but at 1344 against 796 in a lighter minute (load ~2, advised all the same: the
start's minute was not the run's). `make threads-ab` repeats the comparison.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from vitcli.runtime.launcher import LaunchEnv

ROUNDS = 5  # interleaved 1-thread / n-thread rounds: a burst of other work falls on both alike
# no round starts past this: on a crowded machine the n-thread rounds are the slow ones
BUDGET_S = 0.5
# fewer threads must win by this much to be advised: the timing is noisy on a busy machine
FASTER = 1.2


def crowded(load: float, cores: int, threads: int, workers: int, processes: int = 1) -> bool:
    """Whether the cores this run would use are busy with other work: the 1-minute load average less
    this job's own processes (counted busy: they have been importing), plus what the run will keep
    busy (its threads per process and its loader workers), above the cores this process may run
    on."""
    others = max(0.0, load - processes)
    # too many threads with the machine to itself: dist.oversubscription says
    if threads * processes > cores:
        return False
    return threads > 1 and others + threads * processes + workers > cores


def advice(timings: dict[int, float], threads: int, load: float, cores: int) -> str | None:
    """The one-line advice from `timings` (seconds for the same ops at each thread count), or None
    when the run's own `threads` are as fast as any fewer (within FASTER)."""
    best = min(timings, key=timings.get)
    ratio = timings[threads] / timings[best]
    if best >= threads or ratio < FASTER:
        return None
    return (f"the cores are shared (load {load:.1f} on {cores} cores): a test op ran {ratio:.1f}x faster "
            f"at {best} thread{'s' * (best > 1)} than at this run's {threads} "
            f"({timings[best] * 1e3:.0f} vs {timings[threads] * 1e3:.0f} ms); start it with "
            f"OMP_NUM_THREADS={best} (torch takes its thread count from it)")


def timed(counts: list[int], rounds: int = ROUNDS) -> dict[int, float]:
    """Seconds the same small ops took at each thread count of `counts`, summed over interleaved
    rounds (fewer once BUDGET_S is spent); the process's thread count is left as it was."""
    was, start = torch.get_num_threads(), time.perf_counter()
    total = dict.fromkeys(counts, 0.0)
    try:
        _ops()  # the first call allocates and warms the kernels: not timed
        for _ in range(rounds):
            if time.perf_counter() - start > BUDGET_S and any(total.values()):
                break
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                _ops()
                total[n] += time.perf_counter() - t0
    finally:
        torch.set_num_threads(was)
    return total


def _ops(reps: int = 20) -> torch.Tensor:
    """A transformer block's kind of work at a tiny ViT's size: layer norm, a matmul, GELU, softmax,
    each a parallel op with its barrier (~15 ms on one core)."""
    gen = torch.Generator().manual_seed(0)  # the run's RNG streams are not drawn from
    # (B*N, D)
    x, w = torch.randn(512, 128, generator=gen), torch.randn(128, 128, generator=gen) / 12
    for _ in range(reps):
        y = F.gelu(F.layer_norm(x, (128,)) @ w)
        x = x + 0.01 * y.softmax(-1)
    return x


def check(workers: int) -> str | None:
    """This machine's advice for a CPU run with `workers` loader workers per process (None: nothing
    to say); the ops are timed only when the load says the cores are crowded."""
    load, cores, threads = os.getloadavg()[0], len(os.sched_getaffinity(0)), torch.get_num_threads()
    processes = LaunchEnv.read().local_world_size  # torchrun's, on this machine
    if not crowded(load, cores, threads, workers * processes, processes):
        return None
    return advice(timed([1, threads]), threads, load, cores)
