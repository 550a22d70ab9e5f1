"""TCP probes (bpf/tcp.c, exporter/tcp.py): real traffic in netns, real tracepoints.

The exporter's retransmit counts are checked against an independent observer
of the same tracepoint (a tracefs instance of our own) and bounded by the
kernel's RetransSegs of the cluster's namespaces.

Other tests may run clusters with the same addresses at the same time, so
every comparison is made on this test's own links: (saddr, daddr, port) keys
owned by this test's processes, or the port of its own traffic generator.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections import Counter

import pytest

from exporter.records import metrics, render
from exporter.records.contract import COUNTERS
from exporter.sinks.prometheus import tcp_families
from exporter.sources.bpf import ephemeral_ports
from exporter.sources.nccl.probes import NcclProbes
from exporter.simulator.cluster import Cluster, start_job
from exporter.records.events import AF_INET, AF_INET6
from exporter.sources.nccl.maps import NcclReader
from exporter.sources.tcp import TcpSource, retransmits_missed
from tests.retransmit_observer import Observer

pytestmark = pytest.mark.usefixtures("bpf", "netns")  # markers, root and the heavy lock: conftest

LOSSY = 1        # host whose link drops packets
LOSS_PCT = 3
GEN_PORT = 5001  # the untraced generator's service port (outside the ephemeral range)


# ------------------------------------------------------------------ helpers --
def link_port(sport: int, dport: int) -> int:
    """bpf/tcp.c's service-port rule."""
    lo, hi = ephemeral_ports()
    s_eph, d_eph = lo <= sport <= hi, lo <= dport <= hi
    if s_eph and not d_eph:
        return dport
    if d_eph and not s_eph:
        return sport
    return min(sport, dport)


def observed_hits(observer: Observer) -> Counter:
    """(saddr, daddr, port) -> the observer's retransmits that sent, of those the
    kernel ran BPF programs for (see tests/retransmit_observer.py)."""
    return Counter((h.saddr, h.daddr, link_port(h.sport, h.dport)) for h in observer.visible() if h.sent)


RETRANSMIT_PROGRAM = "tracepoint__tcp__tcp_retransmit_skb"


class Missed:
    """Retransmit hits bpf/tcp.c's program did not run for since this was made:
    HITS - SEEN of the shared counters (bpf/tcp.c), and the kernel's own count
    of one cause, the program's recursion_misses."""

    def __init__(self, probes, reader):
        self.counters, self.reader = NcclReader(probes).counters, reader
        self.before = self._now()

    def _now(self) -> tuple[int, int, int]:
        c = self.counters()
        return (retransmits_missed(c), c["RETRANSMIT_HITS"],
                self.reader.recursion_misses().get(RETRANSMIT_PROGRAM, 0))

    def since(self, seen: Counter) -> int:
        """The hits missed since; `seen`: what the observer saw meanwhile."""
        (missed, hits, recursion), (missed0, hits0, recursion0) = self._now(), self.before
        # the raw tracepoint counted every hit: at least the observer's (on the whole host)
        assert hits - hits0 >= sum(seen.values()) > 0, (hits - hits0, seen)
        # every hit the kernel skipped for recursion is one the raw tracepoint counted
        assert missed - missed0 >= recursion - recursion0, (missed, recursion, self.before)
        return missed - missed0


def assert_matches_observer(exporter: Counter, seen: Counter, missed: int) -> None:
    """Per link, the exporter counts what the observer saw, except hits the
    program did not run for (e.g. the kernel skipped it because another BPF
    program was running on that CPU: a softirq retransmit interrupting a
    uprobe): a raw tracepoint counts every hit, and only the difference may be
    missing."""
    assert all(exporter[k] <= seen[k] for k in exporter), (exporter, seen)
    short = sum(seen[k] - exporter[k] for k in seen)
    assert short <= missed, f"{short} hits not counted, {missed} missed hits: {exporter} vs {seen}"


