"""runtime/faults.py: the injected faults a test or the soak names, each firing once per run."""

import os
import subprocess
import sys

import pytest

from vitcli.runtime import faults


def test_entries_are_read_with_their_rank_and_a_bad_one_is_named():
    got = faults.parse("kill@40:rank=1, nan@7,")
    assert got == (faults.Fault("kill", 40, 1), faults.Fault("nan", 7, 0))
    with pytest.raises(ValueError, match="'boom@3'"):
        faults.parse("boom@3")
    with pytest.raises(ValueError, match="'hang@x'"):
        faults.parse("hang@x")


def test_a_fault_fires_once_only_on_its_step_and_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@5:rank=1")
    assert not faults.armed("nan", 5, 0, tmp_path)
    assert not faults.armed("nan", 4, 1, tmp_path)
    assert not faults.armed("kill", 5, 1, tmp_path)
    assert faults.armed("nan", 5, 1, tmp_path)
    assert not faults.armed("nan", 5, 1, tmp_path)  # fired: a replayed step does not meet it again
    assert faults.fired(tmp_path) == {"nan@5:rank=1"}


def test_the_record_survives_the_process_that_a_fault_killed(tmp_path):
    code = ("import os, signal, sys; from vitcli.runtime import faults\n"
            "if faults.armed('kill', 3, 0, sys.argv[1]): os.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, faults.ENV: "kill@3"}
    first = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, env=env)
    assert first.returncode == -9
    again = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False, env=env)
    assert again.returncode == 0


def test_without_the_variable_nothing_is_armed(tmp_path, monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert not faults.armed("kill", 1, 0, tmp_path)
    assert not (tmp_path / faults.FIRED_FILE).exists()
