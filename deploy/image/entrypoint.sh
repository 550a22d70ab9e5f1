#!/bin/sh
# nccl-exporter's entry point in its image: choose the kernel headers BCC
# compiles the probes against, then run `nccl-exporter "$@"`.
#
# 1. the host's: /lib/modules/$(uname -r)/build, mounted from the host
#    (with /usr/src, where Debian and Ubuntu point it);
# 2. the kernel's own: /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS), which
#    BCC unpacks by itself;
# 3. else the image's Debian 12 headers (linux-headers-*-amd64 of the build
#    host), unpacked into /tmp: the programs take their data from tracepoint
#    arguments and uprobe registers, never from kernel struct layouts, so
#    another kernel version's headers compile them (docs/deploy.md).
set -eu
release=$(uname -r)
case "${1:-}" in run|trace|check|demo) compiles=1 ;; *) compiles=0 ;; esac
if [ "$compiles" = 1 ] && [ -z "${BCC_KERNEL_SOURCE:-}" ] && [ ! -d "/lib/modules/$release/build/include" ] \
        && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
    dir=/tmp/nccl-exporter-kernel-headers
    if [ ! -d "$dir/include" ]; then
        mkdir -p "$dir.tmp"
        tar -C "$dir.tmp" -xJf /opt/nccl-exporter/kernel-headers.tar.xz
        rm -rf "$dir" && mv "$dir.tmp" "$dir"
    fi
    export BCC_KERNEL_SOURCE="$dir"
    echo "nccl-exporter-entrypoint: no kernel headers for $release on the host; using the image's ($(cat "$dir/VERSION")) via BCC_KERNEL_SOURCE" >&2
fi
exec /opt/nccl-exporter/venv/bin/nccl-exporter "$@"
