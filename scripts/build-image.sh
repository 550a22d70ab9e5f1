#!/usr/bin/env bash
# `make image`: build nccl-exporter's OCI image with buildah (vfs storage
# driver, chroot isolation), from Debian's package registry: no base image
# is pulled. Idempotent; each step is cached under build/image/ and redone
# only when its inputs change. docs/deploy.md, "The image".
#
#   scripts/build-image.sh            # -> localhost/nccl-exporter:<version>
#   REFRESH=1 scripts/build-image.sh  # rebuild the Debian root file system (security updates)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OUT=build/image
CTX=$OUT/context
PY=.venv/bin/python
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# What `run` needs at run time, and nothing to build with: python3 and its
# venv module, Debian's BCC (python3-bpfcc: libbcc with LLVM and clang),
# ca-certificates (OTLP over TLS), xz-utils (the kernel-header fallback).
PACKAGES=python3,python3-venv,python3-bpfcc,ca-certificates,xz-utils
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
STORAGE=(--root "$PWD/$OUT/storage" --runroot "$PWD/$OUT/run" --storage-driver vfs)

step() { echo "image: $*"; }
[ "$(id -u)" -eq 0 ] || { echo "image: must run as root (buildah, mmdebstrap)" >&2; exit 1; }
missing=()
for pkg in buildah mmdebstrap; do
    [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)" = installed ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    step "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -x "$PY" ] || { echo "image: $PY missing: run 'make venv' first" >&2; exit 1; }
VERSION=$($PY -c 'import exporter; print(exporter.__version__)')
IMAGE=${IMAGE:-localhost/nccl-exporter:${VERSION//+/-}}  # an image tag has no '+'
mkdir -p "$CTX"

# 1. The Debian root file system (cached: rebuilt when the package list
#    changes, or with REFRESH=1). Trimmed to what runs: the merged-usr hook
#    (no usrmerge package, and no perl, which it pulls in); no docs, man
#    pages, locales; apt removed (the image is rebuilt, not upgraded in
#    place); no byte-code caches (13 MB: Python compiles in memory at start,
#    under a second); no glibc gconv modules (8 MB; Python has its own codecs).
key="$SUITE $PACKAGES $MIRROR v2"
if [ "${REFRESH:-0}" = 1 ] || [ ! -f "$OUT/rootfs.tar" ] || [ "$(cat "$OUT/rootfs.key" 2>/dev/null)" != "$key" ]; then
    step "Debian $SUITE root file system with $PACKAGES (mmdebstrap, about a minute)"
    mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='chroot "$1" dpkg --purge apt libapt-pkg6.0 >/dev/null' \
        --customize-hook='find "$1"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} +' \
        --customize-hook='rm -rf "$1"/usr/lib/x86_64-linux-gnu/gconv "$1"/var/cache/apt "$1"/var/lib/apt "$1"/var/log/*' \
        "$SUITE" "$OUT/rootfs.tmp.tar" "$MIRROR" > "$OUT/mmdebstrap.log" 2>&1 \
        || { tail -n 20 "$OUT/mmdebstrap.log" >&2; exit 1; }
    mv "$OUT/rootfs.tmp.tar" "$OUT/rootfs.tar"
    echo "$key" > "$OUT/rootfs.key"
fi
ln -f "$OUT/rootfs.tar" "$CTX/rootfs.tar"

# 2. The agent and its dependencies as wheels; the profiler plugin.
step "wheels (pip wheel .)"
rm -rf "$CTX/wheels"
$PY -m pip wheel --quiet --wheel-dir "$CTX/wheels" . 2>&1 | grep -v "^WARNING: Location" || true
ls "$CTX"/wheels/nccl_exporter-*.whl >/dev/null
cp "$($PY -m exporter.sources.plugin.build)" "$CTX/libnccl-profiler-exporter.so"
cp deploy/image/entrypoint.sh "$CTX/entrypoint.sh"

# 3. The fallback kernel headers: the newest Debian linux-headers-*-amd64 on
#    this host (make deps installs them), merged into one tree (-common's
#    include/ and arch/x86/, then -amd64's generated headers and .config on
#    top): BCC_KERNEL_SOURCE names a flat tree.
build_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
common_dir=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
[ -n "$build_dir" ] && [ -n "$common_dir" ] || { echo "image: no Debian kernel headers in /usr/src: run 'make deps'" >&2; exit 1; }
hkey="$build_dir $common_dir flat"
if [ ! -f "$OUT/kernel-headers.tar.xz" ] || [ "$(cat "$OUT/kernel-headers.key" 2>/dev/null)" != "$hkey" ]; then
    step "kernel headers $(basename "$build_dir") (xz, about 30 s)"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/arch"
    cp -a "$common_dir"/{Makefile,include} "$tmp/"
    cp -a "$common_dir/arch/x86" "$tmp/arch/"
    cp -a "$build_dir"/{.config,include,arch} "$tmp/"
    basename "$build_dir" | sed 's/^linux-headers-//' > "$tmp/VERSION"
    tar -C "$tmp" -cf - . | xz -T0 -6 > "$OUT/kernel-headers.tar.xz.tmp"
    mv "$OUT/kernel-headers.tar.xz.tmp" "$OUT/kernel-headers.tar.xz"
    echo "$hkey" > "$OUT/kernel-headers.key"
fi
ln -f "$OUT/kernel-headers.tar.xz" "$CTX/kernel-headers.tar.xz"

# 4. The image (~40 s). No --layers: with vfs every cached layer is a full
#    copy of the file system; the slow inputs above are cached instead.
step "buildah bud -> $IMAGE"
started=$(date +%s)
buildah "${STORAGE[@]}" bud --quiet --isolation chroot \
    --label "org.opencontainers.image.version=$VERSION" \
    --label "org.opencontainers.image.title=nccl-exporter" \
    --label "org.opencontainers.image.source=https://github.com/nccl-exporter/nccl-exporter" \
    -f deploy/image/Containerfile -t "$IMAGE" "$CTX" >/dev/null
# vfs keeps a full copy per layer: drop the images this build replaced
buildah "${STORAGE[@]}" rmi --prune >/dev/null 2>&1 || true
size=$(buildah "${STORAGE[@]}" images --format '{{.Size}}' "$IMAGE" | head -n 1)
step "built $IMAGE ($size) in $(( $(date +%s) - started )) s; save it: buildah ${STORAGE[*]} push $IMAGE oci-archive:nccl-exporter-$VERSION.tar"
