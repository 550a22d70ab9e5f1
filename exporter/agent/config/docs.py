"""docs/configuration.md, generated from the settings:
`python -m exporter.agent.config --markdown > docs/configuration.md`."""

from __future__ import annotations

import argparse
import sys

from exporter.agent.config.settings import GROUPS, SETTINGS
from exporter.agent.config.values import _milliseconds

DOC = "docs/configuration.md"

HEADER = """\
# Configuration reference

> Generated from `exporter/agent/config/settings.py` by
> `python -m exporter.agent.config --markdown > docs/configuration.md`;
> `tests/test_config.py` fails when this page is stale. Edit the settings
> there, not this page.

`run` and `trace` read one typed configuration. Each setting is a flag; every
`run` flag is also a key of `run --config FILE` (TOML: the flag's name with
underscores, e.g. `--slow-threshold` is `slow_threshold`), and a few settings
may come from an environment variable. Where a setting has several sources
the first one wins:

**flag > config file > environment variable > default**

Durations are `250ms`, `30s`, `5m`, `100us`, or a plain number of seconds.
`nccl-exporter run --help` and `nccl-exporter trace --help` say the same.
"""

FOOTER = """\
## `run --config FILE`

TOML: any `run` flag as a key, its name with underscores. A string value is
read as the flag's text (`"30s"`, `"0.0.0.0:9862"`), a number as that
number, a flag without a value (`--protobuf-classic-buckets`) as `true` or
`false`, a repeatable flag as a list (a single string is a list of one);
`slow_threshold` may also be a table `OP = DURATION`. `nccl_libs`, the key's
older name, is still read. An unknown key, or a value the flag would refuse,
is a one-line error (the unknown key's error lists the known ones).

```toml
node = "gpu-017"
listen = "0.0.0.0:9862"
nccl_lib = ["/opt/nccl/lib/libnccl.so.2"]
log_level = "info"
log_format = "json"
otlp_endpoint = "http://tempo.monitoring:4317"
slow_threshold = { ALL_REDUCE = "200ms", ALL_GATHER = "100ms" }
series_ttl = "10m"
db = "/var/lib/nccl-exporter/nccl.db"
protobuf_classic_buckets = true
```

## Other environment variables

Read by the agent and the CLI besides the settings' own above:

{environment}
Read by the profiler plugin inside the training process (set them in the
job's environment, beside `NCCL_PROFILER_PLUGIN`): `NCCL_EXPORTER_PROFILER_LOG`,
`NCCL_EXPORTER_PROFILER_CHAIN`, `NCCL_EXPORTER_PROFILER_POOL`,
`NCCL_EXPORTER_PROFILER_MAX_AGE_S`, `NCCL_EXPORTER_PROFILER_ANNOUNCE_MS`,
`NCCL_EXPORTER_PROFILER_PROXY_POOL`, `NCCL_EXPORTER_PROFILER_CLOCK_WINDOW_MS`,
`NCCL_EXPORTER_PROFILER_CLOCK_ERROR_US` ([plugin.md](plugin.md)) and
`NCCL_EXPORTER_PROFILER_PROXY` ([network.md](network.md)).

Read from each traced process's own environment (`/proc/<pid>/environ`),
never from the agent's: the launcher's rank and world size (`RANK`,
`WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `SLURM_PROCID`, …) and
`POD_NAME`, `POD_NAMESPACE`, `HOSTNAME` ([deploy.md](deploy.md), "Pod
identity").

`NCCL_SIM_*` variables belong to the simulator ([simulator.md](simulator.md)).
"""


# Variables read besides the settings' own: (variable, read by, what).
ENVIRONMENT = [
    ("`NCCL_EXPORTER_QUERY_TOKEN`", "`fleet`, `mcp`", "the bearer token when `--token-file` is not given"),
    ("`NCCL_EXPORTER_PLUGIN_BUILD`", "`run`, `plugin-path`, `check`",
     "where the profiler plugin is built and looked for ([plugin.md](plugin.md#enabling-it))"),
    ("`NCCL_EXPORTER_STORE_QUEUE`", "`run --db`, `trace --db`",
     "events the recorder queues before it drops (default 65536; counted in "
     "`nccl_exporter_recording_dropped_total`)"),
    ("`BCC_KERNEL_SOURCE`", "`run`, `trace`, `check`",
     "kernel headers for BCC when `/lib/modules/$(uname -r)/build` has none"),
    ("`XDG_CACHE_HOME`, `HOME`", "builds outside a checkout",
     "where the plugin and the simulator are built (`…/nccl-exporter/`)"),
    ("`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, `OTEL_EXPORTER_OTLP_METRICS_PROTOCOL`", "`run`",
     "the OTLP protocol of one signal, before `$OTEL_EXPORTER_OTLP_PROTOCOL` (a flag or key wins)"),
    ("`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`", "`run`",
     "the OTLP resource (default `service.name=nccl-exporter`)"),
    ("other `OTEL_EXPORTER_OTLP_*` (headers, certificates, timeouts)", "`run`",
     "honoured by the OpenTelemetry SDK's exporters"),
    ("`NOTIFY_SOCKET`", "`run`", "set by systemd (`Type=notify`): `READY=1` is sent there"),
]


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def markdown() -> str:
    """docs/configuration.md: HEADER, a table per group of settings, FOOTER."""
    out = [HEADER]
    for group, (title, description) in GROUPS.items():
        rows = [s for s in SETTINGS if s.group == group]
        if not rows:
            continue
        out.append(f"## {title}\n")
        if description:
            out.append(description + "\n")
        out.append("| flag | of | `run --config` key | default | environment | what |")
        out.append("|---|---|---|---|---|---|")
        for s in rows:
            value = f" {s.metavar}" if s.metavar and not s.choices else ""
            if s.choices:
                value = " " + "|".join(s.choices)
            flag = f"`{s.flag}{value}`" + (" (repeatable)" if s.many else "")
            env = ", ".join(f"`${v}`" for v in s.env) or ""
            if s.env_parse is _milliseconds:
                env += " (ms)"
            commands = ", ".join(s.commands)
            key = f"`{s.key}`" if "run" in s.commands else "none"
            out.append(f"| {_cell(flag)} | {commands} | {key} | {_cell(s.shown or 'none')} | {env} | {_cell(s.help)} |")
        out.append("")
    out.append("`--config FILE` (`run`) names the TOML file below. `trace --out`, the older name of "
               "`trace --db`, is read for one more release, with a warning.\n")
    table = ["| variable | read by | what |", "|---|---|---|"] + [f"| {v} | {by} | {what} |"
                                                            for v, by, what in ENVIRONMENT]
    out.append(FOOTER.replace("{environment}", "\n".join(table)))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m exporter.agent.config",
                                description="print docs/configuration.md, generated from the settings")
    p.add_argument("--markdown", action="store_true", help="the Markdown page (the default)")
    p.parse_args(argv)
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
