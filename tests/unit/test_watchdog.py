"""The watchdog of each rank (train/watchdog.py): its bound as a pure function, and the watchdog
itself in a process of its own (it ends the process): a hung step dumped and exit 75 at the bound, a
hang holding the GIL caught by faulthandler's C timer, healthy steps and unwatched pauses never;
its recipe keys checked at resolve time; the store torchrun's restarts need (runtime.dist)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from helpers import REPO
from vitcli.errors import HUNG_EXIT_CODE, RecipeError
from vitcli.recipe.resolve import resolve
from vitcli.runtime import dist
from vitcli.train.watchdog import BACKSTOP, WARMUP, WINDOW, bound

QUICKSTART = REPO / "recipes/quickstart/pretrain.yaml"


def test_the_bound_is_the_start_bound_until_warm_then_a_floored_multiple_of_the_median():
    """Off at factor 0; run.hang_start_s for the first WARMUP steps (None: unwatched when 0); then
    max(floor, factor x the median of the last WINDOW steps)."""
    assert bound([1.0] * 20, 0, 300, 1800) is None
    assert bound([0.1] * (WARMUP - 1), 10, 300, 1800) == 1800
    assert bound([], 10, 300, 0) is None
    assert bound([0.1] * WARMUP, 10, 300, 1800) == 300  # 10 x 0.1 s is under the floor
    assert bound([60.0] * WARMUP, 10, 300, 1800) == 600  # a 60 s step: 10 x 60


def test_one_slow_step_does_not_move_the_bound_and_old_steps_are_forgotten():
    """The median: compiling's 500 s first step, or a log step's sync, leave it where the steady
    steps put it; after WINDOW steps at a new pace the bound is that pace's."""
    steady = [40.0] * 10
    assert bound([500.0, *steady], 10, 3, 60) == bound(steady, 10, 3, 60) == 400
    assert bound([*steady, 900.0, *steady], 10, 3, 60) == 400
    assert bound([100.0] * 200 + [1.0] * WINDOW, 10, 3, 60) == 10


def child(workdir: Path, body: str, warm: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` with a Watchdog `dog` of rank 3 (factor 2, floor 0.5 s, start 5 s) in `workdir`,
    after WARMUP quick steps when `warm`; (the process, seconds from the end of those steps to its
    end)."""
    warm_up = """
    for n in range(1, WARMUP + 1):
        dog.step(n)
        time.sleep(0.01)
        dog.done()""" if warm else ""
    script = f"""
import ctypes, sys, time
from vitcli.recipe.schema import RunConfig
from vitcli.train.watchdog import Watchdog, hang_forever, WARMUP
run = RunConfig(hang_factor=2, hang_floor_s=0.5, hang_start_s=5)
with Watchdog(run, 3, sys.argv[1]) as dog:{warm_up}
    print(time.time(), flush=True)
{body}
"""
    proc = subprocess.run([sys.executable, "-c", script, str(workdir)], capture_output=True,
                          text=True, timeout=60, check=False)
    began = float(proc.stdout.split()[0])
    return proc, time.time() - began


def test_a_hung_step_dumps_every_stack_and_exits_75_at_the_bound(tmp_path):
    """A step asleep (as a rank waiting in a collective: the GIL free) past the 0.5 s floor: one
    line naming the rank, the step and the bound, every thread's stack (the sleeping frame named),
    exit 75; at the bound, before faulthandler's backstop."""
    proc, took = child(tmp_path, "    dog.step(WARMUP + 1)\n    hang_forever()")
    assert proc.returncode == HUNG_EXIT_CODE, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"rank 3: step {WARMUP + 1} has run "), first
    assert "past its bound of 0.5 s" in first
    assert "run.hang_floor_s=0.5, run.hang_factor=2 x the median step" in first
    assert "in hang_forever" in proc.stderr and "Current thread" in proc.stderr
    assert "Timeout" not in proc.stderr  # the Python thread's dump, not the backstop's
    assert 0.5 <= took < 0.5 * BACKSTOP + 2, took  # + the interpreter's exit


def test_a_hang_that_holds_the_gil_is_caught_by_faulthandlers_own_timer(tmp_path):
    """A C call that never returns and never releases the GIL (libc's sleep through ctypes.PyDLL,
    which keeps it): no Python thread can run, so the C timer armed with the step dumps the stacks
    at BACKSTOP x the bound and exits 1 (CPython fixes that code)."""
    proc, took = child(tmp_path, "    dog.step(WARMUP + 1)\n    ctypes.PyDLL(None).sleep(30)")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("Timeout (0:00:00"), proc.stderr[:300]
    assert "<module>" in proc.stderr  # the frame that made the call
    assert 0.5 * BACKSTOP <= took < 20, took


def test_healthy_steps_slow_first_steps_and_pauses_between_steps_never_fire(tmp_path):
    """A first step of 1 s under the start bound (compiling), steps near the floor, 1.5 s between
    two steps (an evaluation, a checkpoint written: not watched), and 1.5 s of a step disarmed (a
    rollback reading its checkpoint back): the process ends 0."""
    body = """    dog.step(1); time.sleep(1.0); dog.done()
    for n in range(2, 12):
        dog.step(n); time.sleep(0.3); dog.done()
    time.sleep(1.5)
    dog.step(12); time.sleep(0.05); dog.done()
    dog.step(13); dog.disarm(); time.sleep(1.5)  # a rollback: its wait for a write is no step's
    dog.step(13); time.sleep(0.05); dog.done()
print("finished")"""
    proc, _ = child(tmp_path, body, warm=False)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr


@pytest.mark.parametrize("override, culprit", [
    ("run.hang_factor=1.5", "run.hang_factor=1.5"),
    ("run.hang_floor_s=0", "run.hang_floor_s=0"),
    ("run.hang_start_s=-1", "run.hang_start_s"),
])
def test_a_bound_that_would_fire_on_a_healthy_run_is_refused_at_resolve(override, culprit):
    with pytest.raises(RecipeError, match=culprit.replace(".", r"\.")):
        resolve("pretrain", QUICKSTART, [override])


def test_the_watchdog_can_be_turned_off():
    recipe = resolve("pretrain", QUICKSTART, ["run.hang_factor=0", "run.hang_floor_s=0"])
    assert recipe.run.hang_factor == 0 and bound([1.0] * 10, 0, 0, 0) is None


def test_a_restarted_attempt_on_one_node_reads_its_own_keys_not_the_last_ones(monkeypatch):
    """torchrun's agent serves every attempt the same store: the group's keys go under the attempt's
    number, so a restarted rank cannot read the gloo address its dead predecessor left."""
    server = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1",
           "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port),
           "RANK": "1", "WORLD_SIZE": "2"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    server.set("rank_0", "the last attempt's address")
    joined = dist.attempt_store(env)
    assert (joined["rank"], joined["world_size"]) == (1, 2)
    joined["store"].set("rank_1", "this attempt's")
    assert server.get("vitcli/attempt-1/rank_1") == b"this attempt's"
    assert not joined["store"].check(["rank_0"])
    assert dist.attempt_store({**env, "GROUP_WORLD_SIZE": "2"}) == {}
    assert dist.attempt_store({}) == {}


def test_restarts_across_nodes_on_the_shared_store_are_warned_of():
    many = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2",
            "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in dist.restarts_unsafe(many)
    assert dist.restarts_unsafe({**many, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert dist.restarts_unsafe({**many, "GROUP_WORLD_SIZE": "1"}) is None
    assert dist.restarts_unsafe({**many, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
