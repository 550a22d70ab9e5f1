"""Building a Config: the argparse options of `run` and `trace`, generated from
the settings, the `run --config` TOML file, and the environment, in one place.

    flag  >  run --config FILE  >  environment variable  >  default
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any

from exporter.agent.config.settings import GROUPS, SETTINGS, Config, SetupError, settings
from exporter.agent.config.values import _text


def add_options(parser, command: str, *, config_flag: bool = False) -> None:
    """`command`'s options, one per setting, in GROUPS. Unset options are left
    out of the namespace (argparse.SUPPRESS): `build` tells a flag given from
    a default that way. config_flag: add --config FILE (run)."""
    groups = {}
    for s in settings(command):
        if s.group not in groups:
            title, description = GROUPS[s.group]
            groups[s.group] = parser.add_argument_group(title.replace("`", "'").lower(), description)
        text = s.help + (f" (environment: ${', $'.join(s.env)})" if s.env else "")
        kw: dict[str, Any] = {"dest": s.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if s.switch:
            kw["action"] = "store_true"
        else:
            kw["metavar"] = s.metavar
            if s.choices:
                kw["choices"] = s.choices
                kw.pop("metavar")
            if s.parse is not _text:
                kw["type"] = s.parse
            if s.many:
                kw["action"] = "append"
        groups[s.group].add_argument(s.flag, **kw)
    if config_flag:
        parser.add_argument("--config", metavar="FILE", default=None,
                            help="TOML file: any flag of this command as a key, its name with underscores "
                                 "(listen = \"0.0.0.0:9862\", slow_threshold = \"20ms\"); a flag given too "
                                 "wins, and both win over environment variables (docs/configuration.md)")


# --- the one place a Config is built -------------------------------------------------------

def load_toml(path: str, command: str) -> dict:
    """The `--config` file: {setting name: raw value}; SetupError for an
    unreadable file or an unknown key (one line naming the known ones)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise SetupError(f"config file {path} does not exist") from None
    except OSError as e:
        raise SetupError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SetupError(f"config file {path} is not valid TOML: {e}") from None
    known = {s.key: s for s in settings(command)}
    aliases = {a: s.key for s in known.values() for a in s.toml_aliases}
    unknown = sorted(k for k in table if k not in known and k not in aliases)
    if unknown:
        raise SetupError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    return {aliases.get(k, k): v for k, v in table.items()}


def build(command: str, given: dict | argparse.Namespace | None = None, environ=None) -> Config:
    """The Config of `command` from the flags given (an argparse namespace made
    by add_options, or a dict), the --config file they name and the
    environment: flag > config file > environment > default."""
    given = dict(vars(given) if isinstance(given, argparse.Namespace) else given or {})
    environ = dict(os.environ if environ is None else environ)
    path = given.get("config")
    table = load_toml(path, command) if path else {}
    by_name = {s.name: s for s in settings(command)}
    # every value of the file is checked, also one a flag overrides
    table = {k: by_name[k].parse_value(v, f"config file {path}: {k}") for k, v in table.items()}
    values, origins = {}, {}
    for s in by_name.values():
        if s.name in given:
            value, origin = given[s.name], "flag"
            if s.many:
                value = tuple(value)
        elif s.name in table:
            value, origin = table[s.name], "config"
        else:
            value, origin = s.default, "default"
            for var in s.env:
                if environ.get(var, "").strip():
                    try:
                        value = (s.env_parse or s._one)(environ[var].strip())
                    except argparse.ArgumentTypeError as e:
                        raise SetupError(f"${var} {environ[var]!r}: {e}") from None
                    origin = f"${var}"
                    break
        values[s.name], origins[s.name] = value, origin
    if not (values.get("node") or "").strip():
        values["node"] = socket.gethostname()
    cfg = Config(**values, command=command, config_file=path, origins=origins, environ=environ)
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """What one setting cannot say alone: settings that need another."""
    def flag(name):
        return next(s.flag for s in SETTINGS if s.name == name)

    if cfg.command != "run":
        pass
    elif not cfg.query_listen:
        stray = [flag(n) for n in ("query_token_file", "query_tls_cert", "query_tls_key") if getattr(cfg, n)]
        if stray:
            raise SetupError(f"{'/'.join(stray)} need --query-listen HOST:PORT")
    elif not cfg.db:
        raise SetupError("--query-listen needs --db PATH: queries are answered from the recording")
    elif not cfg.query_token_file:
        raise SetupError("--query-listen needs --query-token-file F (a bearer token)")
    if cfg.kubelet_token_file and not cfg.kubelet_url:
        raise SetupError("--kubelet-token-file needs --kubelet-url")
    if cfg.kubelet_url and not cfg.kubelet_url.startswith(("http://", "https://")):
        raise SetupError(f"--kubelet-url {cfg.kubelet_url!r}: an http:// or https:// URL, e.g. https://10.0.0.5:10250")
    for name in ("kubelet_token_file", "kubelet_ca_file"):
        path = getattr(cfg, name)
        if path and not os.access(path, os.R_OK):
            raise SetupError(f"{flag(name)} {path}: cannot read it")
