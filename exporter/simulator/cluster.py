"""A simulated cluster: one network namespace per host, all attached by veth to
a Linux bridge in a "switch" namespace.

Addresses come only from the benchmarking ranges 198.18.0.0/24 (RFC 2544) and
2001:2::/64 (RFC 5180). Nothing is added to the root namespace: every veth is
created with both ends already inside cluster namespaces. Namespace names are
``ncclsim-<creator pid>-<seq>-{sw,h<i>}`` so that ``cleanup_stale()`` can tell
leftovers of dead creators from clusters still in use.

Rank processes run in the root pid and mount namespaces (``nsenter --net``),
so an agent in the root namespace sees them in /proc.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from exporter.simulator.netns import NETNS_DIR, PREFIX, _del_netns, _netns_list, _run, _steer_flows
from exporter.simulator.netns import cleanup_stale  # noqa: F401 - callers import it from here
from exporter.simulator.truth import load_truth

LOSS_TABLE = "ncclsim_loss"
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent

_seq = itertools.count()
_open: list["Cluster"] = []
_lock = threading.RLock()
_saved_handlers: dict[int, object] = {}
_atexit_registered = False


# ------------------------------------------------------------ signal safety --
def _close_all() -> None:
    with _lock:
        clusters = list(_open)
    for c in clusters:
        try:
            c.close()
        except Exception as e:  # noqa: BLE001 - best effort at exit  # pragma: no cover
            print(f"ncclsim: cleanup of {c.name} failed: {e}", file=sys.stderr)


def _on_signal(signum, frame):
    prev = _saved_handlers.get(signum, signal.SIG_DFL)
    _close_all()  # also restores the previous handlers (last cluster closed)
    if callable(prev):
        prev(signum, frame)
    elif prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(c: "Cluster") -> None:
    global _atexit_registered
    with _lock:
        _open.append(c)
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True
        if len(_open) == 1 and threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) == signal.SIG_IGN:
                    continue  # ignored (a background job's SIGINT): tearing down would not stop us
                try:
                    _saved_handlers[s] = signal.signal(s, _on_signal)
                except (ValueError, OSError):
                    pass


def _unregister(c: "Cluster") -> None:
    with _lock:
        if c in _open:
            _open.remove(c)
        if not _open and threading.current_thread() is threading.main_thread():
            for s, h in list(_saved_handlers.items()):
                try:
                    if signal.getsignal(s) is _on_signal:
                        signal.signal(s, h if h is not None else signal.SIG_DFL)
                except (ValueError, OSError):
                    pass
                _saved_handlers.pop(s, None)


# ------------------------------------------------------------------ cluster --
@dataclasses.dataclass
class Host:
    index: int
    netns: str
    addr: str
    addr6: str
    ifname: str = "eth0"




class Cluster:
    """``with Cluster(4) as c: c.popen(0, [...])`` -- hosts exist only inside the block.

    steer_flows: each link's packets on one CPU (see netns.py _steer_flows), for
    measurements that TCP's spurious retransmits would drown. Off by default:
    it also moves host i's packet processing onto CPU i mod ncpu, which a
    test that starves one CPU (tests/test_sched.py, test_analysis.py's
    "starved") would turn into a network stall of its own."""

    def __init__(self, nhosts: int, name: str | None = None, steer_flows: bool = False):
        if not 1 <= nhosts <= 250:
            raise ValueError("nhosts must be in [1, 250]")
        self.nhosts = nhosts
        self.steer_flows = steer_flows
        tag = name if name else str(next(_seq))
        if not tag.replace("_", "").isalnum():
            raise ValueError("name must be alphanumeric (underscores allowed)")
        self.name = f"{PREFIX}{os.getpid()}-{tag}"
        self.switch_ns = f"{self.name}-sw"
        self.hosts: list[Host] = [
            Host(i, f"{self.name}-h{i}", f"198.18.0.{i + 1}", f"2001:2::{i + 1:x}") for i in range(nhosts)
        ]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        self._closed = True

    # -- setup / teardown
    def __enter__(self) -> "Cluster":
        self.create()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def create(self) -> "Cluster":
        if not self._closed:
            return self
        self._closed = False
        _register(self)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _ns(self, ns: str, *argv: str, check: bool = True, input: str | None = None):  # noqa: A002 - subprocess.run's name
        return _run(["ip", "-n", ns, *argv], check=check, input=input)

    def _create(self) -> None:
        sw = self.switch_ns
        _run(["ip", "netns", "add", sw])
        self._made.append(sw)
        self._ns(sw, "link", "set", "lo", "up")
        self._ns(sw, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        self._ns(sw, "link", "set", "br0", "up")
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            self._made.append(h.netns)
            port = f"p{h.index}"
            # both ends are born inside cluster namespaces, never in the root one
            self._ns(sw, "link", "add", port, "type", "veth", "peer", "name", h.ifname, "netns", h.netns)
            self._ns(sw, "link", "set", port, "master", "br0")
            self._ns(sw, "link", "set", port, "up")
            self._ns(h.netns, "link", "set", "lo", "up")
            self._ns(h.netns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            self._ns(h.netns, "-6", "addr", "add", f"{h.addr6}/64", "dev", h.ifname, "nodad")
            self._ns(h.netns, "link", "set", h.ifname, "up")
        if self.steer_flows:
            _steer_flows(sw, {f"p{h.index}": h.index for h in self.hosts})
            for h in self.hosts:
                _steer_flows(h.netns, {h.ifname: h.index})

    def close(self) -> None:
        """Idempotent: kill our processes, delete every namespace we made."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    try:
                        p.kill()
                    except ProcessLookupError:
                        pass
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        errors = []
        for ns in reversed(self._made):
            if not _del_netns(ns) and ns in _netns_list():
                errors.append(ns)
        self._made.clear()
        _unregister(self)
        if errors:
            raise RuntimeError(f"could not delete namespaces: {errors}")

    # -- faults
    def set_loss(self, index: int, percent: int, into_only: bool = False) -> None:
        """Lose `percent`% of the packets on host `index`'s link, each way (IPv4 and IPv6);
        with `into_only`, only those on their way into the host.

        The drop is on the wire: in the switch's bridge, where the host's port
        forwards. Both ends' TCP then see real loss and retransmit (a drop on
        a host's own output hook would fail the send locally instead: no
        retransmit, only a stall)."""
        percent = int(percent)
        if not 0 <= percent <= 100:
            raise ValueError("percent must be in [0, 100]")
        table, port = f"{LOSS_TABLE}_h{index}", f"p{self.hosts[index].index}"
        rules = f"""
table bridge {table}
delete table bridge {table}
table bridge {table} {{
  chain wire {{
    type filter hook forward priority -10; policy accept;
    oifname "{port}" numgen random mod 100 < {percent} drop
    {"" if into_only else f'iifname "{port}" numgen random mod 100 < {percent} drop'}
  }}
}}
"""
        _run(["nsenter", f"--net={NETNS_DIR / self.switch_ns}", "nft", "-f", "-"], input=rules)

    def clear_loss(self, index: int) -> None:
        _run(["nsenter", f"--net={NETNS_DIR / self.switch_ns}", "nft", "delete", "table", "bridge",
              f"{LOSS_TABLE}_h{index}"], check=False)

    # -- processes
    def popen(self, index: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start argv inside host `index`'s network namespace (pid/mount namespaces unchanged)."""
        if self._closed:
            raise RuntimeError("cluster is closed")
        h = self.hosts[index]
        kw.setdefault("start_new_session", True)
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        p = subprocess.Popen(["nsenter", f"--net={NETNS_DIR / h.netns}", "--", *argv], env=full_env, **kw)
        self._procs.append(p)
        return p

    def exec(self, index: int, argv: list[str], **kw) -> subprocess.CompletedProcess:
        """Run argv to completion inside host `index` (capture_output, text)."""
        h = self.hosts[index]
        return subprocess.run(["nsenter", f"--net={NETNS_DIR / h.netns}", "--", *argv],
                              capture_output=True, text=True, **kw)


# --------------------------------------------------------------------- jobs --
@dataclasses.dataclass
class JobResult:
    returncodes: list[int | None]
    stdout: list[str]
    stderr: list[str]
    pids: list[int]
    truth: list[dict]
    elapsed_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)

    def summary(self) -> str:
        lines = [f"returncodes={self.returncodes} timed_out={self.timed_out} elapsed={self.elapsed_s:.1f}s"]
        for i, (o, e) in enumerate(zip(self.stdout, self.stderr)):
            tail = (o.strip().splitlines() or [""])[-1]
            lines.append(f"  rank {i}: {tail}" + (f" | stderr: {e.strip()[-400:]}" if e.strip() else ""))
        return "\n".join(lines)