def retrans_segs(cluster: Cluster) -> int:
    """Tcp: RetransSegs summed over the cluster's hosts (each its own netns)."""
    total = 0
    for h in cluster.hosts:
        p = subprocess.run(["ip", "netns", "exec", h.netns, "cat", "/proc/net/snmp"],
                           capture_output=True, text=True, check=True)
        tcp = [l.split() for l in p.stdout.splitlines() if l.startswith("Tcp:")]
        total += int(tcp[1][tcp[0].index("RetransSegs")])
    return total


def own_links(reader: TcpSource, keys) -> frozenset:
    return frozenset(l for l in reader.links() if (l.saddr, l.daddr, l.port) in keys)


def retransmits_by_key(links) -> Counter:
    out: Counter = Counter()
    for l in links:
        out[(l.saddr, l.daddr, l.port)] += l.retransmits
    return +out


def settle(reader: TcpSource, keys, read, timeout: float = 20.0):
    """The link records of `keys` and `read()`, taken while nothing lands on those links
    (read() sees the same counts as the records)."""
    deadline = time.monotonic() + timeout
    while True:
        before = own_links(reader, keys)
        extra = read()
        after = own_links(reader, keys)
        if before == after:
            return after, extra
        assert time.monotonic() < deadline, "retransmits never stopped"
        time.sleep(0.2)


# ----------------------------------------------------------------- fixtures --
@pytest.fixture(scope="module")
def probes(simulator_lib):
    p = NcclProbes()
    try:
        p.attach(str(simulator_lib))
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def reader(tcp):
    return tcp  # the TcpSource of conftest's `tcp` fixture


@pytest.fixture(scope="module")
def events(probes, reader):
    got = []
    reader.on_event(got.append)
    return got


def drain(reader):
    for _ in range(3):
        reader.poll(50)


# -------------------------------------------------------------------- tests --
@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_nccl_job_retransmits_match_observer_and_ranks(probes, reader, events, simulator_lib, tmp_path, ipv6):
    missed = Missed(probes, reader)
    with Cluster(4, name=f"tcp{int(ipv6)}") as cluster, Observer("tcp") as observer:
        cluster.set_loss(LOSSY, LOSS_PCT)
        segs_before = retrans_segs(cluster)
        job = start_job(cluster, simulator_lib, "allreduce", iterations=25, count=65536, ipv6=ipv6,
                        rendezvous_dir=tmp_path / "rdv", truth_dir=tmp_path / "truth")
        for rank, pid in enumerate(job.pids):
            probes.trace_process(pid, rank)
        result = job.wait(timeout=120)
        assert result.ok, result.summary()

        pids = {pid: rank for rank, pid in enumerate(job.pids)}
        mine = {(l.saddr, l.daddr, l.port) for l in reader.links() if l.owner in pids}

        def read():
            drain(reader)
            return observed_hits(observer), list(events), tcp_families("n1", reader, pids.get)
        links, (seen, evs, fams) = settle(reader, mine, read)
        segs = retrans_segs(cluster) - segs_before
        assert observer.overruns() == 0

    addr = [h.addr6 if ipv6 else h.addr for h in cluster.hosts]
    exporter = retransmits_by_key(links)
    seen = Counter({k: v for k, v in seen.items() if k in mine})
    total = sum(exporter.values())
    print(f"\n{'ipv6' if ipv6 else 'ipv4'}: exporter {total} hits, observer {sum(seen.values())}, "
          f"RetransSegs +{segs}, {len(mine)} links, job {result.elapsed_s:.1f}s")
    assert total > 0, "the lossy link produced no retransmits"
    assert all(k[0] in addr and k[1] in addr for k in mine)

    # Exactly the observer's count, per (saddr, daddr); never above RetransSegs.
    def per_pair(c):
        out = Counter()
        for (s, d, _port), v in c.items():
            out[(s, d)] += v
        return +out
    assert_matches_observer(per_pair(exporter), per_pair(seen), missed.since(seen))
    assert total <= segs

    # Attribution: a retransmit from the lossy host's address is the lossy rank's.
    family = AF_INET6 if ipv6 else AF_INET
    for l in links:
        if not l.retransmits:
            continue
        assert l.family == family
        if l.saddr == addr[LOSSY]:
            assert pids.get(l.owner) == LOSSY, l
        else:
            assert pids.get(l.owner) != LOSSY, l

    # The exported series: rank labels by owner, summed per label set.
    fams = {f.name: f for f in fams}
    exported = Counter()
    for s in fams[metrics.TCP_RETRANSMITS.removesuffix("_total")].samples:
        if s.name != metrics.TCP_RETRANSMITS:
            continue
        key = (s.labels["saddr"], s.labels["daddr"], int(s.labels["port"]))
        if key in mine:
            exported[key] += s.value
            if s.labels["saddr"] == addr[LOSSY]:
                assert s.labels["rank"] == str(LOSSY), s
    assert exported == +exporter

    # One event per retransmit of a traced socket, and none lost.
    ev = Counter()
    for e in evs:
        if e.event == "tcp_retransmit_skb" and e.pid in pids:
            ev[(e.saddr, e.daddr, link_port(e.sport, e.dport))] += 1
            assert render.as_dict(e)["timestamp_ns"] > 1_600_000_000 * 10**9
    traced = Counter()
    for l in links:
        if l.owner in pids and l.retransmits:
            traced[(l.saddr, l.daddr, l.port)] += l.retransmits
    assert ev == traced
    counters = probes["counters"]
    for name in ("TCP_EVENTS_LOST", "LINKS_FULL", "SOCKETS_FULL"):
        assert counters[counters.Key(COUNTERS[name])].value == 0, name

    # The RTT of the job's links was sampled.
    srtt = [s for s in reader.srtt() if s.owner in pids]
    assert srtt and all(sum(s.buckets) == s.count > 0 for s in srtt)


