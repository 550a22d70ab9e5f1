"""`nccl-exporter mcp`: the official SDK's client session, end to end, over stdio and HTTP.

A small recorded cluster: two nodes' recordings (8 ranks, rank 5 arrives
40 ms late at every AllReduce, rank 5's link retransmits), one of them also
served live by a node query endpoint, and a static /metrics page with a
stuck call.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time

import pytest

from conftest import serve_text

pytest.importorskip("mcp", reason="the MCP SDK is not installed (pip install 'mcp>=2.3,<3')")

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from exporter.records.events import CallEvent
from exporter.sinks.recording.writer import Recorder
from exporter.sinks.recording.endpoint import QueryEndpoint

from conftest import REPO
T0 = 1_700_000_000_000_000_000
MS = 1_000_000
TOKEN = "mcp-test-token"


def call(i, rank, start, dur, pid):
    return CallEvent(kind=1, op="ALL_REDUCE", pid=pid, tid=pid, start_ns=start - T0, end_ns=start - T0 + dur,
                     start_real_ns=start, comm_ptr=1, comm=0x3F00AA, nccl_comm_hash=0xCD, seq=i, rank=rank,
                     nranks=8, count=1 << 20, bytes=4 << 20, datatype=7, red_op=0, root=-1, peer=-1,
                     stream=0x10, result=0, color=-1)


def retransmit(t, pid, rank):
    return {"timestamp_ns": t, "event": "tcp_retransmit_skb", "family": "ipv4", "saddr": "10.0.0.6",
            "daddr": "10.0.0.7", "sport": 40000, "dport": 5000, "state": "ESTABLISHED", "seq": 0,
            "pid": pid, "tid": pid, "rank": rank}


def record(path, node, ranks, n=40):
    r = Recorder(str(path), node=node, identify_processes=False)
    for i in range(n):
        base = T0 + i * 100 * MS
        last = base + 40 * MS
        for rank in ranks:
            start = last if rank == 5 else base + rank * 100_000
            r(call(i, rank, start, last + MS - start, 1000 + rank))
            if rank == 5 and i % 4 == 0:
                r(retransmit(start + 100_000, 1000 + rank, rank))
    r.close()
    return str(path)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp")
    a = record(d / "gpu-a.db", "gpu-a", range(0, 4))
    b = record(d / "gpu-b.db", "gpu-b", range(4, 8))
    whole = record(d / "job.db", "gpu-all", range(8))   # one recording holding every rank
    return {"a": a, "b": b, "whole": whole, "dir": d}


# A live agent's page during a hang: comm 3f00aa (2 ranks, both on gpu-b);
# rank 1 waits in AllReduce #41, rank 0 returned #40 and never entered #41.
METRICS_PAGE = (
    '# TYPE nccl_communicator_info gauge\n'
    'nccl_communicator_info{node="gpu-b",comm="00000000003f00aa",nccl_comm_hash="",rank="0",nranks="2",'
    'pid="1004",launcher="",launcher_rank="",world_size=""} 1\n'
    'nccl_communicator_info{node="gpu-b",comm="00000000003f00aa",nccl_comm_hash="",rank="1",nranks="2",'
    'pid="1005",launcher="",launcher_rank="",world_size=""} 1\n'
    '# TYPE nccl_inflight_oldest_seconds gauge\n'
    'nccl_inflight_oldest_seconds{node="gpu-b",op="ALL_REDUCE",comm="00000000003f00aa",rank="1"} 312.5\n'
    '# TYPE nccl_collective_last_seq gauge\n'
    'nccl_collective_last_seq{node="gpu-b",op="ALL_REDUCE",comm="00000000003f00aa",rank="0"} 40\n'
    'nccl_collective_last_seq{node="gpu-b",op="ALL_REDUCE",comm="00000000003f00aa",rank="1"} 40\n')


@pytest.fixture(scope="module")
def metrics_url():
    srv = serve_text(METRICS_PAGE)
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


def dead_url():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sk.getsockname()[1]}"


def payload(result):
    assert not result.is_error, result.content[0].text
    return json.loads(result.content[0].text)


def error_text(result):
    assert result.is_error, result
    return result.content[0].text


async def session_checks(s, cluster, metrics_url, node_url):
    await s.initialize()
    names = {t.name for t in (await s.list_tools()).tools}
    assert {"fleet_query", "slowest_collectives", "retransmits_by_link", "hang_status",
            "explain", "stragglers"} <= names

    # fleet_query: both local recordings and the live node, node column first
    out = payload(await s.call_tool("fleet_query", {"sql": "SELECT COUNT(*) AS n FROM nccl_events"}))
    assert out["columns"] == ["node", "n"]
    assert sorted(map(tuple, out["rows"])) == [("gpu-a", 160), ("gpu-all", 320), ("gpu-b", 160),
                                               ("live-b", 160)]
    assert len(out["warnings"]) == 1 and "connection refused" in out["warnings"][0]  # the dead node
    out = payload(await s.call_tool("fleet_query", {"sql": "SELECT 1 AS one", "source": "nodes"}))
    assert out["rows"] == [["live-b", 1]]
    out = payload(await s.call_tool("fleet_query", {"sql": "SELECT seq FROM nccl_events", "max_rows": 5,
                                                    "source": "local"}))
    assert out["truncated"] is True and len(out["rows"]) == 15

    # read-only, and every input checked
    assert "refused" in error_text(await s.call_tool("fleet_query", {"sql": "DELETE FROM nccl_events"}))
    assert "max_rows" in error_text(await s.call_tool("fleet_query", {"sql": "SELECT 1", "max_rows": 0}))
    assert "source" in error_text(await s.call_tool("fleet_query", {"sql": "SELECT 1", "source": "x"}))
    assert "sql" in error_text(await s.call_tool("fleet_query", {"sql": "  "}))
    assert "op" in error_text(await s.call_tool("slowest_collectives", {"op": "DROP TABLE"}))
    assert "limit" in error_text(await s.call_tool("retransmits_by_link", {"limit": 5000}))
    assert "metrics_url" in error_text(await s.call_tool("hang_status", {"metrics_url": "file:///etc/passwd"}))
    assert error_text(await s.call_tool("slowest_collectives", {"limit": "many"}))

    # the slowest calls: the waiting ranks (41 ms), never rank 5 (1 ms)
    out = payload(await s.call_tool("slowest_collectives", {"limit": 5, "op": "all_reduce"}))
    ms = out["columns"].index("ms")
    rank = out["columns"].index("rank")
    assert len(out["rows"]) == 5 and all(r[ms] > 40 for r in out["rows"])
    assert all(r[rank] != 5 for r in out["rows"])

    # retransmits by link: rank 5's link
    out = payload(await s.call_tool("retransmits_by_link", {"limit": 3}))
    top = dict(zip(out["columns"], out["rows"][0]))
    assert top["rank"] == 5 and top["remote"] == "10.0.0.7:5000" and top["retransmits"] == 10

    # hang status from a live /metrics
    out = payload(await s.call_tool("hang_status", {"metrics_url": metrics_url, "threshold_s": 60}))
    assert out["hung"] is True and out["oldest_s"] == 312.5
    assert "rank 1 waiting in AllReduce #41" in out["verdict"], out["verdict"]
    assert "rank 0 on gpu-b never entered it: its last AllReduce #40" in out["verdict"], out["verdict"]
    assert [m["rank"] for m in out["hangs"][0]["missing"]] == [0]
    assert "metrics_url is required" in error_text(await s.call_tool("hang_status", {}))
    out = payload(await s.call_tool("hang_status", {"metrics_url": metrics_url, "threshold_s": 1000}))
    assert out["hung"] is False

    # explain and stragglers (exporter/offline/analysis) on the recording holding every rank
    out = payload(await s.call_tool("explain", {"db": cluster["whole"]}))
    assert "rank 5" in out["verdict"], out
    out = payload(await s.call_tool("stragglers", {"db": cluster["whole"], "limit": 3}))
    first = dict(zip(out["columns"], out["rows"][0]))
    assert first["rank"] == 5 and first["last"] == 40
    assert "db" in error_text(await s.call_tool("explain", {"db": "/etc/passwd"}))

    # resources: the schema and the documented queries
    uris = {str(r.uri) for r in (await s.list_resources()).resources}
    assert {"nccl://schema", "nccl://queries", "nccl://queries/retransmits-by-link"} <= uris
    text = (await s.read_resource("nccl://schema")).contents[0].text
    assert "nccl_events" in text
    sql = (await s.read_resource("nccl://queries/slowest-calls")).contents[0].text
    assert sql.startswith("SELECT")


def test_mcp_over_stdio(cluster, metrics_url, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    ep = QueryEndpoint(cluster["b"], "live-b", TOKEN).start()
    try:
        params = StdioServerParameters(
            command=sys.executable, cwd=str(REPO),
            args=["-m", "exporter", "mcp", "--db", cluster["a"], "--db", cluster["b"], "--db", cluster["whole"],
                  "--nodes", f"{ep.url},{dead_url()}", "--token-file", str(token)])

        async def main():
            async with stdio_client(params) as (r, w):
                async with ClientSession(r, w) as s:
                    await asyncio.wait_for(session_checks(s, cluster, metrics_url, ep.url), 120)

        asyncio.run(main())
    finally:
        ep.close()


def test_mcp_over_streamable_http(cluster):
    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "mcp", "--db", cluster["whole"],
                             "--http", f"127.0.0.1:{port}"], cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.2)

        async def main():
            async with streamable_http_client(f"http://127.0.0.1:{port}/mcp") as streams:
                async with ClientSession(streams[0], streams[1]) as s:
                    await s.initialize()
                    out = payload(await s.call_tool("fleet_query", {"sql": "SELECT COUNT(*) AS n FROM nccl_events"}))
                    assert out["rows"] == [["gpu-all", 320]]

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_refuses_remote_http_and_missing_files(capsys):
    from exporter.cli import main

    assert main(["mcp", "--http", "0.0.0.0:8765"]) == 2
    assert "loopback" in capsys.readouterr().err
    assert main(["mcp", "--db", "/nonexistent.db"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_mcp_names_a_slow_link_as_explain_does(tmp_path):
    """explain and slow_links on recordings with per-peer network waits (docs/network.md):
    a slow link, a late GPU, and an old recording without the table."""
    from test_slow_links import make_recording

    slow = make_recording(tmp_path / "slow.db", "slow_link")
    gpu = make_recording(tmp_path / "gpu.db", "gpu")
    old = make_recording(tmp_path / "old.db", "slow_link", version=6)
    params = StdioServerParameters(command=sys.executable, cwd=str(REPO),
                                   args=["-m", "exporter", "mcp", "--db", slow, "--db", gpu, "--db", old])

    async def checks(s):
        await s.initialize()
        out = payload(await s.call_tool("explain", {"db": slow}))
        assert out["verdict"].startswith("slow link: rank 3 \u2190 rank 2: recv_wait 6.0× the comm's median pair, "
                                         "and rank 2's send_wait to 3 as high (7.0×); 3 retransmits on "
                                         "198.18.0.6\u2192198.18.0.7"), out
        out = payload(await s.call_tool("slow_links", {"db": slow, "limit": 2}))
        top = dict(zip(out["columns"], out["rows"][0]))
        assert (top["receiver"], top["sender"], top["verdict"], top["recv_wait_x"]) == (3, 2, "slow link", 6.0)
        assert out["links"] == 4 and len(out["rows"]) == 2
        out = payload(await s.call_tool("slow_links", {"db": gpu}))
        assert dict(zip(out["columns"], out["rows"][0]))["verdict"] == "GPU straggler"
        assert payload(await s.call_tool("explain", {"db": gpu}))["verdict"].startswith("GPU straggler: rank 2")
        assert "predates the network waits" in error_text(await s.call_tool("slow_links", {"db": old}))
        assert "comm" in error_text(await s.call_tool("slow_links", {"db": slow, "comm": "x'; DROP"}))

    async def main():
        async with stdio_client(params) as (r, w):
            async with ClientSession(r, w) as s:
                await asyncio.wait_for(checks(s), 120)

    asyncio.run(main())
