"""Peak resident memory of a training process and of its children (the loader workers), for
summary.json.

Linux keeps each process's high-water mark (VmHWM in /proc/PID/status), so a sample now and then
loses no peak: a worker's is read while it lives (it exits with its loader), at each logging step
and at the end. Elsewhere the main process's figure comes from getrusage and the workers' are not
known.

Shared pages count in every process that touched them (the decoded-image cache,
data/decoding/image_cache.py, is one copy however many workers read it), so a worker's figure
includes what it read of the cache.

And the memory a new process may still take on this host (MemAvailable), the CPU's default budget of
data.micro_batch_size=auto (run/micro_batch.py).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

PROC = Path("/proc")


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
    """The largest peak seen of this process and of each of its children over the samples taken."""

    def __init__(self):
        self.workers: dict[int, float] = {}  # pid -> MiB
        self.main = 0.0

    def sample(self) -> None:
        """Read this process's peak and every living child's."""
        self.main = max(self.main, own_peak_mb())
        for pid in children():
            peak = peak_rss_mb(pid)
            if peak is not None:
                self.workers[pid] = max(self.workers.get(pid, 0.0), peak)

    def metrics(self) -> dict[str, float]:
        """mem/main_peak_mb, and mem/worker_peak_mb (the largest child's) when there were
        children."""
        found = {"mem/main_peak_mb": self.main}
        if self.workers:
            found["mem/worker_peak_mb"] = max(self.workers.values())
        return found
