"""Expiry of per-owner TCP and sched entries (bpf/tcp.c's tcp_links /
tcp_srtt, bpf/sched.c's sched_stats): real traffic of short-lived traced
processes in a netns cluster, the agent's rule applied with a short TTL
(OwnerExpiry, docs/metrics.md "Series lifecycle and overflow").

* an ended process's entries leave the kernel maps after the TTL, its
  series leave /metrics with them (no live owner shares the label set),
  and entries stay bounded over repeated jobs;
* a label set shared with a living owner never decreases: the ended owner's
  counts are kept in the set's retired total, and the set vanishes whole
  once its last owner has been gone for the TTL;
* an ended owner keeps the rank label it had while alive.

`now` is passed explicitly: the TTL is simulated, no sleeping.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
import time

import pytest

from exporter.records import metrics
from exporter.simulator.cluster import Cluster
from exporter.sinks.prometheus import sched_families, tcp_families
from exporter.sources.nccl.probes import NcclProbes
from exporter.records.events import TcpLink
from exporter.sources.expiry import OwnerExpiry

needs_root = pytest.mark.usefixtures("bpf")  # markers, root and the heavy lock: conftest

TTL = 5.0
BASE_PORT = 5101  # outside the ephemeral range: the link's port label

# A traced server that aborts its connection (RST: unread data) and a client
# that sends and receives the reset; "stay" keeps the server alive afterwards.
PEER = textwrap.dedent("""
    import socket, sys
    role, addr, port, stay = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "stay"
    sys.stdin.readline()              # traced from here on
    if role == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port)); s.listen(1)
        print("ready", flush=True)
        c, _ = s.accept()
        c.sendall(b"y" * 100)         # an RTT sample on the client
        c.recv(1)
        c.close(); s.close()          # unread data: close() aborts with a RST
        print("done", flush=True)
        if stay:
            sys.stdin.readline()
    else:
        c = socket.create_connection((addr, port))
        c.recv(100)
        c.sendall(b"x" * 1000)
        try:
            while c.recv(1000):
                pass
        except ConnectionResetError:
            pass
        print("reset", flush=True)
