"""Fixtures shared by several test files."""

import os

import pytest
import torch

from vitcli.runtime.metrics import console


@pytest.fixture(autouse=True, scope="session")
def vitcli_cache(tmp_path_factory):
    """vitcli's cache (folder indexes) in a temporary directory, not the ~/.cache/vitcli of whoever tests."""
    before = os.environ.get("VITCLI_CACHE")
    os.environ["VITCLI_CACHE"] = str(tmp_path_factory.mktemp("vitcli-cache"))
    yield
    if before is None:
        os.environ.pop("VITCLI_CACHE")
    else:
        os.environ["VITCLI_CACHE"] = before


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: convolutional and T2T models run ~20x slower with 2 threads on a
    busy 2-core machine."""
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
