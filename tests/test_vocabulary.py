"""One vocabulary in the code (docs/communicators.md): `comm` is a
communicator's label value, `comm_ptr` its ncclComm_t pointer in a process,
`nccl_comm_hash` NCCL's own commHash where known; "source" is a measurement
source (exporter/sources and the SOURCES rows of agent/loop.py) only.

The BPF programs keep their C names (bpf/nccl.c: `comm` is NCCL's pointer
argument, `comm_hash` the agent's own id, `nccl_hash` NCCL's): only the
decoders in exporter/sources/ read those fields, through BCC's ctypes structs.
Metric labels, recording columns (`comm_id_hash`), span attributes and JSON
keys are strings, not identifiers, and are not checked here.
"""

import ast
import dataclasses
import inspect
from pathlib import Path

from exporter.records import events
from exporter.sources.nccl.maps import AsyncState

ROOT = Path(__file__).resolve().parent.parent
OLD = {"comm_hash", "nccl_hash", "comm_id_hash"}


def _records():
    return [c for _, c in inspect.getmembers(events, inspect.isclass)
            if dataclasses.is_dataclass(c) and c.__module__ == events.__name__] + [AsyncState]


def test_records_name_the_communicator_comm_and_the_pointer_comm_ptr():
    named = {}
    for cls in _records():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert not fields & (OLD | {"handle"}), (cls.__name__, sorted(fields & (OLD | {"handle"})))
        named[cls.__name__] = fields
    with_comm = {n for n, f in named.items() if "comm" in f}
    assert {"Series", "InflightCall", "Communicator", "CallEvent", "GpuSeries", "GpuInflight",
            "NetworkSeries", "GpuCall", "PluginComm", "AsyncState"} <= with_comm, sorted(with_comm)
    assert {n for n, f in named.items() if "comm_ptr" in f} == {"CallEvent", "Communicator", "AsyncState"}
    assert "comm" not in named["SchedEvent"] and "thread_name" in named["SchedEvent"]


def _python_files():
    return sorted(p for p in (ROOT / "exporter").rglob("*.py") if "_plugin" not in p.parts)


def test_no_python_identifier_uses_the_old_spellings():
    """Names, parameters, keywords and definitions: none spelled the old way;
    attributes only where a decoder reads a BPF struct (exporter/sources/)."""
    bad = []
    for path in _python_files():
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            name = (node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, (ast.arg, ast.keyword))
                    else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
            if name in OLD:
                bad.append(f"{rel}:{node.lineno}: {name}")
            if isinstance(node, ast.Attribute) and node.attr in OLD and not rel.startswith("exporter/sources/"):
                bad.append(f"{rel}:{node.lineno}: .{node.attr}")
    assert not bad, bad


def test_source_means_a_measurement_source():
    """The agent's BPF programs are `programs`; the MCP server's recordings and
    nodes are its `Targets`."""
    from exporter.agent.loop import Agent
    from exporter.offline import mcp_server

    assert isinstance(inspect.getattr_static(Agent, "programs"), property)
    assert not hasattr(Agent, "sources") and not hasattr(mcp_server, "Sources")
    assert {f.name for f in dataclasses.fields(mcp_server.Targets)} >= {"dbs", "nodes"}
