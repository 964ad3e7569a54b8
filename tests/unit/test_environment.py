"""`vit env`'s parts: secrets never shown (by name or by shape), the launcher's and SLURM's
variables picked, /proc files read as the kernel writes them, the cache directory's rule, the
block's layout (the command as a user runs it: integration/test_env.py)."""

import os

import pytest

from vitcli.runtime import environment
from vitcli.stages.env import lines

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 hypervisor

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\nModel\t: Raspberry\n"


@pytest.mark.parametrize("name,value", [
    ("HF_TOKEN", "hf_abcdefghijklmnop"), ("WANDB_API_KEY", "0123"),
    ("MLFLOW_TRACKING_PASSWORD", "pw"),
    ("AWS_SECRET_ACCESS_KEY", "x"), ("AWS_SESSION_TOKEN", "x"), ("HUGGING_FACE_HUB_TOKEN", "x"),
    ("GITHUB_PAT_KEY", "x"), ("MY_PRIVATE_THING", "x"), ("DB_CREDENTIALS", "x"), ("HTTP_AUTH", "x"),
])
def test_a_secrets_value_is_never_shown_by_its_name(name, value):
    assert environment.redact(name, value) == environment.REDACTED
    assert name in environment.secrets_set({name: value, "PATH": "/bin"})


@pytest.mark.parametrize("value,shown", [
    ("https://alice:hunter2@mlflow.example.org:5000",
     "https://alice:<redacted>@mlflow.example.org:5000"),
    ("job with hf_AbCdEfGhIjKlMnOp inside", "job with <redacted> inside"),
    ("sk-proj-1234567890abcdef", "<redacted>"), ("ghp_0123456789abcdefXYZ", "<redacted>"),
    ("AKIAIOSFODNN7EXAMPLE", "<redacted>"), ("a" * 40, "<redacted>"),
    ("node[01-04]", "node[01-04]"), ("12345", "12345"),
    ("/home/me/.cache/vitcli", "/home/me/.cache/vitcli"),
])
def test_a_token_or_a_urls_password_in_a_value_shown_is_cut_out(value, shown):
    assert environment.redact("SLURM_JOB_COMMENT", value) == shown


def test_the_launchers_and_slurms_variables_are_picked_and_redacted():
    env = {"RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node01", "TORCHELASTIC_RUN_ID": "abc",
           "SLURM_JOB_ID": "42", "SLURM_JOB_COMMENT": "hf_AbCdEfGhIjKlMnOp", "HF_TOKEN": "hf_x",
           "PATH": "/bin", "RANKING": "no"}
    assert environment.launcher_vars(env) == {
        "MASTER_ADDR": "node01", "RANK": "1", "SLURM_JOB_COMMENT": "<redacted>",
        "SLURM_JOB_ID": "42",
        "TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "8"}
    assert environment.launcher_vars({"PATH": "/bin"}) == {}


def test_cpuinfo_gives_the_model_and_the_flags_that_decide_bf16():
    model, flags = environment.cpuinfo(CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]
    assert environment.cpuinfo(ARM)[1] == ["bf16", "sve"]


@pytest.mark.parametrize("cpu_max,cpus", [("max 100000", ""), ("200000 100000", "2"),
                                          ("50000 100000", "0.5"), ("", "")])
def test_a_cgroup_quota_is_read_as_cpus(cpu_max, cpus):
    assert environment.cpu_quota(cpu_max) == cpus


def test_meminfo_in_gib():
    text = "MemTotal:       24641536 kB\nMemFree:  100 kB\nMemAvailable:   12320768 kB\n"
    assert environment.memory(text) == {"total_gib": 23.5, "available_gib": 11.8}
    assert environment.memory("") == {}


def test_the_cache_directory_rule_and_its_free_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("VITCLI_CACHE", str(tmp_path / "not-yet" / "cache"))
    said = environment.cache(os.environ)
    assert said["dir"] == str(tmp_path / "not-yet" / "cache") and said["exists"] is False
    # measured where it would be made: its nearest parent that exists
    fs = os.statvfs(tmp_path)
    assert said["free_gib"] == round(fs.f_bavail * fs.f_frsize / 2**30, 1)
    monkeypatch.delenv("VITCLI_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert environment.cache_dir() == tmp_path / "xdg" / "vitcli"


def test_the_block_is_nested_markdown_bullets():
    gpu = {"index": 0, "name": "H200", "memory_gib": 139.8}
    report = {"versions": {"torch": "2.14.1"}, "flags": ["avx2", "amx_bf16"], "launcher": "none",
              "gpus": {"devices": [gpu], "driver": "570"},
              "secrets_set": [], "free_gib": None}
    assert lines(report) == ["- versions:", "  - torch: 2.14.1", "- flags: avx2, amx_bf16",
                             "- launcher: none", "- gpus:", "  - devices:",
                             "    - index: 0, name: H200, memory_gib: 139.8", "  - driver: 570",
                             "- secrets_set: none", "- free_gib: none"]
