"""Structured outputs: requests whose tokens a grammar constrains (a JSON schema, any JSON object,
a regular expression, a choice, a Lark or GBNF grammar), through llguidance.

`GrammarCompiler.matcher` turns a request's `StructuredOutputs` into an llguidance matcher when
the request comes in, on the caller's thread (the server's event loop, `LLM`'s caller), not the
engine's: a slow schema delays its own request only, and a bad one is a 400 before anything is
queued. Grammars are cached by their text, so a schema repeated across requests is converted and
checked once. Each sequence keeps its own matcher, which consumes its tokens as they are sampled
(a preempted sequence keeps its tokens, and so its matcher's state). Each step `allowed_tokens`
asks the constrained rows' matchers for the tokens they may take next, as one bitmask the batched
sampler applies: constrained and free rows share the step.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Rows

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from tokenmill.errors import InvalidRequestError
from tokenmill.sample import StructuredOutputs
from tokenmill.tokenizer.tokenizer import Tokenizer

# Distinct grammars (by their text) kept converted and checked; one more evicts the least recently
# used
GRAMMAR_CACHE_SIZE = 256


class GrammarCompiler:
    """llguidance matchers for one model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # requests come in on several threads
        self._executor = llguidance.LLExecutor()
        self.num_matchers = 0  # matchers made: constrained requests
        self.num_compiles = 0  # grammars converted and checked (cache misses)
        self.compile_seconds = 0.0

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for the constraint; InvalidRequestError naming what llguidance cannot
        compile."""
        grammar = self._grammar(*_source(spec))
        if spec.reasoning_markers is not None:
            grammar = self._after_reasoning(grammar, spec.reasoning_markers, spec.reasoning_opened)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        with self._lock:
            self.num_matchers += 1
        return matcher

    def allowed_tokens(
        self,
        matchers: Rows[llguidance.LLMatcher],
        drafts: Rows[list[int]] | None = None,
    ) -> torch.Tensor:
        """The tokens each matcher allows next, as rows of an int32 bitmask (bit b of word w
        allows token 32 w + b), computed in parallel. With drafts (one list per matcher), a
        matcher's row is followed by one row per draft: what it allows after the drafts before
        it. The matchers end as they began; rows behind a draft the matcher refuses allow every
        token (the target's token before them refuses that draft). A matcher in error
        (`is_error`) allows at most the end of the sequence; the engine fails its request with
        the reason."""
        # llguidance.torch applies torch.compile to a function when imported, which imports
        # TorchDynamo (seconds): imported by the first step with a constrained row, not at start
        import llguidance.torch

        drafts = drafts if drafts is not None else [[] for _ in matchers]
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        bits = llguidance.torch.allocate_token_bitmask(starts[-1], self._vocab_size)
        alone = [(m, start) for m, start, d in zip(matchers, starts, drafts) if not d]
        drafted = [(m, start, list(d)) for m, start, d in zip(matchers, starts, drafts) if d]
        if alone:  # llguidance's draft variant takes only matchers with drafts
            llguidance.torch.fill_next_token_bitmask_par(self._executor, alone, bits)
        if drafted:
            llguidance.torch.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, drafted, bits
            )
        return bits

    def _after_reasoning(self, grammar: str, markers: tuple[str, str], opened: bool) -> str:
        """The grammar behind a free reasoning block: what the prompt opened, or what the output
        may open with its first token, runs free up to the closing marker. The markers must be
        tokens of their own (as `<think>` and `</think>` are in the models that reason) for the
        reasoning's text to be told from them; where they are not, the grammar holds from the
        start and the model cannot reason."""
        start, end = (self._tokenizer.added_token_id(marker) for marker in markers)
        if end is None or (start is None and not opened):
            return grammar
        reasoning = f"REASONING <[{end}]> @constrained"
        rule = reasoning if opened else f"<[{start}]> {reasoning} | @constrained"
        body = (
            json.loads(grammar)["grammars"]
            if grammar.startswith("{")
            else [{"lark_grammar": grammar}]
        )
        outer = {"lark_grammar": f"start: {rule}\nREASONING: /(?s:.*)/\n"}
        return json.dumps({"grammars": [outer, {**body[0], "name": "constrained"}, *body[1:]]})

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built by the first constrained request: the build
        holds the GIL throughout, long for a large vocabulary, which at start would stall
        the first requests of every server, constrained or not."""
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self._tokenizer.eos_token_id
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self._vocab_size,
                    eos_token=eos if eos is not None else sorted(self._tokenizer.stop_token_ids),
                )
            return self._ll_tokenizer

    def _unsatisfiable(self, grammar: str) -> str:
        """Why no output can satisfy a valid grammar, or "": llguidance checks a grammar's form,
        not that some text matches it (an empty character class, a rule that only recurses), and
        the matcher of such a grammar fails at its first token. A 400 here, not a failed step."""
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        matcher.compute_bitmask()
        if not matcher.is_error():
            return ""
        return f"no output can satisfy it ({matcher.get_error().splitlines()[0]})"

    def _grammar(self, kind: str, text: str) -> str:
        """The llguidance grammar for a constraint, converted and checked once per distinct text."""
        key = (kind, text)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        start = time.perf_counter()
        grammar = _convert(kind, text, lambda t: self._tokenizer.added_token_id(t) is not None)
        problem = llguidance.LLMatcher.validate_grammar(
            grammar, self._llg_tokenizer()
        ) or self._unsatisfiable(grammar)
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - start
        if problem:
            raise InvalidRequestError(
                f"structured_outputs.{kind} cannot be compiled: {problem}",
                param=f"structured_outputs.{kind}",
            )
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar


