"""`tokenmill pull` and `tokenmill models`: fetch catalog models and show what is available."""

from __future__ import annotations

import argparse

from tokenmill.catalog import CATALOG, DEFAULT_MODEL, list_models, models_dir, pull

_MODELS_DIR_HELP = (
    "model cache directory (default: $TOKENMILL_MODELS_DIR or ~/.cache/tokenmill/models)"
)


def add_parser(subparsers: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    """Register `name` ("pull" or "models"); both live here because they share the catalog."""
    if name == "pull":
        parser = subparsers.add_parser(
            "pull",
            help="download a catalog model into the cache",
            description="Download a model from the catalog (see `tokenmill models`), verify its "
            "size and sha256 and store it in the model cache. Prints the cached file's path. "
            "Models already cached are not downloaded again unless --force is given.",
        )
        parser.add_argument(
            "model",
            nargs="?",
            default=DEFAULT_MODEL,
            metavar="MODEL",
            help=f"catalog alias, one of: {', '.join(CATALOG)} (default: {DEFAULT_MODEL})",
        )
        parser.add_argument("--force", action="store_true", help="download again even if cached")
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="no download progress on stderr"
        )
        parser.set_defaults(run=run_pull)
    elif name == "models":
        parser = subparsers.add_parser(
            "models",
            help="list catalog models and models in the cache",
            description="List the catalog's models, whether each is cached, and any other GGUF "
            "files or Hugging Face model directories found in the model cache.",
        )
        parser.set_defaults(run=run_models)
    else:
        raise ValueError(f"tokenmill.cli.models has no command '{name}'")
    parser.add_argument("--models-dir", metavar="DIR", help=_MODELS_DIR_HELP)
    return parser


def run_pull(args: argparse.Namespace) -> int:
    print(pull(args.model, args.models_dir, progress=not args.quiet, force=args.force))
    return 0


def _human_size(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def run_models(args: argparse.Namespace) -> int:
    rows = [("MODEL", "CACHED", "SIZE", "FORMAT", "DESCRIPTION")]
    for m in list_models(args.models_dir):
        if m.entry is not None:
            fmt = f"{m.entry.architecture} {m.entry.quantization}"
            default = " (default)" if m.name == DEFAULT_MODEL else ""
            desc = m.entry.description + default
        else:
            fmt, desc = ("gguf" if m.path.is_file() else "hf"), str(m.path)
        rows.append((m.name, "yes" if m.cached else "no", _human_size(m.size), fmt, desc))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    print(f"\ncache: {models_dir(args.models_dir)}")
    return 0
