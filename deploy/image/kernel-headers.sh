#!/bin/sh
# The image's fallback kernel headers (entrypoint.sh), made in the
# Dockerfile's build stage: the newest Debian linux-headers-* installed there,
# merged into one flat tree (-common's include/ and arch/<arch>/, then the
# flavour's generated headers and .config on top: BCC_KERNEL_SOURCE names a
# flat tree), xz-compressed to $1.
set -eu
out=$1
flavour=$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-arm64 2>/dev/null | sort -V | tail -n 1)
common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1)
[ -n "$flavour" ] && [ -n "$common" ] || { echo "kernel-headers: no Debian linux-headers-* in /usr/src" >&2; exit 1; }
case "$flavour" in *-amd64) arch=x86 ;; *) arch=arm64 ;; esac
tmp=$(mktemp -d)
mkdir -p "$tmp/arch"
cp -a "$common/Makefile" "$common/include" "$tmp/"
cp -a "$common/arch/$arch" "$tmp/arch/"
cp -a "$flavour/.config" "$flavour/include" "$flavour/arch" "$tmp/"
basename "$flavour" | sed 's/^linux-headers-//' > "$tmp/VERSION"
tar -C "$tmp" -cf - . | xz -T0 -6 > "$out"
rm -rf "$tmp"
