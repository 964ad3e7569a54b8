"""tests/cuda: what only a GPU can show. Every test here is skipped without a CUDA device; `make
gpu-check` runs them on a GPU machine and reports the result in its JSON."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Skip this folder's tests where torch sees no CUDA device (CI, a laptop), but those marked
    `anywhere`: they build on a CPU what the GPU tests time, so that they break in `make test`
    first."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs tests/cuda on a GPU machine)")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents and item.get_closest_marker("anywhere") is None:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "anywhere: a tests/cuda test that also runs without a GPU")


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
