"""`tokenmill chat`: a multi-turn chat in the terminal that streams each reply as it is
generated."""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from tokenmill.catalog import DEFAULT_MODEL
from tokenmill.cli.common import (
    add_compile_arg,
    add_model_args,
    add_parallel_args,
    engine_from_args,
)
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.sample import SamplingParams

Message = dict[str, str]

HELP = '''\
/help              show this help
/bye               exit (Ctrl-D does too)
/clear             forget the conversation, keeping the system prompt
/system [TEXT]     set the system prompt; without TEXT, show it
/set NAME VALUE    change temperature, top_p, top_k, max_tokens or seed
/stats             speed, cache hits and context use of the last reply
/save FILE         write the conversation to FILE as JSON messages
End a line with \\ to go on to the next one, or put a message between """ and """.
Ctrl-C stops a reply (the partial reply stays in the conversation); at the prompt it exits.'''

# What /set may change, and how to parse the value.
SETTABLE: dict[str, Callable[[str], float | int]] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "max_tokens": int,
    "seed": int,
}


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="chat with a model in the terminal",
        description="Talk to the model turn by turn through its chat template; replies stream "
        "as they are generated. Type /help at the prompt for the commands.",
    )
    add_model_args(p)
    add_compile_arg(p)
    add_parallel_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--temperature",
        "-t",
        type=float,
        default=0.7,
        help="sampling temperature; 0 is greedy (default: 0.7)",
    )
    p.add_argument(
        "--top-p", type=float, default=0.9, help="nucleus sampling threshold (default: 0.9)"
    )
    p.add_argument(
        "--max-tokens",
        "-n",
        type=int,
        default=None,
        help="most tokens per reply "
        "(default: until the model ends its turn or the context is full)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument(
        "--ctx",
        "-c",
        type=int,
        default=None,
        help="context length in tokens (default: the model's, as far as the KV cache holds)",
    )
    p.set_defaults(run=run)


@dataclass
class ReplyStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    reply_tokens: int
    ttft: float  # seconds from submitting the prompt to the first reply token
    decode_seconds: float  # from the first reply token to the last


class ChatSession:
    """One conversation on one engine, kept alive across turns so the prefix cache serves the
    conversation so far and only the newest turn is prefilled."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, system: str | None) -> None:
        self.engine = engine
        self.system = system
        self.turns: list[Message] = []  # user, assistant, user, assistant, ...
        self.last: ReplyStats | None = None
        self._ids = itertools.count()
        self.set_params(params)

    @property
    def messages(self) -> list[Message]:
        return self._with_system(self.turns)

    def _with_system(self, turns: list[Message]) -> list[Message]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns

    @property
    def reserve(self) -> int:
        """Tokens kept free for the reply: max_tokens, or a quarter of the context when it is
        unbounded."""
        return self.params.max_tokens or self.engine.max_model_len // 4

    def set_params(self, params: SamplingParams) -> None:
        params.validate(vocab_size=self.engine.loaded.config.vocab_size)
        if params.max_tokens is not None and params.max_tokens >= self.engine.max_model_len:
            raise TokenmillError(
                f"max_tokens must be below the context of {self.engine.max_model_len} tokens, "
                f"got {params.max_tokens}"
            )
        self.params = params

    def send(self, text: str) -> str:
        """Stream the reply to `text` to stdout and add both turns to the conversation.

        Ctrl-C only sets a flag here and the request is aborted between engine steps: an interrupt
        inside a step could leave prefix-cache blocks published whose KV was never written.
        """
        turns, ids = self._fit(text)
        request_id = f"chat-{next(self._ids)}"
        with _ctrl_c_as_flag() as interrupted:
            start = time.perf_counter()
            self.engine.add_request(request_id, ids, self.params)
            self.turns = turns
            first = None
            while self.engine.has_unfinished_requests():
                if interrupted.is_set():
                    self.engine.abort_request(request_id)
                for out in self.engine.step():
                    completion = out.outputs[0]
                    if first is None and completion.token_ids:
                        first = time.perf_counter()
                    sys.stdout.write(completion.text_delta)
                    sys.stdout.flush()
        end = time.perf_counter()
        sys.stdout.write("\n\n")
        reply = completion.text
        self.turns.append({"role": "assistant", "content": reply})
        self.last = ReplyStats(
            len(ids),
            out.num_cached_tokens,
            len(completion.token_ids),
            (first or end) - start,
            end - (first or end),
        )
        if completion.finish_reason == "abort":
            print("(stopped)", file=sys.stderr)
        elif completion.finish_reason == "length":
            print(f"(reply cut off at {len(completion.token_ids)} tokens)", file=sys.stderr)
        elif completion.finish_reason == "error":
            print(f"error: {out.error}", file=sys.stderr)
        return reply

    def _fit(self, text: str) -> tuple[list[Message], list[int]]:
        """The turns to send with `text` and their prompt ids: the oldest user/assistant pairs are
        dropped until the reply has `reserve` tokens of room (the system prompt always stays)."""
        turns = self.turns + [{"role": "user", "content": text}]
        limit = self.engine.max_model_len - self.reserve
        while len(ids := self._encode(turns)) > limit:
            if len(turns) == 1:
                raise TokenmillError(
                    f"this message needs {len(ids)} prompt tokens but only {limit} fit (a context "
                    f"of {self.engine.max_model_len} less {self.reserve} for the reply); "
                    "send a shorter one or lower max_tokens with /set"
                )
            turns = turns[2:]
        if dropped := (len(self.turns) + 1 - len(turns)) // 2:
            print(
                f"(dropped the {dropped} oldest turn{'s' * (dropped > 1)} to fit the context of "
                f"{self.engine.max_model_len} tokens)",
                file=sys.stderr,
            )
        return turns, ids

    def _encode(self, turns: list[Message]) -> list[int]:
        return self.engine.tokenize(messages=self._with_system(turns))

    def stats(self) -> str:
        s = self.last
        if s is None:
            return "no reply yet"
        rate = (
            f"{(s.reply_tokens - 1) / s.decode_seconds:.1f} tokens/s"
            if s.decode_seconds > 0
            else "n/a"
        )
        used, ctx = s.prompt_tokens + s.reply_tokens, self.engine.max_model_len
        return (
            f"prompt:  {s.prompt_tokens} tokens ({s.cached_tokens} cached)\n"
            f"ttft:    {s.ttft * 1000:.0f} ms\n"
            f"reply:   {s.reply_tokens} tokens, {rate}\n"
            f"context: {used} of {ctx} tokens ({100 * used / ctx:.0f}%)"
        )


@contextmanager
def _ctrl_c_as_flag() -> Iterator[threading.Event]:
    pressed = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.set())
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def read_message(read: Callable[[str], str] = input) -> str:
    '''One message from the user: a line ending in a backslash continues on the next, and a line
    starting with """ opens a block that runs to the line ending in """ (as in ollama).'''
    line = read(">>> ")
    if line.startswith('"""'):
        line = line[3:]
        lines = []
        while not line.endswith('"""'):
            lines.append(line)
            line = read("... ")
        return "\n".join(lines + [line[:-3]])
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read("... ")
    return "\n".join(lines + [line])


