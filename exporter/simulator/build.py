"""Compile nccl_sim.c into a shared library named exactly ``libnccl.so.2``."""

from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile

SOURCE = pathlib.Path(__file__).resolve().parent / "nccl_sim.c"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
LIB_NAME = "libnccl.so.2"
CFLAGS = ["-O2", "-g", "-fPIC", "-shared", "-pthread"]


def default_outdir() -> pathlib.Path:
    """$NCCL_SIM_BUILD, else build/sim in a checkout, else a writable cache dir."""
    env = os.environ.get("NCCL_SIM_BUILD")
    if env:
        return pathlib.Path(env)
    if (REPO_ROOT / "pyproject.toml").is_file() and _writable(REPO_ROOT / "build" / "sim"):
        return REPO_ROOT / "build" / "sim"
    return cache_dir("sim")


def _writable(path: pathlib.Path) -> bool:
    """path exists and is writable, or can be created."""
    while not path.exists():
        if path.parent == path:
            return False
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def cache_dir(name: str) -> pathlib.Path:
    """Where an installed wheel builds: $XDG_CACHE_HOME or ~/.cache, else
    /var/cache, else the temporary directory (each + nccl-exporter/NAME)."""
    candidates = []
    if os.environ.get("XDG_CACHE_HOME"):
        candidates.append(pathlib.Path(os.environ["XDG_CACHE_HOME"]))
    if os.environ.get("HOME"):
        candidates.append(pathlib.Path(os.environ["HOME"]) / ".cache")
    candidates += [pathlib.Path("/var/cache"), pathlib.Path(tempfile.gettempdir())]
    for base in candidates:
        if _writable(base / "nccl-exporter" / name):
            return base / "nccl-exporter" / name
    return pathlib.Path(tempfile.gettempdir()) / "nccl-exporter" / name


def build_library(outdir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of libnccl.so.2, (re)building it if missing or stale."""
    out = pathlib.Path(outdir) if outdir is not None else default_outdir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / LIB_NAME
    if lib.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime:
        return lib
    fd, tmp = tempfile.mkstemp(prefix=".libnccl.", suffix=".tmp", dir=out)
    os.close(fd)
    try:
        cmd = ["gcc", *CFLAGS, "-o", tmp, str(SOURCE)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise RuntimeError(f"cannot build {LIB_NAME}: gcc not found ({e})") from None
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])
            errs = [l for l in first if "error" in l] or first
            raise RuntimeError(f"gcc failed building {LIB_NAME} (rc={proc.returncode}): {errs[0]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


if __name__ == "__main__":
    print(build_library())
