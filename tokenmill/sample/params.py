"""Per-request sampling parameters, with vLLM / OpenAI semantics and request validation."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError

# Temperatures below this are treated as greedy: dividing by them would only amplify rounding noise.
SAMPLING_EPS = 1e-5
# OpenAI's cap on the number of alternatives returned per token.
MAX_LOGPROBS = 20
MIN_REPETITION_PENALTY = 1e-3
# seeds are signed 64-bit integers; children of n > 1 wrap around within that range
MAX_SEED = 2**63 - 1


@dataclass
class StructuredOutputs:
    """A constraint on a request's output, as vLLM's `structured_outputs`: exactly one of a JSON
    schema (a dict or its text; `{}` admits any JSON value), any JSON object (`json_object`), a
    regular expression (the whole output matches it), a choice among strings, a grammar (Lark,
    or GBNF as llama.cpp writes it, told apart by its `::=` rules), or a structural tag (free
    text in which each of its `triggers` starts one of its `structures`: the `begin` text, JSON
    following the structure's `schema`, the `end` text; as a dict or its JSON text). The engine
    compiles it with llguidance and masks every token that would leave it."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    # A model that reasons first (the server's --reasoning-parser) writes its reasoning between
    # these two markers, unconstrained; the constraint holds from the closing one.
    # reasoning_opened: the prompt has opened the reasoning already.
    reasoning_markers: tuple[str, str] | None = None
    reasoning_opened: bool = False

    def validate(self) -> None:
        """Raise InvalidRequestError unless exactly one constraint is given, of the right type."""
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar and structural_tag; got {', '.join(given) if given else 'none'}",
                param="structured_outputs",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "structured_outputs.choice must be a list of non-empty strings",
                param="structured_outputs.choice",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip()):
                raise InvalidRequestError(
                    f"structured_outputs.{name} must be a non-empty string",
                    param=f"structured_outputs.{name}",
                )


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    top_k 0 or -1 and top_p 1.0 switch those filters off. repetition_penalty follows HF/vLLM
    (divide positive / multiply negative logits of tokens seen in the prompt or output);
    presence/frequency penalties follow OpenAI and count output tokens only. logprobs is the
    number of top alternatives to return (0 = only the sampled token's logprob). stop strings are
    stored here but matched by the detokenizer.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first out-of-range field; token ids are checked
        against vocab_size when it is given."""
        # Written as `not (in range)` so that NaN fails too.
        _check(self.n >= 1, "n", self.n, "must be at least 1")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            self.top_k >= -1,
            "top_k",
            self.top_k,
            "must be -1 or 0 (off) or a positive number of tokens",
        )
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        # bounded away from 0 and infinity: logits are divided or multiplied by it in float32
        _check(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= 1 / MIN_REPETITION_PENALTY,
            "repetition_penalty",
            self.repetition_penalty,
            f"must be in [{MIN_REPETITION_PENALTY}, {1 / MIN_REPETITION_PENALTY:g}]",
        )
        if self.seed is not None:
            _check(
                -MAX_SEED - 1 <= self.seed <= MAX_SEED,
                "seed",
                self.seed,
                "must fit in a signed 64-bit integer",
            )
        _check(
            -2 <= self.presence_penalty <= 2,
            "presence_penalty",
            self.presence_penalty,
            "must be in [-2, 2]",
        )
        _check(
            -2 <= self.frequency_penalty <= 2,
            "frequency_penalty",
            self.frequency_penalty,
            "must be in [-2, 2]",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, name, value, f"must be in [0, {MAX_LOGPROBS}]")
        for token, bias in (self.logit_bias or {}).items():
            _check_token(token, "logit_bias", vocab_size)
            _check(
                -100 <= bias <= 100,
                "logit_bias",
                bias,
                f"value for token {token} must be in [-100, 100]",
            )
        for token in self.stop_token_ids:
            _check_token(token, "stop_token_ids", vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs.validate()


def _check(ok: bool, name: str, value: object, why: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} {why}, got {value!r}", param=name)


def _check_token(token: int, name: str, vocab_size: int | None) -> None:
    in_range = isinstance(token, int) and token >= 0 and (vocab_size is None or token < vocab_size)
    why = (
        f"token ids must be in [0, {vocab_size})"
        if vocab_size is not None
        else "token ids must be >= 0"
    )
    _check(in_range, name, token, why)
