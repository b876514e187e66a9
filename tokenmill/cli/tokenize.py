"""`tokenmill tokenize`: print token ids like llama.cpp's `llama-tokenize --ids`."""

from __future__ import annotations

import argparse

from tokenmill.catalog import resolve_model
from tokenmill.cli.common import read_text_arg
from tokenmill.errors import TokenmillError


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="print the token ids of a text",
        description="Tokenize TEXT (or --file) with the model's tokenizer and print the ids "
        "space-separated on one line.",
    )
    p.add_argument("text", nargs="?", help="text to tokenize")
    p.add_argument("--file", "-f", help="read the text from this file instead")
    p.add_argument("--model", "-m", default=None, help="catalog alias, GGUF file or HF directory")
    p.add_argument(
        "--models-dir", default=None, help="model cache (default: ~/.cache/tokenmill/models)"
    )
    p.add_argument("--no-bos", action="store_true", help="leave out the BOS token")
    p.add_argument(
        "--no-parse-special",
        action="store_true",
        help="treat special-token text such as <|im_start|> as plain text",
    )
    p.set_defaults(run=run)


def load_tokenizer(model: str | None, models_dir: str | None):
    """The tokenizer alone: no weights are read, so this is quick even for large models."""
    from tokenmill.model.gguf_file import read_gguf_metadata
    from tokenmill.tokenizer import Tokenizer

    path = resolve_model(model, models_dir=models_dir)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise TokenmillError(f"{path}: no tokenizer found (tokenizer.json is missing)")
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))


def run(args: argparse.Namespace) -> int:
    text = read_text_arg(args.text, args.file)
    tok = load_tokenizer(args.model, args.models_dir)
    ids = tok.encode(
        text, add_bos=False if args.no_bos else None, parse_special=not args.no_parse_special
    )
    print(" ".join(map(str, ids)))
    return 0
