"""An MCP server (Model Context Protocol, the official `mcp` SDK) over recordings and the fleet.

    nccl-exporter mcp --db job.db [--db other.db] [--nodes URL,... --token-file F]
    nccl-exporter mcp ... --http 127.0.0.1:8765       # streamable HTTP instead of stdio

Tools (every input checked; a bad one is a tool error saying what is wrong):
    fleet_query(sql, max_rows, source)   read-only SQL on the local recordings and/or the
                                         nodes' query endpoints; a `node` column first
    slowest_collectives(limit, op)       the longest NCCL calls, everywhere
    retransmits_by_link(limit)           TCP retransmits per link, everywhere
    hang_status(metrics_url, threshold_s) which rank never joined a hung collective (offline/analysis/hang.py)
    explain(db, align)                   one-line verdict + evidence (offline/analysis/explain.py)
    stragglers(db, comm, op, limit)      per rank: how often last, median lag (offline/analysis)
    slow_links(db, comm, op, limit)      per link: network waits, slow link or GPU straggler
                                         (offline/analysis/network.py, docs/network.md)
Resources: nccl://schema (docs/schema.md), nccl://queries (docs/queries.md) and
nccl://queries/<name>, one per documented query. The stdio transport and its
JSON-RPC checks: mcp_stdio.py.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from exporter.records import contract
from exporter.sinks.recording import query, read
from exporter.offline.fleet import client

try:  # mcp 2.x
    from mcp.server.mcpserver import MCPServer as _Server
    from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as _Server  # type: ignore[no-redef]
    from mcp.server.fastmcp.exceptions import ToolError  # type: ignore[no-redef]

DOCS = Path(__file__).resolve().parents[2] / "docs"
MAX_ROWS = 1000          # rows a tool answers at most (an assistant's context is small)
MAX_SQL = 64 << 10


@dataclass
class Targets:
    dbs: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    options: client.FleetOptions = field(default_factory=client.FleetOptions)


# --- helpers ---------------------------------------------------------------------

def _node_of(path: str) -> str:
    return read.node_name(path, Path(path).stem)


LOCAL_LIMITS = dataclasses.replace(query.SHARED, time_s=30.0)


def _local_query(path: str, sql: str, max_rows: int) -> tuple[list[str], list[tuple], bool]:
    """Read-only, with the endpoint's limits (query.SHARED) but 30 s of time."""
    return query.first_rows(path, sql, LOCAL_LIMITS, max_rows)


def _check_sql(sql: str) -> str:
    if not isinstance(sql, str) or not sql.strip():
        raise ToolError("sql: one read-only SELECT (or WITH ...) statement is required")
    if len(sql) > MAX_SQL:
        raise ToolError(f"sql: {len(sql)} characters; at most {MAX_SQL}")
    return sql


