"""glibc's allocator told to keep the memory a process frees for its next allocations.

By default glibc serves every block above a threshold (128 KB, raised as such blocks are freed, to
at most 32 MB) with a fresh mmap and gives it back on free, and trims the heap's free top at 128 KB.
A training process allocates the same large tensors every step (a batch of 64 at 224 px is 38 MB in
float32), so each one comes back as fresh pages that the kernel faults in and zeroes page by page:
converting that batch from uint8 took 17 ms where writing into memory already touched takes 2. With
the mmap threshold and the trim threshold raised, freed blocks stay in the heap and are reused.
Measured on the 2-core AMD EPYC, one thread, `python bench/input.py`: our loader 15-20% more
images/s with DeiT's augmentation and without (timm's PIL path, in the same process, ~10%); a
ViT-Ti/16 training step unchanged. The price: the process's resident memory stays at its high-water
mark instead of shrinking between steps.

torch has no caching allocator on the CPU that we could use instead; jemalloc or tcmalloc preloaded
do the same (and a preloaded allocator makes this a no-op: glibc's malloc is then not the one in
use). A user who set glibc's own knobs (MALLOC_*_ environment variables, GLIBC_TUNABLES) keeps them:
we change nothing.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap, reused when freed
TRIM_THRESHOLD = 1 << 31  # the heap's free top returned to the system only past 2 GiB
USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds for this process (and the loader workers it forks).
    Returns what was done, "set" or why not (the benches record it in their JSON)."""
    try:  # os.confstr, not the platform module: that costs `vit --help` 7 ms of imports
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"
    except (ValueError, OSError):  # no such name: not glibc (macOS, musl)
        libc = ""
    if not libc.startswith("glibc"):
        return "not glibc"
    if any(k in os.environ for k in USER_KNOBS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "the user's own malloc settings"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "no mallopt in libc.so.6"
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    done = [mallopt(k, v) == 1 for k, v in settings]
    return "set" if all(done) else "refused by mallopt"