class Job:
    """A running job: one rank per host. See start_job()."""

    def __init__(self, cluster: Cluster, procs: list[subprocess.Popen], out_paths, truth_dir: pathlib.Path):
        self.cluster = cluster
        self.procs = procs
        self.pids = [p.pid for p in procs]
        self._out = out_paths
        self.truth_dir = truth_dir
        self.t0 = time.monotonic()
        self.timed_out = False

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float = 120, fail_grace: float = 15) -> JobResult:
        """Wait for every rank; kill all on timeout, or `fail_grace` s after one rank fails."""
        deadline = time.monotonic() + timeout
        failed_at = None
        while True:
            rcs = self.poll()
            if all(rc is not None for rc in rcs):
                break
            now = time.monotonic()
            if failed_at is None and any(rc not in (None, 0) for rc in rcs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > fail_grace):
                self.timed_out = now > deadline
                self.kill()
                break
            time.sleep(0.05)
        return self.result()

    def result(self) -> JobResult:
        outs, errs = [], []
        for o, e in self._out:
            outs.append(o.read_text(errors="replace") if o.exists() else "")
            errs.append(e.read_text(errors="replace") if e.exists() else "")
        return JobResult([p.returncode for p in self.procs], outs, errs, self.pids,
                         load_truth(sorted(self.truth_dir.glob("rank*.jsonl"))),
                         time.monotonic() - self.t0, self.timed_out)


