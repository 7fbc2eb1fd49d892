#!/usr/bin/env bash
# Installs the Debian packages dlfs needs (FUSE, its headers for pyfuse3, xxhash for the C helper, the RDMA verbs bindings,
# the squashfs baseline tools, and Slurm for the deploy/slurm tests), only those missing; apt-get
# update runs only if needed.
set -euo pipefail
PKGS=(fuse3 libfuse3-dev libxxhash-dev pkg-config python3-venv python3-dev python3-pyverbs squashfs-tools squashfuse iproute2 psmisc)
# etcd: the control plane of clusters of more than one node (the tests start their own members).
PKGS+=(etcd-server etcd-client)
# A one-node Slurm that the tests start themselves, for deploy/slurm (their daemons, not systemd's).
PKGS+=(slurmctld slurmd slurm-client munge)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "dlfs: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    SUDO=sudo
fi
echo "installing system packages: ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
