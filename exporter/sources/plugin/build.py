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

from exporter.cbuild import build_shared, cache_dir, writable

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
LIB_NAME = "libnccl-profiler-exporter.so"
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-std=gnu11", "-Wall",
          "-fvisibility=hidden", "-fno-semantic-interposition"]
# -z nodelete: NCCL may dlclose the plugin while its thread runs (docs/plugin.md, "NCCL habits")
LIBS = ["-ldl", "-Wl,-z,nodelete"]


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


if __name__ == "__main__":
    print(build_plugin())
