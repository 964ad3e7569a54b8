"""The launcher's environment (torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) is read in
one place, runtime.launcher, and handed on or asked from there."""

import re
from pathlib import Path

from vitcli.runtime.launcher import VARS, LaunchEnv

SRC = Path(__file__).resolve().parents[2] / "src" / "vitcli"


def test_a_process_without_the_launchers_variables_is_the_only_one():
    assert LaunchEnv.read({}) == LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1)
    assert LaunchEnv.read({}).is_main


def test_torchruns_variables_are_read_as_numbers():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1"}
    launch = LaunchEnv.read(env)
    assert launch == LaunchEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert not launch.is_main


def test_the_process_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.delenv("RANK", raising=False)
    assert LaunchEnv.read().local_world_size == 3 and LaunchEnv.read().rank == 0


def test_no_other_module_reads_the_launchers_variables():
    names = "|".join(VARS)
    reads = re.compile(rf"environ(\.get\(|\[)\s*[\"']({names})[\"']")
    found = [f"{p.relative_to(SRC)}:{n}" for p in SRC.rglob("*.py") if p.name != "launcher.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert found == []
