#!/usr/bin/env bash
# `make image`: build the top-level Dockerfile with buildah (vfs storage
# driver, chroot isolation) into build/image/storage. The Dockerfile's two
# FROM images (debian:bookworm, debian:bookworm-slim) are made first from
# Debian's package registry with mmdebstrap (scripts/lib-debian.sh), so no
# image registry is reached; pip in the build stage uses PyPI. Idempotent: the
# root file systems are cached under build/image/rootfs/ and remade only when
# their mmdebstrap arguments change. docs/deploy.md, "The image".
#
#   make image                    # -> $IMAGE:<version> (IMAGE: the Makefile)
#   REFRESH=1 make image          # remake the Debian bases (security updates)
#   make push-image               # push it (after `buildah login ghcr.io`)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/lib-debian.sh

: "${IMAGE:?IMAGE (the registry path, without the tag) comes from the Makefile: run make image}"
PY=.venv/bin/python
[ "$(id -u)" -eq 0 ] || { echo "image: must run as root (buildah, mmdebstrap)" >&2; exit 1; }
need_debs buildah mmdebstrap
[ -x "$PY" ] || { echo "image: $PY missing: run 'make venv' first" >&2; exit 1; }
VERSION=$($PY -c 'import exporter; print(exporter.__version__)')
REF=$IMAGE:${VERSION//+/-}  # an image tag has no '+'

if [ "${1:-}" = --push ]; then
    echo "image: pushing $REF"
    exec buildah "${STORAGE[@]}" push "$REF" "docker://$REF"
fi

base_images

# pip in the build stage: the host's CAs where a proxy needs them
host_ca
CA=()
[ "${#HOST_CA[@]}" -eq 0 ] || CA=("${HOST_CA[@]}" --build-arg "PIP_CERT=$HOST_CA_FILE")

# No --layers: with vfs every cached layer is a full copy of the file system;
# the slow inputs (the Debian bases) are cached instead.
echo "image: buildah bud -> $REF (a few minutes: apt and pip)"
started=$(date +%s)
buildah "${STORAGE[@]}" bud --quiet --isolation chroot --pull=never --build-arg "VERSION=$VERSION" "${CA[@]}" \
    -f Dockerfile -t "$REF" . > "$OUT/bud.log" 2>&1 || { tail -n 30 "$OUT/bud.log" >&2; exit 1; }
# vfs keeps a full copy per layer: drop the images this build replaced
buildah "${STORAGE[@]}" rmi --prune >/dev/null 2>&1 || true
size=$(buildah "${STORAGE[@]}" images --format '{{.Size}}' "$REF" | head -n 1)
echo "image: built $REF ($size) in $(( $(date +%s) - started )) s; push it: make push-image; save it: buildah ${STORAGE[*]} push $REF oci-archive:nccl-exporter-$VERSION.tar"
