"""The agent's one configuration (exporter/agent/config, docs/configuration.md):
every `run` flag is a `run --config` key read the same way, flag > file >
environment > default, an unknown key is one line naming the known ones, the
page is generated from the settings, and the recording's old flag names
still work with a warning. Pure logic on the real parser and the real TOML
reader; tests/test_cli_errors.py runs the CLI on bad files."""

from __future__ import annotations

import argparse

import pytest

from conftest import REPO
from exporter.agent import config
from exporter.agent.config import SetupError, values
from exporter.agent.config.docs import markdown
from exporter.cli import build_parser

# A text each kind of value accepts, other than its default: a new parser
# without one here fails test_every_run_flag_is_a_config_key.
SAMPLES = {
    values.parse_duration: "7s", values.positive_int: "7", values.positive_duration: "7s",
    values.positive_factor: "2.5", values.parse_idle_detach: "off", values.parse_srtt_sampling: "1s/10s",
    values.parse_owner_window: "always", values.parse_runq_wait_min: "1ms", values.parse_listen: "127.0.0.1:9999",
    values.parse_slow_threshold: "ALL_REDUCE=20ms", values._text: "some-text",
}


def _sample(s: config.Setting) -> str:
    if s.choices:
        return [c for c in s.choices if c != s.default][0]
    assert s.parse in SAMPLES, f"{s.flag}: add a sample text of {s.parse.__name__} to SAMPLES"
    return SAMPLES[s.parse]


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return str(path)


def _toml_value(s: config.Setting, text: str) -> str:
    if s.switch:
        return "true"
    return f'["{text}"]' if s.many else f'"{text}"'


def test_every_run_flag_is_a_config_key(tmp_path):
    """Each option of `run` (read from the parser the CLI builds) is a setting,
    and its key in the file gives the value its flag gives."""
    (run,) = [a for a in build_parser()._subparsers._group_actions[0].choices.items() if a[0] == "run"]
    dests = {a.dest for a in run[1]._actions if a.dest not in ("help", "config")}
    by_name = {s.name: s for s in config.settings("run")}
    assert dests == set(by_name), "run options that are not settings, or settings without an option"
    for name, s in sorted(by_name.items()):
        text = _sample(s)
        flag_args = vars(_parse(["run", s.flag] if s.switch else ["run", s.flag, text]))
        table = config.load_toml(_toml(tmp_path, f"{s.key} = {_toml_value(s, text)}\n"), "run")
        from_file = s.parse_value(table[s.key], "test")
        from_flag = tuple(flag_args[name]) if s.many else flag_args[name]
        assert from_file == from_flag, (s.key, from_file, from_flag)
        assert from_file != s.default, f"{s.key}: the sample is the default, so this proves nothing"


def test_a_full_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret\n")
    cfg = config.build("run", {"config": _toml(tmp_path, f'''
node = "gpu-017"
listen = "127.0.0.1:9999"
nccl_libs = ["/opt/nccl/lib/libnccl.so.2"]
slow_threshold = {{ ALL_REDUCE = "200ms", ALL_GATHER = "100ms" }}
series_ttl = 600
series_capacity = 4096
protobuf_classic_buckets = true
idle_detach = "off"
db = "/var/lib/nccl.db"
query_listen = "127.0.0.1:9863"
query_token_file = "{token}"
''')}, environ={})
    assert cfg.node == "gpu-017" and cfg.listen == ("127.0.0.1", 9999)
    assert cfg.nccl_lib == ("/opt/nccl/lib/libnccl.so.2",)  # the key's older name
    assert cfg.slow_thresholds == {"ALL_REDUCE": 200_000_000, "ALL_GATHER": 100_000_000}
    assert cfg.series_ttl == 600.0 and cfg.series_capacity == 4096
    assert cfg.protobuf_classic_buckets is True and cfg.idle_detach == float("inf")
    assert cfg.query_listen == ("127.0.0.1", 9863)
    assert cfg.origins["node"] == "config" and cfg.origins["sched"] == "default"


