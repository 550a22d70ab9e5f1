#!/usr/bin/env bash
# `make test-clean-room`: the README's install steps on a fresh Debian 12,
# then `make test-quick`. The fresh Debian 12 is the minimal root file system
# the image's build stage starts from (scripts/lib-debian.sh: mmdebstrap,
# variant minbase), in a buildah container under chroot isolation; the
# repository goes in as `git archive HEAD`, so nothing untracked or ignored
# (a .venv, build/) leaks in, and a step the README or the Makefile forgets
# fails here. Only test-quick runs inside: the whole suite needs BPF,
# network namespaces and root on the host, which a chroot does not give.
#
# Cached between runs, as safe to cache: the root file system (remade when
# its mmdebstrap arguments change, or with REFRESH=1), and the downloads
# only: apt's .deb files (checked against the signed archive each time) and
# pip's cache, under build/clean-room/. Nothing installed is kept: each run
# starts from the bare root file system.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEP=clean-room
. scripts/lib-debian.sh

[ "$(id -u)" -eq 0 ] || { echo "clean-room: must run as root (buildah, mmdebstrap)" >&2; exit 1; }
need_debs buildah mmdebstrap git
git diff --quiet HEAD 2>/dev/null || echo "clean-room: note: uncommitted changes are not tested (git archive HEAD)"

debian_rootfs bookworm "${MINBASE[@]}"
cache=$PWD/build/clean-room
mkdir -p "$cache/apt" "$cache/pip"
work=$(mktemp -d)
ctr=""
cleanup() {
    [ -n "$ctr" ] && buildah "${STORAGE[@]}" rm "$ctr" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$(date +%s)
git archive --format=tar --prefix=nccl-exporter/ -o "$work/src.tar" HEAD
ctr=$(buildah "${STORAGE[@]}" from --quiet scratch)
buildah "${STORAGE[@]}" add --quiet "$ctr" "$ROOTFS" / >/dev/null
buildah "${STORAGE[@]}" add --quiet "$ctr" "$work/src.tar" /root/ >/dev/null
host_ca
pip_cert=()
[ "${#HOST_CA[@]}" -eq 0 ] || pip_cert=("PIP_CERT=$HOST_CA_FILE")

# The README's Quick start, as a new user runs it on a fresh machine:
# make and git from Debian (the README's only hand-installed packages),
# then what `make test` runs before pytest.
echo "clean-room: in a fresh Debian 12 ($ROOTFS, commit $(git rev-parse --short HEAD)): apt-get install make git; make deps venv nccl-wheel plugin; make test-quick"
if ! buildah "${STORAGE[@]}" run --isolation chroot \
        -v "$cache/apt:/var/cache/apt/archives" -v "$cache/pip:/root/.cache/pip" "${HOST_CA[@]}" "$ctr" -- \
        env "${pip_cert[@]}" DEBIAN_FRONTEND=noninteractive bash -euo pipefail -c '
            cd /root/nccl-exporter
            apt-get update -qq && apt-get install -y -qq --no-install-recommends make git >/dev/null
            make deps venv nccl-wheel plugin
            make test-quick' > "$cache/last.log" 2>&1; then
    grep -v "^\(Selecting\|Preparing\|Unpacking\|Setting up\|Processing\|(Reading\)" "$cache/last.log" | tail -n 40 >&2
    echo "clean-room: FAIL after $(( $(date +%s) - started )) s (the whole log: $cache/last.log)" >&2
    exit 1
fi
tail -n 1 "$cache/last.log"
echo "clean-room: ok in $(( $(date +%s) - started )) s: the README's install steps suffice for make test-quick on a fresh Debian 12"
