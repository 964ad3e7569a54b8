"""train.interrupt.StopRequest, with real signals raised in this process: which signal arriving
again aborts the stop under way and which changes nothing."""

import signal
import threading

import pytest

from vitcli.train.interrupt import StopRequest

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signal handlers live on the main thread")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2])
def test_a_schedulers_signal_arriving_again_is_the_same_stop(sig, logged):
    """SLURM signals every process of a job step and torchrun forwards what it received, so under
    srun each rank gets the signal twice, milliseconds apart, and then the time limit's SIGTERM
    after SIGUSR2's warning: none of them may abort the step's checkpoint (before this, the second
    raised KeyboardInterrupt, exit 130, no checkpoint: seen under a real SLURM step)."""
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        signal.raise_signal(sig)
        try:
            signal.raise_signal(sig)
            signal.raise_signal(signal.SIGTERM)
        except KeyboardInterrupt:
            pytest.fail("a repeated scheduler's signal aborted the stop")
    assert stop.signum == sig and len(logged) == 1
    assert signal.getsignal(sig) is before


def test_ctrl_c_during_a_stop_aborts_at_once(logged):
    """A person's Ctrl-C after any stop began: out now (the atomic writes leave no partial file)."""
    with pytest.raises(KeyboardInterrupt), StopRequest() as stop:
        signal.raise_signal(signal.SIGUSR2)
        signal.raise_signal(signal.SIGINT)
    assert stop.signum == signal.SIGUSR2
