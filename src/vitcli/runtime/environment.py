"""What this machine and process are, for a bug report (`vit env`, accelerate's `accelerate env`):
versions, Python, OS, CPU and what torch sees of it, threads, GPUs, the launcher's and SLURM's
variables, the cache and its free disk, the HF offline flags. And where vitcli keeps what it derives
from data (`cache_dir`), the one rule for it.

Read, never changed; cheap: package versions come from their metadata (nothing is imported but
torch), and nvidia-smi is asked only where it is installed, with a short timeout. A value of a
variable whose name or content looks like a secret (HF_TOKEN, WANDB_API_KEY, a URL's password) is
never shown: `redact` puts a mark in its place, and only the names of such variables are listed.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from vitcli.runtime.dist import pick_device
from vitcli.runtime.precision import choose_for

CORE = ("vitcli", "torch", "torchvision", "timm", "datasets", "transformers")
# the pip extras a recipe may ask for (trackers, search, export checks, the Hub)
EXTRAS = ("mlflow", "optuna", "trackio", "wandb", "tensorboard", "onnxruntime", "huggingface_hub")
# what torchrun sets in each process it starts (and a SLURM job's batch script, cluster/slurm.py)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
               "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_PREFIXES = ("TORCHELASTIC_", "SLURM_")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
HF_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
HF_PLACES = ("HF_HOME", "HF_DATASETS_CACHE", "HF_ENDPOINT")
# the CPU flags that decide bf16 (runtime.precision) and the vector width torch dispatches to
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
             "bf16", "sve", "sve2")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|API_?KEY|ACCESS_?KEY|PRIVATE|CREDENTIAL|COOKIE|"
                         r"(^|_)AUTH(_|$)|(^|_)KEY$")
# tokens by their shape (HF, OpenAI-style, GitHub, AWS key ids, W&B's 40 hex), wherever they sit
SECRET_VALUE = re.compile(r"hf_[A-Za-z0-9]{8,}|sk-[A-Za-z0-9_-]{8,}|gh[pousr]_[A-Za-z0-9]{8,}|"
                          r"AKIA[0-9A-Z]{12,}|\b[0-9a-f]{40}\b")
URL_PASSWORD = re.compile(r"(://[^/\s:@]+):[^/\s@]+@")
REDACTED = "<redacted>"
NVIDIA_SMI_S = 5  # a wedged driver can hang nvidia-smi for minutes: no report is worth that


def cache_dir() -> Path:
    """Where vitcli keeps what it derives from data: $VITCLI_CACHE, else $XDG_CACHE_HOME/vitcli,
    else ~/.cache/vitcli."""
    if os.environ.get("VITCLI_CACHE"):
        return Path(os.environ["VITCLI_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "vitcli"


def redact(name: str, value: str) -> str:
    """`value` as a bug report may show it: whole, else with a secret in it replaced by
    REDACTED (all of it when `name` looks like a secret's)."""
    if SECRET_NAME.search(name.upper()):
        return REDACTED
    return SECRET_VALUE.sub(REDACTED, URL_PASSWORD.sub(rf"\1:{REDACTED}@", value))


def secrets_set(environ: Mapping[str, str]) -> list[str]:
    """The names of the variables whose names look like a secret's: whether HF_TOKEN is set often
    answers a bug report; their values never appear."""
    return sorted(k for k in environ if SECRET_NAME.search(k.upper()))


def launcher_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's, TorchElastic's and SLURM's variables that are set, redacted, by name."""
    names = [k for k in environ if k in LAUNCH_VARS or k.startswith(LAUNCH_PREFIXES)]
    return {k: redact(k, environ[k]) for k in sorted(names)}


def versions(names: tuple[str, ...]) -> dict[str, str]:
    """Each installed distribution's version from its metadata (nothing imported), else `not
    installed`."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def _read(path: str) -> str:
    """A small system file's text, or "" where there is none (not Linux, a sandbox)."""
    with contextlib.suppress(OSError):
        return Path(path).read_text()
    return ""


def cpuinfo(text: str) -> tuple[str, list[str]]:
    """(model name, the CPU_FLAGS present) of /proc/cpuinfo's `text`, first processor's."""
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    model = (fields.get("model name") or fields.get("Model") or platform.processor()
             or platform.machine())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return model, [f for f in CPU_FLAGS if f in flags]


def cpu_quota(cpu_max: str) -> str:
    """cgroup v2's cpu.max ("200000 100000": 2 CPUs) as the CPUs a container may use; "" when
    unlimited or unknown."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return ""
    return f"{int(parts[0]) / int(parts[1]):g}"


def cpu() -> dict:
    """The CPU: model, cores (all, and those this process may run on), the cgroup's quota, the
    vector ISA torch dispatches to, the bf16/AMX flags, the load average."""
    model, flags = cpuinfo(_read("/proc/cpuinfo"))
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None  # not macOS
    report = {"model": model, "cores": os.cpu_count(), "usable_cores": usable,
              "torch_capability": torch.backends.cpu.get_cpu_capability(), "flags": flags,
              "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    quota = cpu_quota(_read("/sys/fs/cgroup/cpu.max"))
    if quota:
        report["cgroup_cpus"] = quota
    return report


def memory(meminfo: str) -> dict:
    """Total and available memory in GiB from /proc/meminfo's text ({} where there is none)."""
    kib = {line.split(":")[0]: int(line.split()[1]) for line in meminfo.splitlines()
           if line.split(":")[0] in ("MemTotal", "MemAvailable")}
    return {k.removeprefix("Mem").lower() + "_gib": round(v / 2**20, 1) for k, v in kib.items()}


def threads(environ: Mapping[str, str]) -> dict:
    """What torch uses (intra-op and inter-op threads) and the variables that set it."""
    return {"torch_intra_op": torch.get_num_threads(),
            "torch_inter_op": torch.get_num_interop_threads(),
            **{k: environ.get(k, "unset") for k in THREAD_VARS}}


def nvidia_smi() -> list[dict]:
    """What nvidia-smi says of each GPU (name, memory, driver); [] without it, or when it fails or
    hangs."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    query = "--query-gpu=index,name,memory.total,driver_version"
    try:
        done = subprocess.run([exe, query, "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=NVIDIA_SMI_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines()
            if line.count(",") == 3]
    return [{"index": i, "name": n, "memory_gib": round(float(m) / 1024, 1) if m.isdigit() else m,
             "driver": d} for i, n, m, d in rows] if done.returncode == 0 else []


def gpus(environ: Mapping[str, str]) -> dict:
    """The GPUs torch sees (name, memory, compute capability), the driver nvidia-smi names, the CUDA
    torch was built with; `devices: none` without one."""
    smi = nvidia_smi()
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = [{"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                "capability": f"{p.major}.{p.minor}"}
               for i, p in enumerate(map(torch.cuda.get_device_properties, range(seen)))]
    return {"devices": devices or smi or "none", "driver": smi[0]["driver"] if smi else "unknown",
            "torch_cuda": torch.version.cuda or "none (a CPU build)",
            "CUDA_VISIBLE_DEVICES": environ.get("CUDA_VISIBLE_DEVICES", "unset")}


def precision() -> dict:
    """What run.precision=auto computes in here, training and inference (runtime.precision)."""
    device = pick_device("auto")
    return {f"auto_{what}": "{} ({})".format(*choose_for(stage, "auto", device))
            for what, stage in (("train", "pretrain"), ("inference", "predict"))}


def cache(environ: Mapping[str, str]) -> dict:
    """VITCLI_CACHE, the directory it makes (`cache_dir`), and the free disk there (at its nearest
    existing parent when it is not there yet)."""
    where = cache_dir()
    there = next((p for p in (where, *where.parents) if p.exists()), None)
    free = round(shutil.disk_usage(there).free / 2**30, 1) if there else None
    return {"VITCLI_CACHE": redact("VITCLI_CACHE", environ.get("VITCLI_CACHE", "unset")),
            "dir": str(where), "exists": where.is_dir(), "free_gib": free}


def report(environ: Mapping[str, str] | None = None) -> dict:
    """Everything `vit env` shows, as one dict of sections."""
    env = os.environ if environ is None else environ
    return {
        # torch's own word has the build (2.14.1+cu130) its metadata lacks
        "versions": {**versions(CORE), "torch": torch.__version__}, "extras": versions(EXTRAS),
        "python": f"{platform.python_version()} ({platform.python_implementation()}, "
                  f"{sys.executable})",
        "os": platform.platform(), "cpu": cpu(), "memory": memory(_read("/proc/meminfo")),
        "threads": threads(env), "precision": precision(), "gpus": gpus(env),
        "launcher": launcher_vars(env) or "none", "cache": cache(env),
        "hf": {k: redact(k, env.get(k, "unset")) for k in (*HF_FLAGS, *HF_PLACES)},
        "vitcli_vars": {k: redact(k, v) for k, v in sorted(env.items()) if k.startswith("VITCLI_")},
        "secrets_set": secrets_set(env),
    }
