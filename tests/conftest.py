"""What the tests share lives in tests/fixtures/, a module per topic (its
__init__ lists them); this file loads those with fixtures or hooks as plugins
and re-exports the helpers tests import by name:

    from conftest import REPO, running_exporter, sample_value

The kinds of test (bpf, netns, real_nccl, prometheus, slow) are markers applied
from the fixtures a test uses, and the heavy ones take /tmp/nccl-heavy.lock:
tests/fixtures/markers.py.
"""

from __future__ import annotations

import pytest

# before the imports below: the helpers' asserts explain themselves as a test's do
pytest.register_assert_rewrite("fixtures")

from fixtures.agent import (  # noqa: E402
    READY_METRIC,
    Exporter,
    ExporterProcess,
    free_port,
    recording,
    run_cli,
    running_exporter,
    start_recorder,
    wait_for_detaching,
    wait_recording,
)
from fixtures.kernel import pin  # noqa: E402
from fixtures.paths import CLI, REAL_NCCL_LIB, REPO, require_real_nccl, require_root  # noqa: E402
from fixtures.prometheus import (  # noqa: E402
    CLASSIC,
    check_promql,
    classic_bucket,
    exposition,
    parse_metrics,
    sample_value,
    sample_values,
    serve_text,
    series_by_labels,
)

pytest_plugins = [
    "fixtures.markers",    # the kinds of test and the heavy lock (hooks and fixtures)
    "fixtures.agent",      # launch_exporter
    "fixtures.kernel",     # tcp, sched
    "fixtures.libraries",  # simulator_lib, lib, plugin, fake_nccl_lib, static_nccl_lib, plain_lib
]

__all__ = [
    "CLASSIC", "CLI", "READY_METRIC", "REAL_NCCL_LIB", "REPO",
    "Exporter", "ExporterProcess", "check_promql", "classic_bucket", "exposition", "free_port",
    "parse_metrics", "pin", "recording", "require_real_nccl", "require_root", "run_cli", "running_exporter",
    "sample_value", "sample_values", "serve_text", "series_by_labels", "start_recorder", "wait_for_detaching",
    "wait_recording",
]