def test_precedence_flag_file_environment_default(tmp_path):
    path = _toml(tmp_path, 'node = "from-file"\notlp_endpoint = "http://file:4317"\n')
    env = {"NCCL_EXPORTER_NODE": "from-env", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317",
           "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://env-metrics:4317", "OTEL_METRIC_EXPORT_INTERVAL": "15000"}
    flags = vars(_parse(["run", "--config", path, "--node", "from-flag"]))
    cfg = config.build("run", flags, environ=env)
    assert (cfg.node, cfg.origins["node"]) == ("from-flag", "flag")
    assert (cfg.otlp_endpoint, cfg.origins["otlp_endpoint"]) == ("http://file:4317", "config")
    assert (cfg.otlp_metrics_endpoint, cfg.origins["otlp_metrics_endpoint"]) == (
        "http://env-metrics:4317", "$OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
    assert cfg.otlp_metrics_interval == 15.0  # the variable is in ms
    cfg = config.build("run", vars(_parse(["run", "--config", path])), environ=env)
    assert cfg.node == "from-file"
    cfg = config.build("run", vars(_parse(["run"])), environ=env)
    assert (cfg.node, cfg.otlp_endpoint) == ("from-env", "http://env:4317")
    cfg = config.build("run", vars(_parse(["run"])), environ={})
    assert (cfg.origins["node"], cfg.otlp_endpoint, cfg.otlp_metrics_interval) == ("default", None, 60.0)
    assert cfg.node  # the hostname


def test_otlp_protocol_of_each_signal():
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"}
    cfg = config.build("run", {}, environ=env)
    assert (cfg.otlp_protocol_for("traces"), cfg.otlp_protocol_for("metrics")) == ("http/protobuf", "grpc")
    cfg = config.build("run", vars(_parse(["run", "--otlp-protocol", "http/protobuf"])), environ=env)
    assert cfg.otlp_protocol_for("metrics") == "http/protobuf"  # a flag beats every variable


def test_trace_has_its_own_defaults():
    run, trace = config.build("run", {}, environ={}), config.build("trace", {}, environ={})
    assert (run.log_level, run.sched) == ("info", "totals")
    assert (trace.log_level, trace.sched) == ("warning", "waits")


def test_unknown_key_is_one_line_naming_the_known_ones(tmp_path):
    path = _toml(tmp_path, 'nodee = "gpu-1"\nlisten = ":1"\n')
    with pytest.raises(SetupError) as e:
        config.build("run", {"config": path}, environ={})
    message = str(e.value)
    assert "\n" not in message and f"config file {path}: unknown key(s) nodee; known: " in message
    known = message.split("known: ")[1].split(", ")
    assert known == sorted(s.key for s in config.settings("run"))


@pytest.mark.parametrize("text,fragment", [
    ('log_format = "xml"', "log_format 'xml': one of text, json"),
    ('series_capacity = 0', "series_capacity 0: must be at least 1"),
    ('slow_threshold = { GATHERR = "1ms" }', "unknown op 'GATHERR'"),
    ('query_listen = ":1"', "--query-listen needs --db"),
])
def test_bad_values_are_one_line(tmp_path, text, fragment):
    with pytest.raises(SetupError, match=fragment):
        config.build("run", {"config": _toml(tmp_path, text + "\n")}, environ={})


def test_bad_environment_variable():
    with pytest.raises(SetupError, match=r"\$OTEL_METRIC_EXPORT_INTERVAL 'soon'"):
        config.build("run", {}, environ={"OTEL_METRIC_EXPORT_INTERVAL": "soon"})


def test_the_page_is_generated_from_the_settings():
    """docs/configuration.md is what `python -m exporter.agent.config --markdown`
    prints: regenerate it after changing a setting."""
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == markdown(), ("docs/configuration.md is stale: run "
                                "'.venv/bin/python -m exporter.agent.config --markdown > docs/configuration.md'")
    for s in config.SETTINGS:
        assert f"`{s.flag}" in page and s.help.replace("|", "\\|") in page


@pytest.mark.parametrize("argv,dest", [
    (["trace", "--out", "x.db"], "db"),
    (["merge", "--out", "x.db", "in.db"], "db"),
    (["merge", "-o", "x.db", "in.db"], "db"),
])
def test_old_recording_flag_still_works_with_a_warning(capsys, argv, dest):
    args = _parse(argv)
    assert getattr(args, dest) == "x.db"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is deprecated" in err and "use --db" in err


@pytest.mark.parametrize("command", ["trace", "merge"])
def test_old_recording_flag_is_not_in_help(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    assert "--db" in sub.format_help() and "--out" not in sub.format_help()