GEN_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(4)
    print("ready", flush=True)
    c, _ = s.accept()
    n = 0
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        n += len(b)
    c.sendall(b"done"); c.close()
""")

GEN_CLIENT = textwrap.dedent("""
    import socket, sys
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
    buf = b"x" * (1 << 16)
    for _ in range(int(sys.argv[3])):
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
    assert c.recv(16) == b"done"
""")


def test_untraced_traffic_counted_without_rank_or_events(probes, reader, events, tmp_path):
    # Data into the lossy host: the wire loses some of it, the sender retransmits.
    missed = Missed(probes, reader)
    with Cluster(2, name="tcpgen") as cluster, Observer("tcp") as observer:
        cluster.set_loss(LOSSY, LOSS_PCT)
        srv, cli = cluster.hosts[LOSSY], cluster.hosts[0]
        segs_before = retrans_segs(cluster)
        server = cluster.popen(LOSSY, [sys.executable, "-c", GEN_SERVER, srv.addr, str(GEN_PORT)],
                               stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        n_events = len(events)
        client = cluster.exec(0, [sys.executable, "-c", GEN_CLIENT, srv.addr, str(GEN_PORT), "640"],
                              timeout=90)
        assert client.returncode == 0, client.stderr
        server.wait(timeout=30)
        keys = {(cli.addr, srv.addr, GEN_PORT), (srv.addr, cli.addr, GEN_PORT)}
        links, seen = settle(reader, keys, lambda: observed_hits(observer))
        exporter = retransmits_by_key(links)
        seen = Counter({k: v for k, v in seen.items() if k in keys})
        segs = retrans_segs(cluster) - segs_before
        drain(reader)

    total = sum(exporter.values())
    print(f"\nuntraced: exporter {total} hits, observer {sum(seen.values())}, RetransSegs +{segs}")
    assert exporter[(cli.addr, srv.addr, GEN_PORT)] > 0, "bulk send into the lossy host: no retransmits"
    assert_matches_observer(exporter, seen, missed.since(seen))
    assert total <= segs
    assert links and all(l.owner == 0 for l in links)
    samples = [s for f in tcp_families("n1", reader, lambda pid: 7) for s in f.samples
               if s.labels.get("port") == str(GEN_PORT)]
    assert samples and all(s.labels["rank"] == "" for s in samples)
    assert not [e for e in events[n_events:] if GEN_PORT in (e.sport, e.dport)]


CHURN = textwrap.dedent("""
    import socket, sys
    sys.stdin.readline()              # traced from here on
    lst4 = socket.socket(); lst4.bind(("127.0.0.1", 0)); lst4.listen(64)
    lst6 = socket.socket(socket.AF_INET6); lst6.bind(("::1", 0)); lst6.listen(64)
    keep = []
    for i in range(int(sys.argv[1])):
        lst = (lst4, lst6)[i % 2]
        c = socket.create_connection(lst.getsockname()[:2]); a, _ = lst.accept()
        c.sendall(b"x"); a.recv(1); a.sendall(b"y"); c.recv(1)
        if i >= int(sys.argv[1]) - 5:
            keep += [c, a]            # the last ones stay open: must be in sock_owner, though
                                      # their pointers are likely reused ones (bpf/tcp.c known_sock)
        else:
            c.close(); a.close()
    print(len(keep), flush=True)
    sys.stdin.readline()
