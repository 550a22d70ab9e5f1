"""The MCP server's stdio transport, with the JSON-RPC checks the SDK leaves out:
a line that is not a JSON-RPC message gets a JSON-RPC error (-32700, -32600)
instead of silence (docs/fleet-live.md). The tools themselves are in
mcp_server.py.
"""

from __future__ import annotations


def jsonrpc_error(line: str):
    """None for a line the SDK takes as a JSON-RPC message; else (code, message, id) of the
    error JSON-RPC 2.0 asks for: -32700 for what is not JSON, -32600 for JSON that is not
    a request (a batch, no method, a wrong jsonrpc, ...)."""
    import json

    import mcp_types as types

    try:
        types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        return None
    except Exception:  # noqa: BLE001 - pydantic's ValidationError, and anything else it says
        pass
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):
        return types.PARSE_ERROR, "Parse error: not JSON", None
    rid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(rid, bool) or not isinstance(rid, (int, str)):
        rid = None
    if isinstance(obj, list):
        why = "a batch (JSON array) is not served"
    elif not isinstance(obj, dict):
        why = "not a JSON object"
    elif obj.get("jsonrpc") != "2.0":
        why = 'jsonrpc must be "2.0"'
    elif "method" not in obj and "result" not in obj and "error" not in obj:
        why = "no method"
    else:
        why = "not a valid request"
    return types.INVALID_REQUEST, f"Invalid Request: {why}", rid


class _CheckedLines:
    """stdin's lines for the SDK's stdio transport, less the ones that are not JSON-RPC
    messages: those are answered here with a JSON-RPC error (the SDK drops them without
    a word) through the transport's own writer, so answers never interleave."""

    def __init__(self, lines):
        self.lines = lines
        self.out = None
        self.ready = None

    def __aiter__(self):
        return self._checked()

    async def _checked(self):
        import mcp_types as types
        from mcp.shared.message import SessionMessage

        async for line in self.lines:
            if not line.strip():
                continue
            bad = jsonrpc_error(line)
            if bad is None:
                yield line
                continue
            code, message, rid = bad
            await self.ready.wait()
            await self.out.send(SessionMessage(types.JSONRPCError(
                jsonrpc="2.0", id=rid, error=types.ErrorData(code=code, message=message))))


async def serve_stdio(mcp) -> None:
    """Serve `mcp` (build_server's) on stdin/stdout until stdin ends."""
    import io
    import sys

    import anyio
    from mcp.server.stdio import stdio_server

    # the SDK's low-level server (MCPServer: _lowlevel_server; 1.x FastMCP: _mcp_server):
    # run() on our streams is the only way to put _CheckedLines in front of it
    server = getattr(mcp, "_lowlevel_server", None) or mcp._mcp_server
    lines = _CheckedLines(anyio.wrap_file(io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8",
                                                           errors="replace")))
    lines.ready = anyio.Event()
    async with stdio_server(stdin=lines) as (read_stream, write_stream):
        lines.out = write_stream
        lines.ready.set()
        await server.run(read_stream, write_stream, server.create_initialization_options())
