#!/usr/bin/env bash
# System set-up for nccl-exporter on Debian 12 (run as root; idempotent).
# Silent when there is nothing to do; prints one line per change it makes.
set -euo pipefail

PACKAGES=(
    python3-bpfcc python3-venv linux-headers-amd64 gcc make libc6-dev
    nftables iproute2 procps binutils prometheus prometheus-alertmanager
    bpftrace bpftool protobuf-compiler golang-github-prometheus-client-model-dev
    libprotobuf-dev
    # the profiler plugin for aarch64, and running it there under emulation
    # (tests/test_plugin_platforms.py)
    gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
    # a one-node Slurm for deploy/slurm's TaskProlog (tests/test_slurm.py)
    slurmctld slurmd slurm-client
)
# protobuf-compiler is protoc alone; libprotobuf-dev has the well-known types
# (google/protobuf/timestamp.proto) that Prometheus' metrics.proto imports.

# Inside a chroot or a container (`make test-clean-room` runs this script in
# one) nothing can mount tracefs: that step is skipped there, with a line
# saying so. A chroot: $container set (podman, systemd-nspawn), or a root
# other than PID 1's (where PID 1's root can be read at all); where neither
# tells (buildah's chroot isolation), a failed mount says so and goes on.
in_chroot() {
    [ -n "${container:-}" ] && return 0
    local mine init
    mine=$(stat -c %d:%i / 2>/dev/null) && init=$(stat -c %d:%i /proc/1/root/. 2>/dev/null) && [ "$mine" != "$init" ]
}

if [ "$(id -u)" -ne 0 ]; then
    echo "setup-system: must run as root (apt-get, /lib/modules, mount)" >&2
    exit 1
fi

# --- 1. Debian packages: apt-get only when something is missing -----------
missing=()
for pkg in "${PACKAGES[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)
    [ "$status" = "installed" ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup-system: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# kubectl (its kustomize renders deploy/kubernetes in the tests): Debian's
# kubernetes-client, unless a kubectl is already installed (another package
# owning /usr/bin/kubectl would conflict with it).
if ! command -v kubectl >/dev/null 2>&1; then
    echo "setup-system: installing kubernetes-client (kubectl kustomize)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends kubernetes-client
fi

# --- 2. Kernel headers for the running kernel --------------------------------
# BCC compiles against /lib/modules/$(uname -r)/build. On hosts whose kernel
# is not a Debian one (e.g. a VM's custom kernel) nothing provides it: link
# the newest Debian linux-headers-amd64 tree instead.
kver=$(uname -r)
moddir="${MODULES_ROOT:-/lib/modules}/$kver"
if [ ! -e "$moddir/build/include" ]; then
    build=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
    source=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -z "$build" ] || [ -z "$source" ]; then
        echo "setup-system: no /usr/src/linux-headers-*-amd64 to link; is linux-headers-amd64 installed?" >&2
        exit 1
    fi
    mkdir -p "$moddir"
    ln -sfn "$build" "$moddir/build"
    ln -sfn "$source" "$moddir/source"
    echo "setup-system: linked $moddir/build -> $build"
    echo "setup-system: linked $moddir/source -> $source"
fi

# --- 3. tracefs (uprobe_events, tracepoints) ------------------------------
if [ ! -e /sys/kernel/tracing/uprobe_events ] && in_chroot; then
    echo "setup-system: in a chroot: not mounting tracefs on /sys/kernel/tracing (the host must; only make test-quick runs here)"
elif [ ! -e /sys/kernel/tracing/uprobe_events ] && ! mountpoint -q /sys/kernel/tracing; then
    if mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null; then
        echo "setup-system: mounted tracefs on /sys/kernel/tracing"
    else   # a chroot that does not say so (buildah's sets no $container), or no CAP_SYS_ADMIN
        echo "setup-system: cannot mount tracefs on /sys/kernel/tracing (a chroot, or no CAP_SYS_ADMIN?): uprobes and tracepoints will not work here; make test-quick does not need them" >&2
    fi
fi