def _check_limit(name: str, value: int, top: int = MAX_ROWS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
        raise ToolError(f"{name}: an integer from 1 to {top}, not {value!r}")
    return value


def _check_comm(comm: str | None, local: bool = True) -> str | None:
    """A communicator as recordings name it, or None: every one. NCCL's commHash
    (up to 16 hex digits); with `local`, also the agent's own ids (unknown,
    local-<pid>-<n>[~aligned]), which the network waits never carry."""
    if comm is None:
        return None
    if local:
        pattern, want = r"[0-9a-f]{1,16}|unknown|local-\d+-\d+(~aligned)?", "(16 hex digits) or local-<pid>-<n>"
    else:
        pattern, want = r"[0-9a-f]{1,16}", "(up to 16 hex digits)"
    if not re.fullmatch(pattern, comm):
        raise ToolError(f"comm: a communicator hash {want}, not {comm!r}")
    return comm


def _check_op(op: str | None) -> str | None:
    """An op name as contract.OPS spells it (any case), or None: every op."""
    if op is None:
        return None
    ops = sorted(contract.OPS.values())
    if op.upper() not in ops:
        raise ToolError(f"op: one of {', '.join(ops)}; not {op!r}")
    return op.upper()


def documented_queries() -> dict[str, str]:
    """docs/queries.md: '### name' followed by a ```sql block."""
    try:
        text = (DOCS / "queries.md").read_text()
    except OSError:
        return {}
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^### ([\w-]+)\s*\n+```sql\n(.*?)```", text, re.M | re.S)}


def run_everywhere(targets: Targets, sql: str, max_rows: int, source: str = "all") -> dict:
    """{"columns": [node, ...], "rows": [...], "truncated": bool, "warnings": [...]}"""
    names: list[str] | None = None
    rows: list[list] = []
    warnings: list[str] = []
    truncated = False
    asked = 0
    if source in ("all", "local"):
        for path in targets.dbs:
            asked += 1
            try:
                cols, got, cut = _local_query(path, sql, max_rows)
            except query.QueryError as e:
                warnings.append(f"{path}: {e}")
                continue
            if names is None:
                names = cols
            elif cols != names:
                warnings.append(f"{path}: columns {cols} differ from {names}; left out")
                continue
            node = _node_of(path)
            rows += [[node, *r] for r in got]
            truncated |= cut
    if source in ("all", "nodes") and targets.nodes:
        opts = client.FleetOptions(**{**targets.options.__dict__, "max_rows": max_rows, "clock": False})
        asked += len(targets.nodes)
        for ev in client.stream_query(targets.nodes, sql, opts):
            if ev.kind == "columns":
                if names is None:
                    names = list(ev.names)
            elif ev.kind == "rows":
                rows += [[ev.node, *r] for r in ev.rows]
            else:
                res = ev.result
                if not res.ok:
                    warnings.append(f"node {res.node} ({res.url}): {res.error}")
                elif res.truncated:
                    truncated = True
    if asked == 0:
        raise ToolError("no recordings and no nodes to ask: start the server with --db and/or --nodes"
                        if source == "all" else f"source={source!r}: none configured")
    if names is None:
        raise ToolError("no source answered: " + "; ".join(warnings))
    bytes_values = [[v.hex() if isinstance(v, bytes) else v for v in r] for r in rows]
    return {"columns": ["node", *names], "rows": bytes_values, "truncated": truncated, "warnings": warnings}


def hang_status(metrics_url, threshold_s: float = 60.0, timeout: float = 10.0,
                interval_s: float | None = None) -> dict:
    """The verdict of `nccl-exporter hang` (exporter/offline/analysis/hang.py) as a dict.
    metrics_url: one agent's /metrics URL or a list of them (one per node of the job)."""
    from exporter.offline.analysis import hang

    if metrics_url is None or metrics_url == "" or metrics_url == []:
        raise ToolError(f"metrics_url is required: an agent's /metrics, e.g. "
                        f"http://gpu-017:{contract.DEFAULT_PORT}/metrics (or a list, one per node)")
    urls = [metrics_url] if isinstance(metrics_url, str) else metrics_url
    if not isinstance(urls, list) or len(urls) > 256:
        raise ToolError(f"metrics_url: a URL or a list of at most 256 URLs, not {metrics_url!r}")
    try:
        answer = hang.hang_status(urls, threshold_s, timeout=timeout,
                                  interval_s=hang.INTERVAL_S if interval_s is None else interval_s)
    except hang.HangInputError as e:
        raise ToolError(f"metrics_url/threshold_s: {e}") from None
    if not answer.answered:
        raise ToolError(answer.verdict)
    out = answer.as_dict()
    out["in_flight"] = out["in_flight"][:MAX_ROWS]
    return out


# --- the server ---------------------------------------------------------------------

def build_server(targets: Targets, host: str = "127.0.0.1", port: int = 8765):
    kwargs = {}
    if _Server.__module__.startswith("mcp.server.fastmcp"):  # 1.x: HTTP settings in the constructor
        kwargs = {"host": host, "port": port}
    mcp = _Server("nccl-exporter", instructions=(
        "NCCL collective latency, TCP retransmits and scheduler waits recorded by nccl-exporter "
        "agents. Read nccl://schema first; nccl://queries has tested SQL. Queries are read-only."),
        **kwargs)

    @mcp.tool()
    def fleet_query(sql: str, max_rows: int = 200, source: str = "all") -> dict:
        """Run one read-only SQL statement (SQLite; tables in nccl://schema) on every local
        recording and/or every node's query endpoint. Answers columns (node first), rows,
        truncated and warnings (nodes that did not answer). source: all | local | nodes."""
        _check_sql(sql)
        _check_limit("max_rows", max_rows)
        if source not in ("all", "local", "nodes"):
            raise ToolError(f"source: one of all, local, nodes; not {source!r}")
        return run_everywhere(targets, sql, max_rows, source)

    @mcp.tool()
    def slowest_collectives(limit: int = 20, op: str | None = None) -> dict:
        """The longest NCCL calls across every recording and node, slowest first
        (op, rank, comm, seq, ms). op: e.g. ALL_REDUCE (default: every op)."""
        _check_limit("limit", limit)
        op = _check_op(op)
        out = run_everywhere(targets, query.slowest_calls_sql(limit, op), limit)
        ms = out["columns"].index("ms")
        out["rows"] = sorted(out["rows"], key=lambda r: -(r[ms] or 0))[:limit]
        return out

    @mcp.tool()
    def retransmits_by_link(limit: int = 20) -> dict:
        """TCP retransmits per link (owner rank, local and remote address) across every recording
        and node, most first: a lossy link stands out."""
        _check_limit("limit", limit)
        out = run_everywhere(targets, query.retransmits_by_link_sql(limit), limit)
        n = out["columns"].index("retransmits")
        out["rows"] = sorted(out["rows"], key=lambda r: -(r[n] or 0))[:limit]
        return out

    @mcp.tool(name="hang_status")
    def hang_status_tool(metrics_url: str | list[str] | None = None, threshold_s: float = 60.0) -> dict:
        """Is a job hung, and which rank never joined? Reads agents' /metrics (metrics_url: one
        URL such as http://gpu-017:9862/metrics, or a list, one per node of the job). For each
        communicator with a call in flight at least threshold_s: the ranks waiting in which
        collective (op, seq), the member ranks that never entered it and what they last did,
        ranks in another collective (desync). Same verdict as `nccl-exporter hang`."""
        return hang_status(metrics_url, threshold_s)

    analysis = _analysis()
    if analysis:
        explain_mod, stragglers_mod, network_mod = analysis

        def open_db(db: str | None):
            if db is None:
                if len(targets.dbs) != 1:
                    raise ToolError("db: which recording? one of " + ", ".join(targets.dbs) if targets.dbs
                                    else "db: no local recording (start the server with --db)")
                db = targets.dbs[0]
            if db not in targets.dbs:
                raise ToolError(f"db: one of the server's recordings ({', '.join(targets.dbs) or 'none'}), "
                                f"not {db!r}")
            try:
                return read.Recording.open(db)
            except read.ReadError as e:
                raise ToolError(str(e)) from None

        @mcp.tool()
        def explain(db: str | None = None, align: bool = True) -> dict:
            """One line of verdict on a (merged) recording — who is the straggler and why — then
            the evidence. db: one of the server's --db recordings (default: the only one)."""
            rec = open_db(db)
            try:
                lines = explain_mod.explain(rec, align=align)
            finally:
                rec.close()
            return {"verdict": lines[0] if lines else "", "evidence": lines[1:]}

        @mcp.tool()
        def stragglers(db: str | None = None, comm: str | None = None, op: str | None = None,
                       limit: int = 50) -> dict:
            """Per rank of each synchronous collective: how often it arrived last, its median lag,
            and the retransmits and run-queue waits in its windows; the worst first."""
            _check_limit("limit", limit)
            op = _check_op(op)
            comm = _check_comm(comm)
            rec = open_db(db)
            try:
                collectives, _ = stragglers_mod.load(rec, align=True, comm=comm, op=op)
                stats = stragglers_mod.per_rank(collectives)
            finally:
                rec.close()
            rows = stragglers_mod.rank_rows(stats)
            cols = list(stragglers_mod.RANK_COLUMNS)
            k = cols.index("last")
            rows.sort(key=lambda r: -r[k])
            return {"columns": cols, "rows": [list(r) for r in rows[:limit]],
                    "collectives": len(collectives)}

        @mcp.tool()
        def slow_links(db: str | None = None, comm: str | None = None, op: str | None = None,
                       limit: int = 50) -> dict:
            """Which link slowed the collectives, from the profiler plugin's per-peer network
            waits (any NET transport: IB, RoCE, Socket, net plugins): per link (sender ->
            receiver of a communicator) the receiver's recv_wait and the sender's send_wait and
            send_gpu_wait (wall ms) against the communicator's median link, and the verdict:
            'slow link' (both ends high), 'GPU straggler' (the sender's GPU is late, not the
            network), 'unexplained' (the sender's side is not recorded). Judged links first.
            Same figures as `nccl-exporter stragglers --links` (docs/network.md)."""
            _check_limit("limit", limit)
            op = _check_op(op)
            comm = _check_comm(comm, local=False)
            rec = open_db(db)
            try:
                if not network_mod.available(rec):
                    raise ToolError("this recording predates the network waits (schema < 7, no "
                                    "nccl_peer_waits table): nothing to judge")
                links = network_mod.load(rec, comm=comm, op=op)
                network_mod.judge(links)
            finally:
                rec.close()
            rows = network_mod.link_rows(links)
            out = {"columns": list(network_mod.LINK_COLUMNS), "rows": [list(r) for r in rows[:limit]],
                   "links": len(links)}
            if not links:
                out["note"] = ("no network waits in this recording: the profiler plugin was not loaded, its "
                               "proxy accounting was off, or no transfer used a NET transport")
            return out

    @mcp.resource("nccl://schema", name="schema", mime_type="text/markdown",
                  description="The recording's tables and columns (docs/schema.md)")
    def schema() -> str:
        return _doc("schema.md")

    @mcp.resource("nccl://queries", name="queries", mime_type="text/markdown",
                  description="Tested SQL for common questions (docs/queries.md)")
    def queries() -> str:
        return _doc("queries.md")

    for qname, qsql in documented_queries().items():
        mcp.resource(f"nccl://queries/{qname}", name=f"query-{qname}", mime_type="application/sql",
                     description=f"The documented query '{qname}' (docs/queries.md)")(
            _constant(qsql))
    return mcp


def _constant(text: str):
    def read() -> str:
        return text
    return read


def _doc(name: str) -> str:
    try:
        return (DOCS / name).read_text()
    except OSError:
        return f"({name} is not installed with this copy of nccl-exporter; see the project's docs/)"


def _analysis():
    """The straggler analysis modules (exporter/offline/analysis/), when present."""
    try:
        from exporter.offline.analysis import explain, network, stragglers

        explain.explain, stragglers.load, stragglers.per_rank, stragglers.rank_rows  # noqa: B018
        stragglers.RANK_COLUMNS, network.load, network.judge, network.link_rows  # noqa: B018
        return explain, stragglers, network
    except (ImportError, AttributeError):
        return None


def serve(targets: Targets, http: tuple[str, int] | None = None) -> None:
    if http is None:
        import anyio

        from exporter.offline import mcp_stdio

        anyio.run(mcp_stdio.serve_stdio, build_server(targets))
        return
    host, port = http
    server = build_server(targets, host, port)
    if _Server.__module__.startswith("mcp.server.fastmcp"):
        server.run("streamable-http")
    else:
        server.run("streamable-http", host=host, port=port)