def _source(spec: StructuredOutputs) -> tuple[str, str]:
    """(kind, text) of a validated constraint: the cache's key."""
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return "json", schema
    if spec.json_object:
        return "json", '{"type": "object"}'
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        return "choice", json.dumps(spec.choice)
    if spec.structural_tag is not None:
        tag = spec.structural_tag
        return "structural_tag", tag if isinstance(tag, str) else json.dumps(tag)
    return "grammar", spec.grammar


def _convert(kind: str, text: str, is_token: Callable[[str], bool]) -> str:
    """llguidance's grammar for (kind, text); InvalidRequestError where the text does not parse.
    is_token tells the texts that are tokens of their own (added tokens such as "<tool_call>")."""
    try:
        if kind == "json":
            schema = json.loads(text)
            if schema == {}:  # any JSON value
                schema = {"type": ["object", "array", "string", "number", "boolean", "null"]}
            # compact separators (", ", ": "), no free whitespace: a small model otherwise
            # tends to loop on newlines and indentation it may add without end
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            # Lark string literals: JSON's quoting and escapes
            return "start: " + " | ".join(json.dumps(c) for c in json.loads(text))
        if kind == "structural_tag":
            return _structural_tag(json.loads(text), is_token)
        return gbnf_to_lark(text) if "::=" in text else text
    except Exception as exc:  # noqa: BLE001 - they parse the user's text: any failure is its own
        raise InvalidRequestError(
            f"structured_outputs.{kind} is not valid: {exc}", param=f"structured_outputs.{kind}"
        ) from exc


def _structural_tag(tag: dict, is_token: Callable[[str], bool]) -> str:
    """vLLM's structural tag as llguidance's: each structure starts at the trigger its `begin`
    starts with. A trigger written `<...>` that is a token of its own is matched as that token."""
    triggers = tag.get("triggers") or []
    tags = []
    for structure in tag["structures"]:
        begin = structure["begin"]
        trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structure that begins with {begin!r}")
        tags.append(
            llguidance.StructTag(
                trigger=trigger,
                begin=begin,
                grammar=structure.get("schema") or {},
                end=structure.get("end", ""),
            )
        )
    special = all(is_token(t) for t in triggers if t.startswith("<") and t.endswith(">"))
    return llguidance.StructTag.to_grammar(tags, assume_special=special)


def allows_only(bits: torch.Tensor, token_ids: frozenset[int]) -> bool:
    """Whether a row of `GrammarCompiler.allowed_tokens`' bitmask allows no token but these."""
    rest = bits.clone()
    for token_id in token_ids:
        word = token_id // 32
        if word < rest.numel():
            rest[word] &= ~(torch.tensor(1, dtype=torch.int32) << token_id % 32)
    return not bool(rest.any())
