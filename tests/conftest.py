"""Fixtures shared by several test files."""

import os

import pytest
import torch

from vitcli.runtime.metrics import console


@pytest.fixture(autouse=True, scope="session")
def vitcli_cache(tmp_path_factory):
    """vitcli's cache (folder indexes) in a temporary directory, not the ~/.cache/vitcli of whoever
    tests."""
    before = os.environ.get("VITCLI_CACHE")
    os.environ["VITCLI_CACHE"] = str(tmp_path_factory.mktemp("vitcli-cache"))
    yield
    if before is None:
        os.environ.pop("VITCLI_CACHE")
    else:
        os.environ["VITCLI_CACHE"] = before


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: convolutional and T2T models run ~20x slower with 2
    threads on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def logged(monkeypatch):
    """Every console.log message, as given (before rich wraps it to the terminal)."""
    messages = []
    monkeypatch.setattr(console, "log", lambda *args, **kwargs: messages.append(" ".join(map(str, args))))
    return messages


def pytest_configure(config):
    """Under pytest-xdist (make test runs one worker per core, up to 4) each worker gets its share
    of the cores for torch's intra-op threads, and the processes tests start inherit it
    (OMP_NUM_THREADS), unless the caller set it: two workers of two threads on two cores spin
    against each other and ran several times slower than one thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
