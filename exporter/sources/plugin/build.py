"""Compile the NCCL profiler plugin (plugin/*.c) into libnccl-profiler-exporter.so.

Source: the repository's top-level ``plugin/`` directory, or, in an installed
wheel, ``exporter/_plugin/`` inside the package.  Output:
``build/plugin/libnccl-profiler-exporter.so`` (or $NCCL_EXPORTER_PLUGIN_BUILD),
rebuilt when any source file is newer than the library.
"""

from __future__ import annotations

import importlib.resources
import os
import pathlib
import subprocess

from exporter.cbuild import build_shared, cache_dir, writable

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
LIB_NAME = "libnccl-profiler-exporter.so"
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-Wall",
          "-fvisibility=hidden", "-fno-semantic-interposition"]
LIBS = ["-ldl"]


def source_dir() -> pathlib.Path:
    """The directory holding nccl_profiler.c and its headers."""
    repo = REPO_ROOT / "plugin"
    if (repo / "nccl_profiler.c").is_file():
        return repo
    try:
        pkg = importlib.resources.files("exporter") / "_plugin"
        if pkg.joinpath("nccl_profiler.c").is_file():
            return pathlib.Path(str(pkg))
    except (ModuleNotFoundError, TypeError):
        pass
    raise RuntimeError("profiler plugin sources not found (neither plugin/ nor exporter/_plugin/)")


def default_outdir() -> pathlib.Path:
    env = os.environ.get("NCCL_EXPORTER_PLUGIN_BUILD")
    if env:
        return pathlib.Path(env)
    if (REPO_ROOT / "plugin" / "nccl_profiler.c").is_file() and writable(REPO_ROOT / "build" / "plugin"):
        return REPO_ROOT / "build" / "plugin"
    return cache_dir("plugin")


def _sources(src: pathlib.Path) -> list[pathlib.Path]:
    return sorted(list(src.glob("*.c")) + list(src.glob("*.h")))


def build_plugin(outdir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of the plugin library, (re)building it if missing or stale."""
    src = source_dir()
    out = pathlib.Path(outdir) if outdir is not None else default_outdir()
    files = _sources(src)
    lib = build_shared(out / LIB_NAME, [f for f in files if f.suffix == ".c"], [*CFLAGS, "-I", str(src)],
                       LIBS, depends=[f for f in files if f.suffix != ".c"])
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


if __name__ == "__main__":
    print(build_plugin())
