"""Compiling a shared library of the project's own C with the system gcc, once
and again only when a source is newer: the simulated libnccl
(exporter/simulator/build.py) and the NCCL profiler plugin
(exporter/sources/plugin/build.py). Outside the data path's layers, so the
simulator and the sources may both use it.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import tempfile


def writable(path: pathlib.Path) -> bool:
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
        if writable(base / "nccl-exporter" / name):
            return base / "nccl-exporter" / name
    return pathlib.Path(tempfile.gettempdir()) / "nccl-exporter" / name


def build_shared(lib: pathlib.Path, sources: list[pathlib.Path], cflags: list[str],
                 libs: list[str] = (), depends: list[pathlib.Path] = (), cc: str = "gcc") -> pathlib.Path:
    """Compile `sources` with `cc` (gcc, or a cross gcc) into `lib` unless it
    is newer than every source and dependency; written to a temporary file
    and renamed, so a concurrent user never sees half a library. One-line
    RuntimeError on failure."""
    lib.parent.mkdir(parents=True, exist_ok=True)
    inputs = [*sources, *depends]
    if lib.exists() and all(lib.stat().st_mtime >= f.stat().st_mtime for f in inputs):
        return lib
    fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", suffix=".tmp", dir=lib.parent)
    os.close(fd)
    try:
        cmd = [cc, *cflags, "-o", tmp, *map(str, sources), *libs]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise RuntimeError(f"cannot build {lib.name}: {cc} not found ({e})") from None
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["(no output)"]
            errs = [line for line in lines if "error" in line] or lines
            raise RuntimeError(f"{cc} failed building {lib.name} (rc={proc.returncode}): {errs[0]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
