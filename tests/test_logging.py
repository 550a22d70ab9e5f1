"""`--log-format json` (docs/troubleshooting.md, "Logs"): the real CLI's
`run` and `trace`, attached to the real NCCL library, write only JSON
objects, one a line, with the stable keys of exporter/agent/logs.py LOG_KEYS; the node is
the one given; comm and rank appear where a line is about one.

The agent runs need root, BPF and the real NCCL wheel (the heavy lock).
"""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO, require_real_nccl, run_cli, running_exporter
from exporter.agent.logs import LOG_CONTEXT_KEYS, LOG_KEYS


def json_lines(text: str) -> list[dict]:
    """Every non-empty line parsed; a line that is not a JSON object fails."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\n--- whole output ---\n{text}") from None
        assert isinstance(record, dict), line
        out.append(record)
    return out


def check_keys(records: list[dict], node: str) -> None:
    assert records
    for r in records:
        missing = set(LOG_KEYS) - set(r)
        assert not missing, f"{r}: no {missing}"
        assert r["node"] == node, r
        assert r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), r
        assert r["time"].endswith("+00:00") and "T" in r["time"], r  # ISO 8601, UTC


def test_context_keys_and_text_format():
    """comm and rank where a call passes them; no JSON in the default text format."""
    code = ("import logging; from exporter.agent.logs import setup_logging; "
            "setup_logging('info', sys.argv[1], 'n7'); "
            "logging.getLogger('nccl_exporter').warning('slow %s', 'x', extra={'comm': 'ab12', 'rank': 3}); "
            "logging.getLogger('nccl_exporter').info('plain')")
    for fmt in ("json", "text"):
        p = subprocess.run([sys.executable, "-c", "import sys; " + code, fmt], capture_output=True, text=True,
                           cwd=str(REPO), timeout=60)
        assert p.returncode == 0, p.stderr
        if fmt == "text":
            assert "WARNING slow x" in p.stderr and not p.stderr.lstrip().startswith("{")
            continue
        slow, plain = json_lines(p.stderr)
        check_keys([slow, plain], "n7")
        assert (slow["message"], slow["level"], slow["comm"], slow["rank"]) == ("slow x", "WARNING", "ab12", 3)
        assert not set(LOG_CONTEXT_KEYS) & set(plain), plain


def test_run_writes_json_lines(bpf):  # bpf: the marker, root and the heavy lock
    lib = require_real_nccl()
    with running_exporter("--node", "json-node", "--log-format", "json", "--log-level", "info",
                          "--nccl-lib", lib, start_timeout=120,
                          ready=lambda e: '"ready: probes loaded' in e.output()) as e:
        pass
    records = json_lines(e.output())
    check_keys(records, "json-node")
    messages = [r["message"] for r in records]
    assert any(m.startswith("ready: probes loaded and attached") for m in messages), messages
    assert any("metrics at http://127.0.0.1:" in m for m in messages), messages  # the status lines too
    assert messages[-1] == "nccl-exporter: stopped", messages


def test_trace_writes_json_lines_on_stderr(bpf):
    lib = require_real_nccl()
    p = run_cli("trace", "--duration", "1s", "--format", "json", "--log-format", "json", "--log-level", "info",
                "--node", "trace-node", "--nccl-lib", lib, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    records = json_lines(p.stderr)
    check_keys(records, "trace-node")
    messages = [r["message"] for r in records]
    assert any(m.startswith("tracing NCCL calls for 1 s") for m in messages), messages
    assert "calls traced in" in messages[-1], messages
    json_lines(p.stdout)  # the events: JSON too (--format json)
