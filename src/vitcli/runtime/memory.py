"""Peak resident memory of a training process and of its children (the loader workers, a held-out
pass's among them), for summary.json.

Linux keeps each process's high-water mark (VmHWM in /proc/PID/status), so the main process's peak
is exact whenever it is read: summary.json reads it last, after the final evaluation, the FLOP
count and the curves. A child's is read while it lives, by a thread every CHILD_POLL_S: a held-out
pass's workers live only through the pass. Elsewhere the main process's figure comes from getrusage
and the children's are not known.

A forked worker's VmHWM counts the pages it still shares with the process it was forked from (the
interpreter, torch, the data's tables: 700 MiB of the quickstart's worker), so adding it to the main
process's would count them twice. What a child adds to the run is its own memory (USS: its private
pages, /proc/PID/smaps_rollup), and mem/run_peak_mb is the main process's peak plus the most its
children held of their own at one time: the run's peak over every process, from above (the children
are read at CHILD_POLL_S, the main process at its high-water mark).

Shared pages count in every process that touched them (the decoded-image cache,
data/decoding/image_cache.py, is one copy however many workers read it), so a worker's figure
includes what it read of the cache.

And the memory a new process may still take on this host (MemAvailable), the CPU's default budget of
data.micro_batch_size=auto (run/micro_batch.py).
"""

from __future__ import annotations

import resource
import sys
import threading
import weakref
from pathlib import Path

PROC = Path("/proc")
# how often a run's children are read: a worker's own memory grows over seconds, and reading it
# (smaps_rollup) takes ~12 ms a process: ~1% of a core for two workers
CHILD_POLL_S = 1.0


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """A process's peak resident set in MiB (VmHWM); None when it has gone or /proc is not there."""
    return status_mb(pid, "VmHWM")


def status_mb(pid: int | str, field: str) -> float | None:
    """A figure of /proc/PID/status in MiB (VmHWM: the peak resident set; RssAnon: the resident
    memory that is the process's own, not pages of files it maps); None when it has gone or /proc is
    not there."""
    return _field_mb(PROC / str(pid) / "status", field)


def available_mb() -> float | None:
    """MiB the kernel reckons a new workload can take without swapping (MemAvailable: free memory
    plus the page cache and slabs it can reclaim); None where /proc/meminfo is not there."""
    return _field_mb(PROC / "meminfo", "MemAvailable")


def _field_mb(path: Path, field: str) -> float | None:
    """A `Field:  1234 kB` line of a /proc file in MiB; None when the file or the line is not there."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def own_mb(pid: int | str) -> float | None:
    """A process's own resident memory in MiB, the pages no other process maps (USS: Private_Clean +
    Private_Dirty of /proc/PID/smaps_rollup); None when it has gone or /proc is not there."""
    clean = _field_mb(PROC / str(pid) / "smaps_rollup", "Private_Clean")
    dirty = _field_mb(PROC / str(pid) / "smaps_rollup", "Private_Dirty")
    return None if clean is None or dirty is None else clean + dirty


def children(pid: int | str = "self") -> list[int]:
    """The pids of a process's children (those of every thread: a DataLoader starts its workers from
    the main thread, a compiler pool may from another)."""
    found = []
    try:
        for task in (PROC / str(pid) / "task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return []
    return found


def own_peak_mb() -> float:
    """This process's peak resident set in MiB: VmHWM, or where /proc is missing ru_maxrss (kB on
    Linux, bytes on macOS)."""
    peak = peak_rss_mb()
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class PeakMemory:
    """The peak of this process, the largest peak of each of its children, and the most its children
    held of their own at once, over the samples taken (`sample`, and every `every_s` from a thread
    of its own until `stop` when given one)."""

    def __init__(self, every_s: float | None = None):
        self.workers: dict[int, float] = {}  # pid -> MiB (VmHWM)
        self.children_own = 0.0  # MiB: the largest sum of the children's USS at one sample
        self.main = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if every_s:
            # a weak reference: a run that fails before `stop` leaves no thread behind once its
            # PeakMemory is gone
            self._thread = threading.Thread(target=_poll, args=(weakref.ref(self), self._stop, every_s),
                                            daemon=True, name="vitcli-peak-memory")
            self._thread.start()

    def stop(self) -> None:
        """End the sampling thread, if any, after a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def sample(self) -> None:
        """Read this process's peak and every living child's, and the children's own memory now."""
        with self._lock:
            self.main = max(self.main, own_peak_mb())
            own = 0.0
            for pid in children():
                peak, mine = peak_rss_mb(pid), own_mb(pid)
                if peak is not None:
                    self.workers[pid] = max(self.workers.get(pid, 0.0), peak)
                own += mine or 0.0
            self.children_own = max(self.children_own, own)

    def metrics(self) -> dict[str, float]:
        """mem/main_peak_mb (this process's high-water mark, read now), mem/run_peak_mb (that plus
        the most the children held of their own at once), and mem/worker_peak_mb (the largest
        child's VmHWM) when there were children."""
        self.main = max(self.main, own_peak_mb())
        found = {"mem/main_peak_mb": self.main, "mem/run_peak_mb": self.main + self.children_own}
        if self.workers:
            found["mem/worker_peak_mb"] = max(self.workers.values())
        return found


def _poll(ref: weakref.ref, stop: threading.Event, every_s: float) -> None:
    """A PeakMemory's sampling thread: every `every_s` until stopped or the PeakMemory is gone."""
    while not stop.wait(every_s):
        memory = ref()
        if memory is None:
            return
        memory.sample()
        del memory


def refreshed(summary: dict) -> dict:
    """`summary`'s mem/main_peak_mb and mem/run_peak_mb raised to this process's high-water mark now:
    what it did after the training loop gathered them (the FLOP count, the curves) counts too."""
    if "mem/main_peak_mb" not in summary:
        return summary
    main = max(summary["mem/main_peak_mb"], own_peak_mb())
    run = summary.get("mem/run_peak_mb", main) + main - summary["mem/main_peak_mb"]
    return {**summary, "mem/main_peak_mb": main, "mem/run_peak_mb": run}