""")


def test_socket_owner_map_stays_bounded(probes, reader):
    with Cluster(1, name="tcpchurn") as cluster:
        p = cluster.popen(0, [sys.executable, "-c", CHURN, "3000"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
        try:
            probes.trace_process(p.pid, 0)
            p.stdin.write("go\n")
            p.stdin.flush()
            assert p.stdout.readline().strip() == "10"
            owned = [k for k, v in reader["sock_owner"].items() if v.tgid == p.pid]
            p.stdin.write("end\n")
            p.stdin.flush()
            assert p.wait(timeout=30) == 0
        finally:
            if p.poll() is None:
                p.kill()
    print(f"\nsock_owner after 3000 connections: {len(owned)} entries of the process")
    assert 10 <= len(owned) <= 20


RESET_PEER = textwrap.dedent("""
    import socket, sys
    role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.stdin.readline()              # traced from here on
    if role == "server":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port)); s.listen(1)
        print("ready", flush=True)
        c, _ = s.accept()
        c.recv(1)                     # leaves unread data behind:
        c.close()                     # close() aborts with a RST
    else:
        c = socket.create_connection((addr, port))
        c.sendall(b"x" * 1000)
        try:
            c.recv(1)
        except ConnectionResetError:
            print("reset", flush=True)
""")


def test_resets_are_counted_and_attributed(probes, reader, events):
    port = GEN_PORT + 1
    with Cluster(2, name="tcprst") as cluster:
        srv, cli = cluster.hosts[1], cluster.hosts[0]
        procs = []
        try:
            for i, role in ((1, "server"), (0, "client")):
                p = cluster.popen(i, [sys.executable, "-c", RESET_PEER, role, srv.addr, str(port)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                procs.append(p)
                probes.trace_process(p.pid, i)
                p.stdin.write("go\n")
                p.stdin.flush()
                if role == "server":
                    assert p.stdout.readline().strip() == "ready"
            server, client = procs
            assert client.stdout.readline().strip() == "reset"
            assert client.wait(timeout=30) == 0 and server.wait(timeout=30) == 0
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        drain(reader)

    links = {(l.saddr, l.daddr, l.port, l.owner): l for l in reader.links() if l.port == port}
    sent = links[(srv.addr, cli.addr, port, server.pid)]
    received = links[(cli.addr, srv.addr, port, client.pid)]
    assert (sent.resets_sent, sent.resets_received) == (1, 0)
    assert (received.resets_sent, received.resets_received) == (0, 1)
    rank_of = {server.pid: 1, client.pid: 0}.get
    resets = [s for f in tcp_families("n1", reader, rank_of) if f.name + "_total" == metrics.TCP_RESETS
              for s in f.samples if s.labels["port"] == str(port)]
    got = {(s.labels["direction"], s.labels["saddr"], s.labels["rank"]): s.value for s in resets}
    assert got == {("sent", srv.addr, "1"): 1, ("received", cli.addr, "0"): 1}
    evs = {(e.event, e.pid, e.saddr, e.daddr) for e in events if port in (e.sport, e.dport)}
    assert evs == {("tcp_send_reset", server.pid, srv.addr, cli.addr),
                   ("tcp_receive_reset", client.pid, cli.addr, srv.addr)}


ECHO_PAIR = textwrap.dedent("""
    import socket, sys, threading
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    def echo():
        c, _ = srv.accept()
        while (d := c.recv(64)):
            c.sendall(d)
    threading.Thread(target=echo, daemon=True).start()
    cli = socket.create_connection(srv.getsockname())
    print("ready", flush=True)
    sys.stdin.readline()  # traced: go
    while True:
        cli.sendall(b"x"); cli.recv(64)
