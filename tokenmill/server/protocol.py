"""Request bodies of the OpenAI API (plus vLLM's extras), validated by pydantic.

Unknown fields are ignored with a warning, as vLLM does: clients send vendor fields (llama.cpp's
`cache_prompt`, LiteLLM's extras). With `--strict-request-fields` they are refused the way OpenAI
refuses them ("Unrecognized request argument supplied"), so a typo never silently changes what a
client gets.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams, StructuredOutputs

MAX_N = 16  # most choices per request: each is a sequence of its own in the running batch
MAX_STOP = 16  # most stop strings per request: each is searched for in every new piece of text
MAX_LOGIT_BIAS = 300  # most logit_bias entries per request, OpenAI's limit

log = logging.getLogger("tokenmill.server")
# Whether unknown request fields are refused (set for each request from the server's
# configuration; see `GuardMiddleware`)
STRICT_REQUEST_FIELDS: ContextVar[bool] = ContextVar("strict_request_fields", default=False)
_warned_fields: set[str] = set()  # unknown fields already logged, each logged once


class _Strict(BaseModel):
    """A request object: its unknown fields are ignored (logged once by name) or, with
    `STRICT_REQUEST_FIELDS`, refused."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _unknown_fields(self) -> _Strict:
        extra = self.__pydantic_extra__
        if not extra:
            return self
        names = ", ".join(sorted(extra))
        if STRICT_REQUEST_FIELDS.get():
            raise PydanticCustomError(
                "extra_forbidden",
                "Unrecognized request argument supplied: {names}",
                {"names": names},
            )
        if new := sorted(set(extra) - _warned_fields):
            _warned_fields.update(new)
            log.warning(
                "ignoring unknown request fields %s of %s (logged once per field; "
                "--strict-request-fields refuses them)",
                ", ".join(new),
                type(self).__name__,
            )
        extra.clear()
        return self


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs` (see `tokenmill.sample.StructuredOutputs`)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(
            json=self.json_,
            json_object=bool(self.json_object),
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            structural_tag=self.structural_tag,
        )


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tag (see `tokenmill.sample.StructuredOutputs`)
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def spec(self) -> StructuredOutputs | None:
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequestError(
                    'response_format of type "json_schema" needs a json_schema',
                    param="response_format.json_schema",
                )
            # a missing schema admits any JSON value, as `{}` does
            return StructuredOutputs(json=self.json_schema.schema_ or {})
        if self.type == "structural_tag":
            return StructuredOutputs(
                structural_tag={"structures": self.structures, "triggers": self.triggers}
            )
        return StructuredOutputs(json_object=True) if self.type == "json_object" else None


class SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    # Ollama's keep_alive: how long the model stays loaded after this request (seconds or "5m")
    keep_alive: str | float | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older names for structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputs | None:
        """The one output constraint the request sets, from whichever of its fields sets it."""
        guided = StructuredOutputs(
            json=self.guided_json,
            regex=self.guided_regex,
            choice=self.guided_choice,
            grammar=self.guided_grammar,
        )
        outputs, response = self.structured_outputs, self.response_format
        sources = {
            "structured_outputs": outputs.spec() if outputs else None,
            "response_format": response.spec() if response else None,
            "guided_*": guided if guided != StructuredOutputs() else None,
        }
        given = [name for name, spec in sources.items() if spec is not None]
        if len(given) > 1:
            raise InvalidRequestError(
                f"constrain the output through one of {', '.join(given)}, not several",
                param=given[1],
            )
        return sources[given[0]] if given else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Engine parameters, after the limits OpenAI's API sets beyond the engine's own."""
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise InvalidRequestError(
                f"temperature must be in [0, 2], got {self.temperature}", param="temperature"
            )
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise InvalidRequestError(
                f"at most {MAX_STOP} stop sequences are allowed", param="stop"
            )
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as exc:
                raise InvalidRequestError(
                    "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
                ) from exc
            if len(bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias may have at most {MAX_LOGIT_BIAS} entries", param="logit_bias"
                )
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_spec(),
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    max_tokens: int | None = 16  # OpenAI's default for completions

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None takes no arguments
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """A `tool_choice` that names the one function to call."""

    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... passed to the template

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    # None: "auto" where there are tools, as OpenAI defaults it
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, plus vLLM's `truncate_prompt_tokens`."""

    model: str | None = None
    # a text, texts, one list of token ids, or lists of token ids
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # cut each input to this many tokens (-1: limit)
    keep_alive: str | float | None = None  # as a completion request's
