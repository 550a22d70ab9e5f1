"""Compile the simulator's C (nccl_sim/: one header, a file per concern) into
one shared library named exactly ``libnccl.so.2``."""

from __future__ import annotations

import os
import pathlib

from exporter.cbuild import build_shared, cache_dir, writable

SOURCE_DIR = pathlib.Path(__file__).resolve().parent / "nccl_sim"
SOURCES = sorted(SOURCE_DIR.glob("*.c"))
HEADERS = sorted(SOURCE_DIR.glob("*.h"))
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LIB_NAME = "libnccl.so.2"
# hidden by default: only the EXPORT names (NCCL's API) leave the library, as
# when everything was one file of static functions
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden"]


def default_outdir() -> pathlib.Path:
    """$NCCL_SIM_BUILD, else build/sim in a checkout, else a writable cache dir."""
    env = os.environ.get("NCCL_SIM_BUILD")
    if env:
        return pathlib.Path(env)
    if (REPO_ROOT / "pyproject.toml").is_file() and writable(REPO_ROOT / "build" / "sim"):
        return REPO_ROOT / "build" / "sim"
    return cache_dir("sim")


def build_library(outdir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of libnccl.so.2, (re)building it if missing or stale."""
    out = pathlib.Path(outdir) if outdir is not None else default_outdir()
    return build_shared(out / LIB_NAME, SOURCES, CFLAGS, depends=HEADERS)


if __name__ == "__main__":
    print(build_library())
