"""`vit env` as a user pastes it into a bug report: every section there, in the block and as JSON;
the launcher's and SLURM's variables shown; no secret's value anywhere in what it prints; offline
(the pure parts: unit/test_environment.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from vitcli.runtime.environment import CORE, EXTRAS, REDACTED

SECRETS = {"HF_TOKEN": "hf_FakeTokenNeverPrinted123", "WANDB_API_KEY": "f" * 40,
           "MLFLOW_TRACKING_PASSWORD": "hunter2-never-printed",
           "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}
LAUNCH = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "node017",
          "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "rdzv-7", "SLURM_JOB_ID": "424242",
          "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "node[017-018]",
          # a value shown, with a password in it
          "SLURM_JOB_COMMENT": "https://bob:s3cret-in-url@tracker.example.org"}
SECTIONS = {"versions", "extras", "python", "os", "cpu", "memory", "threads", "precision", "gpus",
            "launcher", "cache", "hf", "vitcli_vars", "secrets_set"}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """(the block, the JSON) of `vit env` in a process whose environment holds the secrets, a
    torchrun and SLURM job's variables, a VITCLI_CACHE not made yet, and a proxy that goes nowhere
    (offline)."""
    cache = tmp_path_factory.mktemp("env") / "cache"
    env = {**os.environ, **SECRETS, **LAUNCH, "VITCLI_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    outs = []
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-m", "vitcli.cli", "env", *extra], env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        for value in (*SECRETS.values(), "s3cret-in-url"):
            assert value not in done.stdout + done.stderr, f"{value} printed"
        outs.append(done.stdout)
    return outs[0], json.loads(outs[1]), cache


def test_the_json_has_every_section_and_what_torch_sees(ran):
    _, report, cache = ran
    assert set(report) == SECTIONS
    assert set(report["versions"]) == set(CORE) and set(report["extras"]) == set(EXTRAS)
    assert report["versions"]["torch"] == torch.__version__
    cpu = report["cpu"]
    assert cpu["cores"] == os.cpu_count() and cpu["usable_cores"] == len(os.sched_getaffinity(0))
    assert cpu["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["threads"]["torch_intra_op"] == 1 and report["threads"]["OMP_NUM_THREADS"] == "1"
    if not torch.cuda.is_available():
        assert report["gpus"]["devices"] == "none"
        assert report["precision"]["auto_inference"] == "fp32 (run.precision=auto on cpu)"
    else:  # each GPU torch sees, with its memory
        assert [g["name"] for g in report["gpus"]["devices"]] == [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert report["cache"] == {**report["cache"], "VITCLI_CACHE": str(cache), "dir": str(cache),
                               "exists": False}
    assert report["cache"]["free_gib"] > 0
    assert report["hf"]["HF_HUB_OFFLINE"] == "1" and report["hf"]["TRANSFORMERS_OFFLINE"] == "1"
    assert not cache.exists()  # nothing written


def test_the_launchers_and_slurms_variables_are_shown_and_secrets_only_named(ran):
    block, report, _ = ran
    shown = {**LAUNCH, "SLURM_JOB_COMMENT": f"https://bob:{REDACTED}@tracker.example.org"}
    assert {k: report["launcher"][k] for k in LAUNCH} == shown
    assert set(SECRETS) <= set(report["secrets_set"])
    for name, value in shown.items():
        assert f"  - {name}: {value}" in block.splitlines()
    assert block.startswith("vit env") and "- secrets_set: " in block and "HF_TOKEN" in block