""")


def test_srtt_sampled_only_in_its_windows(probes, reader):
    """`run --srtt-sampling W/P`: tcp_probe is attached for W of every P
    while hot, and srtt samples arrive only then (TcpSource.srtt_duty)."""
    p = subprocess.Popen([sys.executable, "-c", ECHO_PAIR], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        probes.trace_process(p.pid, None)
        p.stdin.write("go\n")
        p.stdin.flush()

        def samples() -> int:
            return sum(s.count for s in reader.srtt() if s.owner == p.pid)

        start = reader._hot_since
        assert reader.srtt_duty(start + 0.1, 0.25, 5.0)  # in the first window: attached
        deadline = time.monotonic() + 10
        while samples() < 3:
            assert time.monotonic() < deadline, "no srtt sample while tcp_probe was attached"
            time.sleep(0.05)
        assert not reader.srtt_duty(start + 1.0, 0.25, 5.0)  # between windows: detached
        time.sleep(0.1)
        before = samples()
        time.sleep(0.5)  # ~50 segments each way, one sample per socket per 10 ms if attached
        assert samples() == before, "srtt sampled while tcp_probe was detached"
        assert reader.srtt_duty(start + 5.1, 0.25, 5.0)  # the next window
        time.sleep(0.5)
        assert samples() > before
    finally:
        reader.set_hot(True)  # as loaded, for the other tests
        p.kill()
        p.wait()


OWNER_PAIRS = textwrap.dedent("""
    import socket, sys
    pairs = []
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "pair":    # a listener, a connection to it, the accepted end
            srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
            cli = socket.create_connection(srv.getsockname())
            acc, _ = srv.accept()
            pairs.append((srv, cli, acc))
        else:                          # talk: one exchange on every connection
            for _, cli, acc in pairs:
                cli.sendall(b"x"); acc.recv(1); acc.sendall(b"y"); cli.recv(1)
        print("ok", flush=True)
""")


def test_owners_learnt_in_windows(probes, reader):
    """`run --owner-window W`: the send/recv tracepoints that learn socket
    owners are attached for W after a new traced process or an accept on a
    traced listening port, not otherwise; a connecting socket is learnt at
    connect() all the same (TcpSource.owner_duty, bpf/tcp.c)."""
    wanted_slot = probes["counters"].Key(COUNTERS["OWNERS_WANTED"])

    def wanted() -> int:
        return probes["counters"][wanted_slot].value

    p = subprocess.Popen([sys.executable, "-c", OWNER_PAIRS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)

    def say(cmd: str) -> None:
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"

    def owned() -> int:
        return sum(1 for v in reader["sock_owner"].values() if v.tgid == p.pid)

    try:
        assert p.stdout.readline().strip() == "ready"
        probes.trace_process(p.pid, None)
        attached = reader.bpf.tracepoint_fds
        t0, w = time.monotonic(), wanted()
        assert reader.owner_duty(t0, 3.0, w, {p.pid})  # a new traced process: a window
        assert not reader.owner_duty(t0 + 10, 3.0, w, {p.pid})  # nothing new since: closed
        assert not any(tp.encode() in attached for tp in reader.OWNER_TRACEPOINTS)
        say("pair")
        say("talk")
        assert owned() == 1, "only the connecting socket is learnt while no window is open"
        assert wanted() == w + 1, "the accept on a traced listener was not counted"
        assert reader.owner_duty(t0 + 11, 3.0, wanted(), {p.pid})  # ... and opens a window
        say("talk")
        assert owned() == 2, "the accepted socket was not learnt in its window"
        assert not reader.owner_duty(t0 + 20, 3.0, wanted(), {p.pid})
        assert reader.owner_duty(t0 + 21, 3.0, wanted(), {p.pid, 1})  # another traced process
    finally:
        reader.set_hot(True)  # as loaded, for the other tests
        p.kill()
        p.wait()
