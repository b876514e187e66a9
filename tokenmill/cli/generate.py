"""`tokenmill generate`: complete a prompt and stream the continuation to stdout."""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.common import add_model_args, load_from_args
from tokenmill.engine.simple import generate_tokens
from tokenmill.tokenizer import IncrementalDetokenizer


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="complete a prompt (greedy by default)",
                       description="Complete PROMPT with the model and print the continuation as it is generated.")
    p.add_argument("prompt", help="text to continue")
    add_model_args(p)
    p.add_argument("--max-tokens", "-n", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise SystemExit("error: --max-tokens must be at least 1")
    loaded = load_from_args(args)
    tok = loaded.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_bos=False)  # templates carry their own BOS, as in transformers
    else:
        prompt_ids = tok.encode(args.prompt)
    stops = frozenset() if args.ignore_eos else tok.stop_token_ids
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=True)
    for token in generate_tokens(loaded, prompt_ids, args.max_tokens, args.temperature, args.seed, stops):
        if token in stops:
            break
        sys.stdout.write(detok.push(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0
