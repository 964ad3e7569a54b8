"""CPU threads on a shared machine (runtime.threads): when the load leaves fewer cores than a run
would use, a few ops are timed at 1 thread and at the run's count, and the faster count is advised
in one line. On a 2-core machine shared with other work a run at torch's 2 threads trained ~6x
slower than at 1 and said nothing."""

import torch

from vitcli.runtime import threads


def test_the_ops_are_timed_only_when_other_work_leaves_too_few_cores():
    assert not threads.crowded(load=0.2, cores=2, threads=2, workers=0)  # the machine to itself
    assert threads.crowded(load=3.0, cores=2, threads=2, workers=0)  # another job's two threads
    assert threads.crowded(load=0.2, cores=2, threads=2, workers=2)  # its own loader workers
    assert not threads.crowded(load=3.0, cores=2, threads=1, workers=0)  # one thread: nothing fewer
    assert not threads.crowded(load=3.0, cores=16, threads=8, workers=2)  # room for all
    # more threads than cores for this run alone: dist.oversubscription's warning, not this one's
    assert not threads.crowded(load=3.0, cores=2, threads=4, workers=0)
    assert not threads.crowded(load=3.0, cores=4, threads=2, workers=0, processes=3)


def test_the_advice_follows_the_timing_not_the_load():
    line = threads.advice({1: 0.05, 2: 0.30}, threads=2, load=3.0, cores=2)
    assert line is not None and "OMP_NUM_THREADS=1" in line and "6.0x faster at 1 thread than" in line
    assert "load 3.0 on 2 cores" in line and "50 vs 300 ms" in line and "\n" not in line
    assert threads.advice({1: 0.10, 2: 0.11}, threads=2, load=3.0, cores=2) is None  # within the noise
    assert threads.advice({1: 0.20, 2: 0.10}, threads=2, load=3.0, cores=2) is None  # the threads pay
    line = threads.advice({1: 0.4, 3: 0.1, 8: 0.5}, threads=8, load=9.0, cores=8)
    assert "OMP_NUM_THREADS=3" in line and "at 3 threads" in line


def test_timing_is_cheap_and_leaves_the_thread_count_as_it_was():
    was = torch.get_num_threads()
    seconds = threads.timed([1, was])
    assert set(seconds) == {1, was} and 0 < sum(seconds.values()) < 2, seconds
    assert torch.get_num_threads() == was