""")


@pytest.fixture(scope="module")
def probes(simulator_lib):
    p = NcclProbes()
    try:
        p.attach(str(simulator_lib))
        yield p
    finally:
        p.close()


class Ranks:
    """A process table's rank_of: like the agent's, it forgets ended processes
    at the end of each prune (forget_dead), so their rank must be frozen by
    the sources before that."""

    def __init__(self):
        self.rank: dict[int, int] = {}

    def __call__(self, pid):
        return self.rank.get(pid)

    def forget_dead(self):
        self.rank = {p: r for p, r in self.rank.items() if os.path.exists(f"/proc/{p}")}

    def label(self, pid) -> str:
        r = self(pid) if pid else None
        return "" if r is None else str(r)


def exchange(cluster, probes, ranks, port, stay=False):
    """One reset exchange between host 1 (server, rank 1) and host 0 (client,
    rank 0); returns (server, client), the client ended, the server ended
    unless `stay`."""
    srv = cluster.hosts[1]
    procs = []
    try:
        for i, role in ((1, "server"), (0, "client")):
            p = cluster.popen(i, [sys.executable, "-c", PEER, role, srv.addr, str(port),
                                  "stay" if stay and role == "server" else "-"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            probes.trace_process(p.pid, i)
            ranks.rank[p.pid] = i
            p.stdin.write("go\n")
            p.stdin.flush()
            if role == "server":
                assert p.stdout.readline().strip() == "ready"
        server, client = procs
        assert client.stdout.readline().strip() == "reset"
        assert server.stdout.readline().strip() == "done"
        assert client.wait(timeout=30) == 0
        if not stay:
            assert server.wait(timeout=30) == 0
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise
    return server, client


def prune(tcp, sched, ranks, now):
    """The agent's prune: the sources' expiry, then the process table forgets."""
    tcp.expire_owners(TTL, ranks.label, now=now)
    sched.expire_owners(TTL, ranks.label, now=now)
    ranks.forget_dead()


def owned(tcp, pids) -> list:
    return [r for r in tcp.links() + tcp.srtt() if r.owner in pids]


def tcp_values(tcp, ranks, port) -> dict:
    """(family, labels...) -> value of every TCP sample of `port`."""
    out = {}
    for f in tcp_families("n1", tcp, ranks):
        for s in f.samples:
            if s.labels.get("port") == str(port):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sched_values(sched, ranks, rank: str) -> dict:
    out = {}
    for f in sched_families("n1", sched, ranks):
        for s in f.samples:
            if s.labels.get("rank") == rank:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def assert_not_lower(before: dict, after: dict, where: str) -> None:
    """Every series of `before` is still there in `after`, at least as high."""
    lower = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) is None or after[k] < v}
    assert not lower, f"{where}: series went down or vanished: {lower}"


@needs_root
def test_ended_owners_expire_after_ttl_and_stay_bounded(probes, tcp, sched):
    ranks = Ranks()
    per_job, left = [], []
    with Cluster(2, name="tcpexp") as cluster:
        for j in range(5):
            port = BASE_PORT + j
            server, client = exchange(cluster, probes, ranks, port)
            pids = {server.pid, client.pid}
            tcp.poll(50)
            mine = owned(tcp, pids)
            assert any(r.owner == server.pid and getattr(r, "resets_sent", 0) == 1 for r in mine), mine
            per_job.append(len(mine))
            now = time.monotonic()
            # First prune after the end: the owners are found gone, their rank frozen.
            prune(tcp, sched, ranks, now)
            assert len(owned(tcp, pids)) == len(mine), "deleted before the TTL"
            vals = tcp_values(tcp, ranks, port)
            got = {(dict(k[1]).get("direction"), dict(k[1])["rank"]): v for k, v in vals.items()
                   if k[0] == metrics.TCP_RESETS}
            assert got == {("sent", "1"): 1, ("received", "0"): 1}, "an ended owner keeps its rank"
            # Half the TTL: still there.
            prune(tcp, sched, ranks, now + TTL / 2)
            assert len(owned(tcp, pids)) == len(mine)
            # After the TTL: gone from the kernel and from /metrics.
            prune(tcp, sched, ranks, now + TTL + 0.1)
            assert owned(tcp, pids) == []
            assert tcp_values(tcp, ranks, port) == {}
            assert not [s for s in sched.stats() if s.pid in pids]
            left.append(sum(1 for r in tcp.links() + tcp.srtt() if r.owner))
    print(f"\nentries of each job's owners before expiry: {per_job}; owned entries after: {left}; "
          f"retired label sets: {len(tcp.expiry.retired)}")
    assert all(n == 0 for n in left)
    assert not tcp.expiry.retired and not tcp.expiry.gone


@needs_root
def test_label_set_shared_with_a_living_owner_never_decreases(probes, tcp, sched):
    ranks = Ranks()
    port = BASE_PORT + 10
    history = []
    with Cluster(2, name="tcpexq") as cluster:
        # A living rank-1 server and, later, an ended one on the same link.
        living, c0 = exchange(cluster, probes, ranks, port, stay=True)
        try:
            ended, c1 = exchange(cluster, probes, ranks, port)
            tcp.poll(50)
            t = time.monotonic()
            for dt in (0.0, TTL / 2, TTL + 0.1, TTL + 3):
                prune(tcp, sched, ranks, t + dt)
                history.append((tcp_values(tcp, ranks, port), sched_values(sched, ranks, "1")))
            sent = [v for k, v in history[-1][0].items()
                    if k[0] == metrics.TCP_RESETS and dict(k[1]).get("direction") == "sent"]
            assert sent == [2], history[-1][0]  # both servers' resets, one label set
            # The ended server's entries left the kernel; the living one's stay.
            assert owned(tcp, {ended.pid}) == [] and owned(tcp, {living.pid})
            assert not [s for s in sched.stats() if s.pid == ended.pid]
            # The clients (rank 0) shared no set with a living owner: gone whole.
            assert not [k for k in history[-1][0] if dict(k[1])["rank"] == "0"]
            living.stdin.write("end\n")
            living.stdin.flush()
            assert living.wait(timeout=30) == 0
        finally:
            if living.poll() is None:
                living.kill()
        t = time.monotonic()
        for dt in (0.0, TTL / 2):
            prune(tcp, sched, ranks, t + dt)
            history.append((tcp_values(tcp, ranks, port), sched_values(sched, ranks, "1")))
    # While rank 1's sets exist, nothing in them goes down (TCP and sched).
    rank1 = [({k: v for k, v in tv.items() if dict(k[1])["rank"] == "1"}, sv) for tv, sv in history]
    for i in range(1, len(rank1)):
        assert_not_lower(rank1[i - 1][0], rank1[i][0], f"tcp step {i}")
        assert_not_lower(rank1[i - 1][1], rank1[i][1], f"sched step {i}")
    assert rank1[-1][1], "the traced servers' scheduler stats"
    # The last owner gone for the TTL: the whole set vanishes, retired total included.
    prune(tcp, sched, ranks, t + TTL + 0.1)
    assert tcp_values(tcp, ranks, port) == {}
    assert sched_values(sched, ranks, "1") == {}
    assert owned(tcp, {living.pid, ended.pid, c0.pid, c1.pid}) == []
    assert not tcp.expiry.retired and not sched.expiry.retired


def test_owner_expiry_rule_without_bpf(tmp_path):
    """OwnerExpiry alone, on a fake /proc: owner 0 expires when idle for the TTL, an expired
    owner of a living set is folded into the retired total, a set whose
    owners are all gone for the TTL vanishes whole, and an entry that comes
    back for a forgotten owner starts a new series."""
    proc = tmp_path
    for pid in (10, 11):
        (proc / str(pid)).mkdir()

    def link(owner, n):
        return TcpLink(family=2, saddr="a", daddr="b", port=1, owner=owner, retransmits=n, failures=0,
                       resets_sent=0, resets_received=0)

    class Key(ctypes.Structure):  # as BCC's map keys: ctypes, bytes() of it
        _fields_ = [("value", ctypes.c_uint32)]

    e = OwnerExpiry()
    ranks = {10: "1", 11: "1", 12: "2"}.get
    kernel = {10: link(10, 5), 11: link(11, 3), 12: link(12, 7), 0: link(0, 1)}

    def step(now):
        entries = [("tcp_links", Key(o), o, ("a", "b", "1"), r) for o, r in kernel.items()]
        for _name, k in e.expire(entries, 10.0, now, lambda pid: ranks(pid) or "", proc=str(proc)):
            del kernel[k.value]
        out = {}
        for o, r in kernel.items():
            lset = ("a", "b", "1", e.label_of(o, lambda pid: ranks(pid) or ""))
            out[lset] = out.get(lset, 0) + r.retransmits
        for lset, kept in e.retired.items():
            out[lset] = out.get(lset, 0) + kept["tcp_links"].retransmits
        return {k[3]: v for k, v in out.items()}

    assert step(0) == {"1": 8, "2": 7, "": 1}           # 12 found gone: rank "2" frozen
    (proc / "11").rmdir()
    assert step(1) == {"1": 8, "2": 7, "": 1}          # 11 found gone, its rank frozen
    ranks = {10: "1"}.get                              # then the process table forgets 11 and 12
    kernel[0] = link(0, 2)                             # untraced traffic counts again
    assert step(10.5) == {"1": 8, "": 2}               # 12 expired, nobody shares rank 2: gone whole
    assert 12 not in kernel and 12 not in e.gone
    assert step(11.5) == {"1": 8, "": 2} and 11 not in kernel   # 11 folded: 10 still lives
    kernel[11] = link(11, 2)                           # an orphaned socket of 11 counts again
    assert step(12) == {"1": 8, "": 4}                 # forgotten owner: its rank is now ""
    (proc / "10").rmdir()
    assert step(13) == {"1": 8, "": 4}
    # Rank 1's last owner gone for the TTL: the set goes whole, retired total
    # included; 11's late entry is folded into the "" set, which owner 0 keeps
    # alive (it counted at 14: not idle for the TTL yet).
    kernel[0] = link(0, 4)
    assert step(14) == {"1": 8, "": 6}
    assert step(23.5) == {"": 6} and set(kernel) == {0}
    assert list(e.retired) == [("a", "b", "1", "")] and not e.gone
    # Owner 0 idle for the TTL: the "" set goes whole too.
    assert step(24.5) == {}
    assert not kernel and not e.retired and not e.idle
