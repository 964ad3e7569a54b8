"""runtime.allocator: a large block freed is reused by the next allocation instead of being faulted
in afresh; counted in page faults (the kernel's count, not a timing), each side in a process of its
own."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from vitcli.runtime import allocator

SCRIPT = """
import resource, sys
from vitcli.runtime.allocator import keep_freed_memory
said = keep_freed_memory() if sys.argv[1] == "keep" else "left alone"
import torch
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
u = torch.zeros(64, 3, 224, 224, dtype=torch.uint8)  # a uint8 batch of 64 at 224 px
before = faults()
for _ in range(10):  # what augment.finish does every step: 38 MB of float32 made, scaled, dropped
    x = u.to(torch.float32)
    y = x.div(127.5)
    churn = [str(i) for i in range(1000)]  # small objects between steps, as a loop makes
    del x, y
print(said, (faults() - before) / (20 * PAGES))
""".replace("PAGES", str(64 * 3 * 224 * 224 * 4 // 4096))  # the float batch in 4 KiB pages


def _faults(mode: str, env: dict | None = None) -> tuple[str, float]:
    """What keep_freed_memory said and the pages faulted in per page allocated, in a process of its
    own."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})}).stdout.split()
    return " ".join(out[:-1]), float(out[-1])


def _thp_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_batches_are_reused_not_faulted_in_again():
    """Measured on glibc 2.36: 0.40 of the pages faulted in with the setting (torch's 64-byte
    aligned blocks are not always carved from the same place), 1.00 without it."""
    said, kept = _faults("keep")
    assert said == "set"
    assert kept < 0.7
    if not _thp_always():  # with huge pages everywhere a fresh block costs few faults too
        assert _faults("plain")[1] > 0.9  # without it, glibc maps fresh pages: one fault each


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_users_own_malloc_settings_are_left_alone(monkeypatch):
    """Each check returns before mallopt is called, so this process's allocator is not touched."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert allocator.keep_freed_memory() == "the user's own malloc settings"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert allocator.keep_freed_memory() == "the user's own malloc settings"
    said, _ = _faults("keep", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert said == "the user's own malloc settings"
