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

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence as Rows

import llguidance
import llguidance.torch
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
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar)
        with self._lock:
            self.num_matchers += 1
        return matcher

    def allowed_tokens(self, matchers: Rows[llguidance.LLMatcher]) -> torch.Tensor:
        """The tokens each matcher allows next, as rows of an int32 bitmask (bit b of word w
        allows token 32 w + b), computed in parallel. A matcher in error (`is_error`) allows at
        most the end of the sequence; the engine fails its request with the reason."""
        bits = llguidance.torch.allocate_token_bitmask(len(matchers), self._vocab_size)
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m, row) for row, m in enumerate(matchers)], bits
        )
        return bits

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                eos = self._tokenizer.eos_token_id
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self._vocab_size,
                    eos_token=eos if eos is not None else sorted(self._tokenizer.stop_token_ids),
                )
            return self._ll_tokenizer

    def _grammar(self, kind: str, text: str) -> str:
        """The llguidance grammar for a constraint, converted and checked once per distinct text."""
        key = (kind, text)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        start = time.perf_counter()
        grammar = _convert(kind, text)
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._llg_tokenizer())
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
    return "grammar", spec.grammar


def _convert(kind: str, text: str) -> str:
    """llguidance's grammar for (kind, text); InvalidRequestError where the text does not parse."""
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
        return gbnf_to_lark(text) if "::=" in text else text
    except Exception as exc:  # noqa: BLE001 - they parse the user's text: any failure is its own
        raise InvalidRequestError(
            f"structured_outputs.{kind} is not valid: {exc}", param=f"structured_outputs.{kind}"
        ) from exc
