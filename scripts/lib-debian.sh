# shellcheck shell=bash
# Sourced by scripts/build-image.sh and scripts/test-clean-room.sh: Debian 12
# root file systems from mmdebstrap (Debian's package registry only, no
# image registry), and the base images the Dockerfile names made from them.
#
#   need_debs buildah mmdebstrap          # apt-get what is missing
#   debian_rootfs NAME [mmdebstrap args]  # -> build/image/rootfs/NAME.tar (cached)
#   base_images                           # debian:bookworm{,-slim} in $STORAGE
#   host_ca                               # HOST_CA=(-v ...) where pip needs the host's CAs
#
# The callers set -euo pipefail and run from the repository root, as root.

OUT=${OUT:-build/image}
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# One buildah store for the image, its base images and the clean room: vfs
# (works on any file system, also inside a container), chroot isolation.
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
STORAGE=(--root "$PWD/$OUT/storage" --runroot "$PWD/$OUT/run" --storage-driver vfs)

need_debs() {
    local missing=() pkg
    for pkg in "$@"; do
        [ "$(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null || true)" = installed ] || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    echo "${STEP:-image}: installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# A Debian $SUITE root file system as a tar, rebuilt only when its
# mmdebstrap arguments (the cache key) change, or with REFRESH=1 (security
# updates). Safe to cache: it is a pure function of its arguments and the
# archive's state, and REFRESH=1 takes the archive's new state.
debian_rootfs() {
    local name=$1; shift
    local tar=$OUT/rootfs/$name.tar key="$SUITE $MIRROR $* v3"
    mkdir -p "$OUT/rootfs"
    if [ "${REFRESH:-0}" = 1 ] || [ ! -f "$tar" ] || [ "$(cat "$tar.key" 2>/dev/null)" != "$key" ]; then
        echo "${STEP:-image}: Debian $SUITE root file system '$name' (mmdebstrap, about a minute)"
        mmdebstrap --quiet "$@" "$SUITE" "${tar%.tar}.tmp.tar" "$MIRROR" > "$OUT/rootfs/$name.log" 2>&1 \
            || { tail -n 20 "$OUT/rootfs/$name.log" >&2; exit 1; }
        mv "${tar%.tar}.tmp.tar" "$tar"
        echo "$key" > "$tar.key"
    fi
    ROOTFS=$tar
}

# Debian's minimal system, as Debian's own images are made: variant minbase
# (essential packages and apt); merged /usr by mmdebstrap's hook (no usrmerge
# package, and no perl, which it pulls in).
MINBASE=(--variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
# -slim, as debian:bookworm-slim: no documentation, man pages or locales,
# now or in any package installed later (mmdebstrap keeps the --dpkgopt
# lines in /etc/dpkg/dpkg.cfg.d/).
SLIM=(--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*'
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*'
      --dpkgopt='path-exclude=/usr/share/info/*')

# The two names the Dockerfile's FROM lines use, made here from Debian's
# package registry and tagged as Docker Hub's, so that `buildah bud
# --pull=never` pulls nothing; elsewhere `docker build .` pulls the real ones.
base_images() {
    local name tag ctr
    for name in bookworm bookworm-slim; do
        if [ "$name" = bookworm ]; then debian_rootfs "$name" "${MINBASE[@]}"; else debian_rootfs "$name" "${MINBASE[@]}" "${SLIM[@]}"; fi
        tag=docker.io/library/debian:$name
        key=$(cat "$ROOTFS.key")
        if [ "$(buildah "${STORAGE[@]}" inspect --type image --format '{{index .ImageAnnotations "org.nccl-exporter.rootfs"}}' "$tag" 2>/dev/null || true)" != "$key" ]; then
            echo "${STEP:-image}: base image $tag from $ROOTFS"
            ctr=$(buildah "${STORAGE[@]}" from --quiet scratch)
            buildah "${STORAGE[@]}" add --quiet "$ctr" "$ROOTFS" / >/dev/null
            buildah "${STORAGE[@]}" config --annotation "org.nccl-exporter.rootfs=$key" --cmd bash \
                --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
            buildah "${STORAGE[@]}" commit --quiet --rm "$ctr" "$tag" >/dev/null
        fi
    done
}

# Where PyPI is reached through a TLS-inspecting proxy, the site's own CAs
# are in /usr/local/share/ca-certificates/ and the host's bundle has them:
# pip in a build or a chroot trusts that bundle, mounted (never copied in)
# at $HOST_CA_FILE. Elsewhere HOST_CA is empty and pip uses its own.
HOST_CA_FILE=/etc/ssl/host-ca-certificates.crt
host_ca() {
    HOST_CA=()
    if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
        HOST_CA=(-v "/etc/ssl/certs/ca-certificates.crt:$HOST_CA_FILE:ro")
    fi
}
