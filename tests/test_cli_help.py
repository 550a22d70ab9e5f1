"""--help teaches: every command has a description or a help line, and every
option and argument of every command says what it does (the brief: "--help
that teaches"). Read from the parser the CLI builds, so a new option without
help fails here."""

from __future__ import annotations

import argparse

from exporter.cli import build_parser


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def test_every_option_has_help():
    missing = []
    for path, parser in _walk(build_parser(), ()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            if not (action.help or "").strip():
                missing.append(f"nccl-exporter {' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "no help text:\n" + "\n".join(missing)


def test_every_command_says_what_it_does():
    bare = []
    for path, parser in _walk(build_parser(), ()):
        if path and not (parser.description or "").strip():
            bare.append(f"nccl-exporter {' '.join(path)}")
    # a command whose whole story fits its one-line help may lack a description,
    # but the agent commands and check must explain themselves
    for must in (("run",), ("trace",), ("check",), ("mcp",), ("demo",)):
        assert f"nccl-exporter {' '.join(must)}" not in bare, f"{must}: no description"


def test_configuration_reference_names_every_run_flag():
    """docs/configuration.md is generated from the settings (tests/test_config.py
    keeps it in sync); every flag the parser has is in it, --config too."""
    from conftest import REPO

    text = (REPO / "docs" / "configuration.md").read_text()
    for command in ("run", "trace"):
        (parser,) = [p for path, p in _walk(build_parser(), ()) if path == (command,)]
        flags = {s for a in parser._actions if a.help != argparse.SUPPRESS
                 for s in a.option_strings if s.startswith("--") and s != "--help"}
        missing = sorted(f for f in flags if f"`{f}" not in text)
        assert not missing, f"{command} flags not in docs/configuration.md: {missing}"
    readme = (REPO / "README.md").read_text()
    assert "docs/configuration.md" in readme and "docs/troubleshooting.md" in readme
