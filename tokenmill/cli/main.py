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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenmill", description="Run, serve and benchmark LLMs on CPU and GPU."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        importlib.import_module(module_name).add_parser(sub, name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except TokenmillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
