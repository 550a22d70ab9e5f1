"""The agent's configuration: every setting of `run` and `trace`, defined once.

Each field of `Config` is one setting: its type, default, flag, help, the
environment variables that may set it, and the `run --config` TOML key (the
flag's name with underscores). The argparse options of `run` and `trace`
(`add_options`), the TOML reader (`build`) and docs/configuration.md
(`docs.markdown`; `python -m exporter.agent.config --markdown`) are all made from
these fields, so a new setting is one field here.

Where a setting has several sources the first one wins:

    flag  >  run --config FILE  >  environment variable  >  default

To add a setting: one `setting(...)` field of Config in settings.py; read it as
`cfg.<name>`. The value parsers are in values.py.
"""

from exporter.agent.config.build import add_options, build, check, load_toml
from exporter.agent.config.settings import GROUPS, SETTINGS, Config, Setting, SetupError, settings

__all__ = ["Config", "GROUPS", "SETTINGS", "Setting", "SetupError", "add_options", "build", "check",
           "load_toml", "settings"]
