"""docs/cli.md is generated from the argparse definitions and must match them."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "run `python scripts/gen_cli_docs.py` and commit docs/cli.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _docs() -> str:
    path = ROOT / "docs" / "cli.md"
    assert path.is_file(), f"docs/cli.md is missing: {REGENERATE}"
    return path.read_text(encoding="utf-8")


def test_cli_docs_match_the_argparse_definitions() -> None:
    expected = _generator().render()
    assert _docs() == expected, f"docs/cli.md is out of date with tokenmill/cli/: {REGENERATE}"


def test_cli_docs_name_every_flag_of_every_command() -> None:
    """Independent of the generator's output format: every option string that `--help` shows,
    of every subcommand, appears on the page, in that command's section."""
    from tokenmill.cli.main import build_parser

    docs = _docs()
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        heading = f"## `tokenmill {name}`"
        assert heading in docs, f"docs/cli.md has no section for `tokenmill {name}`: {REGENERATE}"
        section = docs.split(heading, 1)[1].split("\n## ", 1)[0]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}" in section, (
                    f"`tokenmill {name} {option}` is not in docs/cli.md: {REGENERATE}"
                )
