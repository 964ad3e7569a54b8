#!/usr/bin/env bash
# What the tests need from the system beyond Python: SLURM's controller, node daemon and clients, and munge
# (Debian's slurm-wlm 22.05), for the one-node cluster tests/integration/test_slurm.py starts. `make test`
# runs this first. It installs them where it can (root with apt-get); elsewhere it says why, and the SLURM
# tests skip, saying it too.
set -u
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
missing=0
for tool in slurmctld slurmd sbatch scontrol munged; do have "$tool" || missing=1; done
[ "$missing" = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system-deps: SLURM is not installed and this is not root with apt-get: the SLURM tests will skip" >&2
    exit 0
fi
packages=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
echo "system-deps: installing ${packages[*]} (apt-get) for the SLURM tests" >&2
apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${packages[@]}" >/dev/null; } \
    || echo "system-deps: apt-get could not install ${packages[*]}: the SLURM tests will skip" >&2
exit 0