def start_job(cluster: Cluster, lib, workload: str, iterations: int, rendezvous_dir, truth_dir,
              count: int = 1024, compute_delay_ms: dict[int, int] | None = None, startup_delay_ms=0,
              python: str = sys.executable, ipv6: bool = False, extra_env: dict | None = None,
              nranks: int | None = None, extra_args: list[str] | None = None,
              rank_env: dict[int, dict] | None = None) -> Job:
    """Start one rank per host (rank i on host i) and return at once.

    lib: the libnccl.so.2 every rank loads, or a dict rank -> its own copy
    (an agent attached to one copy sees only those ranks, as one node's).

    startup_delay_ms: an int for every rank, or a dict rank -> ms.
    extra_args: more arguments for every rank (e.g. ["--sync-every", "0"]);
    rank_env: rank -> more environment for that rank only.
    """
    nranks = nranks or cluster.nhosts
    rdv = pathlib.Path(rendezvous_dir)
    tdir = pathlib.Path(truth_dir)
    rdv.mkdir(parents=True, exist_ok=True)
    tdir.mkdir(parents=True, exist_ok=True)
    for stale in rdv.glob("*.uid"):
        stale.unlink()
    compute_delay_ms = compute_delay_ms or {}
    procs, outs = [], []
    for i in range(nranks):
        h = cluster.hosts[i]
        sd = startup_delay_ms.get(i, 0) if isinstance(startup_delay_ms, dict) else startup_delay_ms
        truth = tdir / f"rank{i}.jsonl"
        if truth.exists():
            truth.unlink()
        lib_i = lib[i] if isinstance(lib, dict) else lib
        argv = [python, "-m", "exporter.simulator.rank", "--lib", str(pathlib.Path(lib_i).resolve()),
                "--rank", str(i), "--nranks", str(nranks), "--rendezvous", str(rdv.resolve()),
                "--workload", workload, "--iterations", str(iterations), "--count", str(count),
                "--compute-delay-ms", str(compute_delay_ms.get(i, 0)), "--startup-delay-ms", str(sd),
                "--seed", str(i), "--truth", str(truth.resolve()), *(extra_args or [])]
        env = {"NCCL_SIM_ADDR": h.addr6 if ipv6 else h.addr,
               # What torchrun sets for one process per host.
               "RANK": str(i), "WORLD_SIZE": str(nranks), "LOCAL_RANK": "0", "GROUP_RANK": str(i),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        if extra_env:
            env.update(extra_env)
        if rank_env and i in rank_env:
            env.update(rank_env[i])
        o, e = tdir / f"rank{i}.out", tdir / f"rank{i}.err"
        with open(o, "wb") as fo, open(e, "wb") as fe:
            procs.append(cluster.popen(i, argv, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                       cwd=str(REPO_ROOT)))
        outs.append((o, e))
    return Job(cluster, procs, outs, tdir)


def run_job(cluster: Cluster, lib, workload: str, iterations: int, rendezvous_dir, truth_dir,
            count: int = 1024, compute_delay_ms: dict[int, int] | None = None, startup_delay_ms=0,
            timeout: float = 120, python: str = sys.executable, ipv6: bool = False,
            extra_env: dict | None = None, nranks: int | None = None, extra_args: list[str] | None = None,
            rank_env: dict[int, dict] | None = None) -> JobResult:
    """Run a job to completion (or `timeout`) and collect exit codes, output and truth."""
    job = start_job(cluster, lib, workload, iterations, rendezvous_dir, truth_dir, count=count,
                    compute_delay_ms=compute_delay_ms, startup_delay_ms=startup_delay_ms, python=python,
                    ipv6=ipv6, extra_env=extra_env, nranks=nranks, extra_args=extra_args, rank_env=rank_env)
    return job.wait(timeout=timeout)
