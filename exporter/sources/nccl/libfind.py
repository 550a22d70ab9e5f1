"""Find the NCCL libraries that processes on this host have mapped.

A mapped file counts as NCCL when its basename looks like libnccl*.so*, or
when it is mapped executable and its .dynsym exports ncclAllReduce or
pncclAllReduce (NCCL linked statically into another library or binary).
One Library per distinct file (st_dev, st_ino of the file as the agent
opens it), however many processes or mount namespaces map it.
"""

from __future__ import annotations

import fnmatch
import logging
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

from exporter.sources.nccl import elf

__all__ = [
    "Library",
    "LibraryError",
    "LibraryWatcher",
    "find_libraries",
    "mapped_nccl_libraries",
    "is_nccl_library",
    "nccl_version",
]

log = logging.getLogger(__name__)

NCCL_MARKER_SYMBOLS = ("ncclAllReduce", "pncclAllReduce")
_NAME_PATTERN = "libnccl*.so*"


class LibraryError(Exception):
    """An explicitly named library cannot be used (one-line message)."""


@dataclass
class Library:
    path: str  # a path this agent can open (/proc/<pid>/root/... for other mount namespaces)
    dev: int  # st_dev of that path
    inode: int  # st_ino of that path
    pids: set[int] = field(default_factory=set)

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.inode)


def _name_matches(path: str) -> bool:
    return fnmatch.fnmatchcase(os.path.basename(path), _NAME_PATTERN)


def is_nccl_library(path: str) -> bool:
    """True when the ELF file at `path` is code for this host's CPU and
    exports ncclAllReduce or pncclAllReduce (elf.runs_here)."""
    if not elf.runs_here(path):
        return False
    try:
        funcs = elf.exported_functions(path)
    except (elf.ElfError, OSError):
        return False
    return any(s in funcs for s in NCCL_MARKER_SYMBOLS)


_VERSION_BANNER = re.compile(rb"NCCL version (\d+)\.(\d+)\.(\d+)")
_versions: dict[tuple[int, int, int], str] = {}


