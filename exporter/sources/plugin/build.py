"""Compile the NCCL profiler plugin (plugin/*.c) into libnccl-profiler-exporter.so.

Source: the repository's top-level ``plugin/`` directory, or, in an installed
wheel, ``exporter/_plugin/`` inside the package.  Output:
``build/plugin/libnccl-profiler-exporter.so`` (or $NCCL_EXPORTER_PLUGIN_BUILD),
rebuilt when any source file is newer than the library.

``--arch aarch64`` cross-builds with Debian's aarch64-linux-gnu-gcc into
``build/plugin/aarch64/`` (docs/deploy.md, "Platforms").  Either library loads
with glibc >= 2.17 (plugin/glibc_floor.h, docs/plugin.md "Which glibc").
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import pathlib
import platform
import re
import subprocess
import sys

from exporter.cbuild import build_shared, cache_dir, writable

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
LIB_NAME = "libnccl-profiler-exporter.so"
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-Wall",
          "-fvisibility=hidden", "-fno-semantic-interposition"]
# libdl and libpthread by file name, kept although nothing resolves to them
# on this glibc (>= 2.34 has both in libc.so.6): where the plugin loads
# under a glibc before 2.34, dlopen and pthread_create are defined there
# (plugin/glibc_floor.h).
# -z nodelete: NCCL may dlclose the plugin while its thread runs (docs/plugin.md,
# "NCCL habits").
LIBS = ["-Wl,--no-as-needed", "-l:libdl.so.2", "-l:libpthread.so.0", "-Wl,--as-needed", "-Wl,-z,nodelete"]
# The architectures the plugin builds for, with the compiler of each when it
# is not the host's: Debian's cross gcc (scripts/setup-system.sh installs it).
CROSS_CC = {"aarch64": "aarch64-linux-gnu-gcc", "x86_64": "x86_64-linux-gnu-gcc"}
ARCHES = tuple(CROSS_CC)


def host_arch() -> str:
    return platform.machine()


# A file every plugin source directory has: how source_dir() recognises one.
# The sources themselves are every .c there (_sources), compiled into one library.
MARKER = "profiler_abi.h"


def source_dir() -> pathlib.Path:
    """The directory holding the plugin's .c files and their headers."""
    repo = REPO_ROOT / "plugin"
    if (repo / MARKER).is_file():
        return repo
    try:
        pkg = importlib.resources.files("exporter") / "_plugin"
        if pkg.joinpath(MARKER).is_file():
            return pathlib.Path(str(pkg))
    except (ModuleNotFoundError, TypeError):
        pass
    raise RuntimeError("profiler plugin sources not found (neither plugin/ nor exporter/_plugin/)")


def interface_versions() -> list[int]:
    """The NCCL profiler interface versions the plugin offers, newest first:
    the N of every `ncclProfiler_vN` struct its source exports. NCCL looks
    them up by name, newest it knows first (v5 .. v1 in NCCL 2.28.9:
    src/plugin/profiler.cc lines 70-81; 2.29 and later add v6, 2.31 v7:
    docs/plugin.md)."""
    text = "".join(f.read_text() for f in sorted(source_dir().glob("*.c")))
    found = re.findall(r"^EXPORT\s+const\s+\w+\s+ncclProfiler_v(\d+)\s*=", text, re.M)
    return sorted({int(v) for v in found}, reverse=True)


def default_outdir() -> pathlib.Path:
    env = os.environ.get("NCCL_EXPORTER_PLUGIN_BUILD")
    if env:
        return pathlib.Path(env)
    if (REPO_ROOT / "plugin" / MARKER).is_file() and writable(REPO_ROOT / "build" / "plugin"):
        return REPO_ROOT / "build" / "plugin"
    return cache_dir("plugin")


def _sources(src: pathlib.Path) -> list[pathlib.Path]:
    """Every .c (one library, no list kept anywhere) and every .h (dependencies)."""
    return sorted(list(src.glob("*.c")) + list(src.glob("*.h")))


def build_plugin(outdir: str | os.PathLike | None = None, arch: str | None = None) -> pathlib.Path:
    """Return the path of the plugin library, (re)building it if missing or stale.

    arch: None or the host's architecture builds with gcc into outdir (default:
    default_outdir()); another one of ARCHES cross-builds into outdir, by
    default default_outdir()/<arch>."""
    src = source_dir()
    cross = arch is not None and arch != host_arch()
    if arch is not None and arch not in ARCHES:
        raise RuntimeError(f"cannot build the plugin for {arch!r}: one of {', '.join(ARCHES)}")
    out = pathlib.Path(outdir) if outdir is not None else default_outdir() / (arch if cross else "")
    files = _sources(src)
    lib = build_shared(out / LIB_NAME, [f for f in files if f.suffix == ".c"], [*CFLAGS, "-I", str(src)],
                       LIBS, depends=[f for f in files if f.suffix != ".c"],
                       cc=CROSS_CC[arch] if cross else "gcc")
    return lib.resolve()


# The same library with sanitizers, for tests only (docs/plugin.md, "NCCL
# habits"): "address,undefined" (AddressSanitizer and UndefinedBehaviorSanitizer)
# or "thread" (ThreadSanitizer); any report aborts the process.
SANITIZE_CFLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
SANITIZER_RUNTIME = {"address,undefined": "libasan.so", "thread": "libtsan.so"}


def build_plugin_sanitized(outdir: str | os.PathLike, sanitize: str = "address,undefined") -> pathlib.Path:
    """The plugin built with -fsanitize=<sanitize> into outdir. A process that
    loads it must preload the sanitizer's runtime first (sanitizer_env)."""
    src = source_dir()
    files = _sources(src)
    flags = [f for f in CFLAGS if f not in ("-O2", "-g")] + SANITIZE_CFLAGS + [f"-fsanitize={sanitize}", "-I", str(src)]
    lib = build_shared(pathlib.Path(outdir) / LIB_NAME, [f for f in files if f.suffix == ".c"], flags,
                       LIBS, depends=[f for f in files if f.suffix != ".c"])
    return lib.resolve()


def sanitizer_env(sanitize: str = "address,undefined") -> dict[str, str]:
    """Environment for a process that dlopens the sanitized plugin: the
    runtime preloaded (it must come first), leak checks off (the interpreter's
    own allocations are not ours), the first report fatal."""
    runtime = subprocess.run(["gcc", f"-print-file-name={SANITIZER_RUNTIME[sanitize]}"], capture_output=True,
                             text=True, check=True).stdout.strip()
    return {"LD_PRELOAD": os.path.realpath(runtime),
            "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:exitcode=86",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87",
            "TSAN_OPTIONS": "halt_on_error=0:exitcode=0:report_signal_unsafe=0"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m exporter.sources.plugin.build",
                                description="Build the NCCL profiler plugin and print its path.")
    p.add_argument("--arch", choices=ARCHES, default=None,
                   help=f"target architecture (default: this host's, {host_arch()}); another one "
                        "cross-builds with Debian's <arch>-linux-gnu-gcc into build/plugin/<arch>/")
    p.add_argument("--outdir", default=None, help="directory for the library (default: see above)")
    a = p.parse_args(argv)
    try:
        print(build_plugin(a.outdir, a.arch))
    except RuntimeError as e:
        print(f"plugin build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
