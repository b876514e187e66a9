"""`tokenmill generate`: complete a prompt and stream the continuation to stdout."""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.common import (
    add_compile_arg,
    add_model_args,
    add_parallel_args,
    engine_from_args,
    read_text_arg,
)
from tokenmill.sample import SamplingParams, StructuredOutputs


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="complete a prompt (greedy by default)",
        description="Complete PROMPT with the model and print the continuation as it is generated.",
    )
    p.add_argument("prompt", help="text to continue")
    add_model_args(p)
    add_compile_arg(p)
    add_parallel_args(p)
    p.add_argument(
        "--max-tokens", "-n", type=int, default=64, help="most tokens to generate (default: 64)"
    )
    p.add_argument(
        "--temperature", "-t", type=float, default=0.0, help="sampling temperature; 0 is greedy"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument(
        "--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)"
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--stop", action="append", default=[], help="stop at this string (repeatable)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template as a user turn",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", help="output JSON following the JSON schema in FILE"
    )
    constraint.add_argument("--regex", help="output text the regular expression matches whole")
    constraint.add_argument(
        "--choice", action="append", help="output exactly one of these strings (repeatable)"
    )
    constraint.add_argument(
        "--grammar", metavar="FILE", help="output text of the Lark or GBNF grammar in FILE"
    )
    p.set_defaults(run=run)


def structured_outputs(args: argparse.Namespace) -> StructuredOutputs | None:
    """The output constraint the command line asks for, if any."""
    if args.json_schema:
        return StructuredOutputs(json=read_text_arg(None, args.json_schema))
    if args.grammar:
        return StructuredOutputs(grammar=read_text_arg(None, args.grammar))
    if args.regex is not None or args.choice:
        return StructuredOutputs(regex=args.regex, choice=args.choice)
    return None


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_outputs(args),
    )
    params.validate()
    engine = engine_from_args(args, max_num_seqs=1, compile=args.compile)
    try:
        prompt: str | list[int] = args.prompt
        if args.chat:
            prompt = engine.tokenize(messages=[{"role": "user", "content": args.prompt}])
        engine.add_request("cli", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                sys.stdout.write(out.outputs[0].text_delta)
                sys.stdout.flush()
    finally:
        engine.shutdown()
    sys.stdout.write("\n")
    return 0