def nccl_version(path: str) -> str:
    """"MAJOR.MINOR.PATCH" of a libnccl file, from the banner NCCL prints at
    init ("NCCL version 2.32.3+cuda12.9": VERSION_STRING in NCCL's
    src/init.cc), read from the file without running it; "" when the file
    has none or cannot be read. Cached per file (device, inode, mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if key not in _versions:
        found = ""
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                at = m.find(b"NCCL version ")  # memchr-fast, also through a 450 MiB file
                while at >= 0 and not found:
                    match = _VERSION_BANNER.match(m, at)
                    if match:
                        found = ".".join(g.decode() for g in match.groups())
                    else:
                        at = m.find(b"NCCL version ", at + 1)
        except (OSError, ValueError):
            pass
        _versions[key] = found
    return _versions[key]


class _Scanner:
    """Scans /proc/*/maps; remembers per-file verdicts across scans."""

    def __init__(self, proc: str = "/proc"):
        self.proc = proc
        # (st_dev, st_ino, st_mtime_ns) -> exports NCCL?
        self._verdicts: dict[tuple[int, int, int], bool] = {}
        try:
            self._my_mnt_ns = os.readlink(os.path.join(proc, "self", "ns", "mnt"))
        except OSError:
            self._my_mnt_ns = None

    def _open_path(self, pid: int, path: str, ns_cache: dict[int, bool]) -> str:
        same = ns_cache.get(pid)
        if same is None:
            try:
                same = os.readlink(os.path.join(self.proc, str(pid), "ns", "mnt")) == self._my_mnt_ns
            except OSError:
                same = True  # cannot tell (no permission or gone): use the plain path
            ns_cache[pid] = same
        if same:
            return path
        return os.path.join(self.proc, str(pid), "root", path.lstrip("/"))

    def scan(self, pids: Iterable[int] | None = None) -> list[Library]:
        """NCCL libraries mapped by every process, or by the given ones."""
        libs: dict[tuple[int, int], Library] = {}
        # per-scan memo: (maps dev, maps inode, opened path) -> Library key or None
        memo: dict[tuple[str, int, str], tuple[int, int] | None] = {}
        ns_cache: dict[int, bool] = {}
        if pids is not None:
            entries = [str(p) for p in pids]
        else:
            try:
                entries = os.listdir(self.proc)
            except OSError:
                return []
        for name in entries:
            if not name.isdigit():
                continue
            pid = int(name)
            try:
                with open(os.path.join(self.proc, name, "maps"), "rb") as f:
                    data = f.read()
            except OSError:
                continue  # vanished, or a kernel thread we cannot read
            for line in data.splitlines():
                # start-end perms offset dev inode   pathname
                # Cheap filter first: executable mappings, or anything named libnccl.
                sp = line.find(b" ")
                if line[sp + 3:sp + 4] != b"x" and b"libnccl" not in line:
                    continue
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path_b = parts[5]
                if not path_b.startswith(b"/"):
                    continue
                perms, dev_s, inode_s = parts[1], parts[3], parts[4]
                if inode_s == b"0":
                    continue
                path = path_b.decode("utf-8", "surrogateescape")
                deleted = path.endswith(" (deleted)")
                named = _name_matches(path[:-10] if deleted else path)
                if not named and b"x" not in perms:
                    continue
                if deleted:
                    # The file was replaced on disk; the mapping is still readable here.
                    opath = os.path.join(self.proc, name, "map_files", parts[0].decode())
                else:
                    opath = self._open_path(pid, path, ns_cache)
                mkey = (dev_s.decode(), int(inode_s), "" if opath == path else opath)
                if mkey in memo:
                    key = memo[mkey]
                else:
                    key = memo[mkey] = self._classify(opath, named)
                    if key is not None and key not in libs:
                        libs[key] = Library(path=opath, dev=key[0], inode=key[1])
                if key is not None:
                    libs[key].pids.add(pid)
        return list(libs.values())

    def _classify(self, opath: str, named: bool) -> tuple[int, int] | None:
        try:
            st = os.stat(opath)
        except OSError:
            return None
        if named:
            return (st.st_dev, st.st_ino)
        vkey = (st.st_dev, st.st_ino, st.st_mtime_ns)
        verdict = self._verdicts.get(vkey)
        if verdict is None:
            verdict = self._verdicts[vkey] = is_nccl_library(opath)
        return (st.st_dev, st.st_ino) if verdict else None


def mapped_nccl_libraries(proc: str = "/proc") -> list[Library]:
    """Every distinct NCCL library mapped by a process right now."""
    return _Scanner(proc).scan()


class ProcessScanner(_Scanner):
    """Looks at the maps of the processes it is told about (the loader
    source's events), remembering per-file verdicts: scan(pids)."""


def find_libraries(explicit_paths: Iterable[str]) -> list[Library]:
    """Validate --nccl-lib paths; one Library per distinct file, in order."""
    out: dict[tuple[int, int], Library] = {}
    for p in explicit_paths:
        path = os.path.realpath(p)
        try:
            st = os.stat(path)
        except OSError as e:
            raise LibraryError(f"--nccl-lib {p}: {e.strerror or 'cannot stat'}") from None
        if not os.path.isfile(path):
            raise LibraryError(f"--nccl-lib {p}: not a regular file")
        if not elf.is_elf(path):
            raise LibraryError(f"--nccl-lib {p} is not an NCCL library: not an ELF file")
        if not elf.runs_here(path):
            raise LibraryError(f"--nccl-lib {p} is built for another CPU than this machine's ({os.uname().machine})")
        try:
            funcs = elf.exported_functions(path)
        except elf.ElfError as e:
            raise LibraryError(f"--nccl-lib {p} is not an NCCL library: {e}") from None
        if not any(n.startswith(("nccl", "pnccl")) for n in funcs):
            raise LibraryError(
                f"--nccl-lib {p} is not an NCCL library: no ncclAllReduce/pncclAllReduce "
                f"or other nccl* function exported"
            )
        out.setdefault((st.st_dev, st.st_ino), Library(path=path, dev=st.st_dev, inode=st.st_ino))
    return list(out.values())


class LibraryWatcher:
    """Background thread: calls callback(library) once per newly seen NCCL file.

    Every `interval` seconds it rescans all /proc/*/maps (a full rescan is
    cheap: per-file ELF verdicts are cached by (dev, inode, mtime), so a
    rescan costs one maps read per process plus one stat per distinct
    executable file). `extra_paths` (--nccl-lib) are validated with
    find_libraries() and reported first; a LibraryError propagates from
    the constructor.
    """

    def __init__(
        self,
        callback: Callable[[Library], None],
        interval: float = 1.0,
        extra_paths: Iterable[str] = (),
        proc: str = "/proc",
    ):
        self.callback = callback
        self.interval = interval
        self._extra = find_libraries(extra_paths)
        self._scanner = _Scanner(proc)
        self._seen: dict[tuple[int, int], Library] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nccl-libfind", daemon=True)
        self._lock = threading.Lock()

    @property
    def libraries(self) -> list[Library]:
        """Every library reported so far (pids as of the latest scan)."""
        with self._lock:
            return list(self._seen.values())

    def start(self) -> "LibraryWatcher":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "LibraryWatcher":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def scan_once(self) -> list[Library]:
        """One rescan; calls the callback for new files and returns them."""
        new = []
        found = self._scanner.scan()
        with self._lock:
            for lib in [*self._extra, *found]:
                if lib.key not in self._seen:
                    self._seen[lib.key] = lib
                    new.append(lib)
            self._extra = []
            current = {lib.key: lib.pids for lib in found}
            for key, lib in self._seen.items():
                lib.pids = set(current.get(key, ()))
        for lib in new:
            try:
                self.callback(lib)
            except Exception:  # a bad callback must not kill discovery
                log.exception("library callback failed for %s", lib.path)
        return new

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan_once()
            except Exception:
                log.exception("NCCL library scan failed")
            self._stop.wait(self.interval)
