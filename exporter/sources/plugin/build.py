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
import tempfile

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
    if (REPO_ROOT / "plugin" / "nccl_profiler.c").is_file() and _writable(REPO_ROOT / "build" / "plugin"):
        return REPO_ROOT / "build" / "plugin"
    return cache_dir("plugin")


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


def _sources(src: pathlib.Path) -> list[pathlib.Path]:
    return sorted(list(src.glob("*.c")) + list(src.glob("*.h")))


def build_plugin(outdir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return the path of the plugin library, (re)building it if missing or stale."""
    src = source_dir()
    out = pathlib.Path(outdir) if outdir is not None else default_outdir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / LIB_NAME
    files = _sources(src)
    if lib.exists() and all(lib.stat().st_mtime >= f.stat().st_mtime for f in files):
        return lib.resolve()
    fd, tmp = tempfile.mkstemp(prefix=".libnccl-profiler.", suffix=".tmp", dir=out)
    os.close(fd)
    try:
        cmd = ["gcc", *CFLAGS, "-I", str(src), "-o", tmp,
               *[str(f) for f in files if f.suffix == ".c"], *LIBS]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise RuntimeError(f"cannot build {LIB_NAME}: gcc not found ({e})") from None
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["(no output)"]
            errs = [l for l in lines if "error" in l] or lines
            raise RuntimeError(f"gcc failed building {LIB_NAME} (rc={proc.returncode}): {errs[0]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib.resolve()


if __name__ == "__main__":
    print(build_plugin())
