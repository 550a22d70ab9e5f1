"""Compile nccl_sim.c into a shared library named exactly ``libnccl.so.2``."""

from __future__ import annotations

import os
import pathlib

from exporter.cbuild import build_shared, cache_dir, writable

SOURCE = pathlib.Path(__file__).resolve().parent / "nccl_sim.c"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LIB_NAME = "libnccl.so.2"
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread"]


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
    return build_shared(out / LIB_NAME, [SOURCE], CFLAGS)


if __name__ == "__main__":
    print(build_library())