def command(session: ChatSession, line: str) -> bool:
    """Run one slash command; False means leave the chat."""
    name, _, arg = line.partition(" ")
    arg = arg.strip()
    if name == "/bye":
        return False
    if name in ("/help", "/?"):
        print(HELP)
    elif name == "/clear":
        session.turns = []
        print("conversation cleared")
    elif name == "/system":
        if arg:
            session.system = arg
            print("system prompt set")
        else:
            print(session.system or "(no system prompt)")
    elif name == "/set":
        key, _, value = arg.partition(" ")
        if key not in SETTABLE:
            raise TokenmillError(f"/set takes one of {', '.join(SETTABLE)}, then a value")
        try:
            parsed = SETTABLE[key](value.strip())
        except ValueError:
            raise TokenmillError(f"{key} needs a number, got {value.strip()!r}") from None
        session.set_params(replace(session.params, **{key: parsed}))
        print(f"{key} = {parsed}")
    elif name == "/stats":
        print(session.stats())
    elif name == "/save":
        if not arg:
            raise TokenmillError("/save needs a file name")
        try:
            with open(arg, "w", encoding="utf-8") as f:
                json.dump(session.messages, f, ensure_ascii=False, indent=2)
        except OSError as exc:
            raise TokenmillError(f"cannot write {arg}: {exc}") from exc
        print(f"saved {len(session.messages)} messages to {arg}")
    else:
        raise TokenmillError(f"unknown command {name}; /help lists them")
    return True


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    params.validate()
    if args.ctx is not None and args.ctx < 2:
        raise TokenmillError(f"--ctx must be at least 2 tokens, got {args.ctx}")
    engine = engine_from_args(args, max_num_seqs=1, max_model_len=args.ctx, compile=args.compile)
    try:
        if engine.tokenizer.chat_template is None:
            raise TokenmillError(
                f"{engine.loaded.path.name} has no chat template, so it cannot chat; "
                "use `tokenmill generate` to complete plain text"
            )
        return _converse(engine, params, args)
    finally:
        engine.shutdown()


def _converse(engine: LLMEngine, params: SamplingParams, args: argparse.Namespace) -> int:
    """Read messages and answer them until the user leaves; returns the exit status."""
    session = ChatSession(engine, params, args.system)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (gives input() line editing and history)
        except ImportError:
            pass
    print(
        f"{args.model or DEFAULT_MODEL} · context {engine.max_model_len} tokens · "
        "/help for commands"
    )
    while True:
        try:
            text = read_message().strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 130
        try:
            if text.startswith("/"):
                if not command(session, text):
                    return 0
            elif text:
                session.send(text)
        except TokenmillError as exc:
            print(f"error: {exc}", file=sys.stderr)
