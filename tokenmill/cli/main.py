"""`tokenmill` command line: one subcommand per module, each with `add_parser` and `run`."""

from __future__ import annotations

import argparse
import importlib
import sys

from tokenmill.errors import TokenmillError

# name -> module under tokenmill.cli providing add_parser(subparsers) and run(args) -> int
COMMANDS = {
    "serve": "tokenmill.cli.serve",
    "generate": "tokenmill.cli.generate",
    "tokenize": "tokenmill.cli.tokenize",
    "perplexity": "tokenmill.cli.perplexity",
    "pull": "tokenmill.cli.models",
    "models": "tokenmill.cli.models",
    "bench": "tokenmill.cli.bench",
    "chat": "tokenmill.cli.chat",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with every subcommand, or only `command` where it is one: a run
    then imports only its own command's module (`bench`'s brings in an HTTP client)."""
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="Run, serve and benchmark LLMs on CPU and GPU."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        if command not in COMMANDS or name == command:
            importlib.import_module(module_name).add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except TokenmillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
