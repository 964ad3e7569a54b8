"""tests/cuda: what only a GPU can show. Every test here is skipped without a CUDA device; `make gpu-check`
runs them on a GPU machine and reports the result in its JSON."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Skip this folder's tests where torch sees no CUDA device (CI, a laptop)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs tests/cuda on a GPU machine)")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())
