"""checkpoints.writer: staging copies into kept buffers, one write in flight, a failure kept as one
line for the training process."""

import errno
import threading
from pathlib import Path

import torch

from vitcli.checkpoints.writer import Staging, Writer


def test_staging_copies_the_state_and_refills_the_same_buffers():
    live = {
        "model": {"w": torch.arange(6.0).reshape(2, 3)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999)}],
        },
        "step": 7,
    }
    staging = Staging()
    first = staging.stage(live)
    live["model"]["w"].add_(1)  # training goes on
    assert torch.equal(first["model"]["w"], torch.arange(6.0).reshape(2, 3)), (
        "a copy, not the live tensor"
    )
    assert (
        first["optimizer"]["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.999)}]
        and first["step"] == 7
    )
    assert first["optimizer"]["param_groups"] is not live["optimizer"]["param_groups"]
    pointer = first["model"]["w"].data_ptr()
    second = staging.stage(live)
    assert second["model"]["w"].data_ptr() == pointer, "the next checkpoint refills the buffer"
    assert torch.equal(second["model"]["w"], live["model"]["w"])


def test_one_write_in_flight_the_next_waits_for_it():
    writer, events, release = Writer(background=True), [], threading.Event()

    def slow():
        events.append("first begins")
        release.wait(timeout=30)
        events.append("first ends")

    writer.submit(slow, Path("state-1.pt"))
    second = threading.Thread(
        target=writer.submit, args=(lambda: events.append("second"), Path("state-2.pt"))
    )
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive() and events == ["first begins"], "the second write waits"
    release.set()
    second.join(timeout=30)
    assert writer.wait() is None
    assert events == ["first begins", "first ends", "second"]


def test_a_failed_write_is_kept_as_one_line_and_told_once():
    writer = Writer(background=True)

    def full():
        raise OSError(errno.ENOSPC, "No space left on device", "/w/.state-3.pt.abc.tmp")

    writer.submit(full, Path("/w/state-3.pt"))
    failure = writer.wait()
    assert failure.transient and "\n" not in failure.line
    assert failure.line.startswith(
        "/w/state-3.pt: could not be written (OSError: [Errno 28] No space left"
    )
    assert writer.wait() is None, "told once"

    def bug():
        raise KeyError("model")

    writer.submit(bug, Path("/w/state-4.pt"))
    assert not writer.wait().transient, "not the disk's: the run stops"
