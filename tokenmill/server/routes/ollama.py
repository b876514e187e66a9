"""Ollama's API under /api/ (what Open WebUI and the `ollama` clients speak): /api/tags, /api/show,
/api/ps, /api/version, /api/embed, /api/generate and /api/chat, streamed as NDJSON (one JSON
object per line, Ollama's default) or answered whole with `"stream": false`.

Chat requests, and generate requests that are not `raw`, run as the equivalent chat completion
(`tokenmill.server.chat`); a raw generate request runs its prompt as it is. `options` map to the
engine's sampling parameters (temperature, top_p, top_k, min_p, num_predict, stop, seed,
repeat_penalty, presence_penalty, frequency_penalty; others, such as num_ctx, are ignored), with
Ollama's defaults where a request gives none. `keep_alive` sets how long the model stays loaded
after the request (see `ModelRegistry`); a request with no prompt or messages loads the model, or
with keep_alive 0 unloads it, as Ollama's do.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from tokenmill import __version__
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.server.chat import ChatSetup, chat_choices, chat_chunks, chat_setup, translated
from tokenmill.server.errors import api_error
from tokenmill.server.formatting import stream_json
from tokenmill.server.generation import RequestRun
from tokenmill.server.model_registry import FOREVER, Engine, ModelEntry, parse_keep_alive
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, _Strict
from tokenmill.server.state import ServerState, State, tenant

router = APIRouter()
# Ollama's sampling defaults, where a request's options leave them out
DEFAULT_OPTIONS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40}
# option name -> the OpenAI / vLLM request field it sets
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "num_predict": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


class OllamaMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generation(_Strict):
    model: str
    stream: bool = True
    format: Literal["json"] | dict[str, Any] | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    keep_alive: str | int | float | None = None
    think: bool | str | None = None

    def fields(self) -> dict[str, Any]:
        """The OpenAI / vLLM request fields of the options and format."""
        options = {**DEFAULT_OPTIONS, **self.options}
        body = {field: options[name] for name, field in OPTION_FIELDS.items() if name in options}
        if body.get("max_tokens") is not None and body["max_tokens"] < 0:
            body["max_tokens"] = None  # -1 and -2: until the context is full
        if isinstance(body.get("stop"), str):
            body["stop"] = [body["stop"]]
        if self.format == "json":
            body["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "format", "schema": self.format},
            }
        return {"model": self.model, **body}


class ChatRequest(_Generation):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        messages = [_chat_message(m, i) for i, m in enumerate(self.messages)]
        usage = {"include_usage": True} if self.stream else None
        return translated(
            ChatCompletionRequest,
            {**self.fields(), "messages": messages, "tools": self.tools or None}
            | {"stream": self.stream, "stream_options": usage},
        )


class GenerateRequest(_Generation):
    prompt: str = ""
    system: str | None = None
    raw: bool = False
    suffix: str | None = None
    images: list[str] | None = None


class EmbedRequest(_Strict):
    model: str
    input: str | list[str] = Field(min_length=1)
    truncate: bool = True  # Ollama's default: cut inputs to the model's context
    keep_alive: str | int | float | None = None
    options: dict[str, Any] | None = None
    dimensions: int | None = None


class ShowRequest(_Strict):
    model: str
    verbose: bool = False


def _chat_message(message: OllamaMessage, index: int) -> dict[str, Any]:
    """An Ollama message as OpenAI's: a tool call's arguments object as JSON text."""
    if message.images:
        raise InvalidRequestError(
            f"messages[{index}]: images are not supported by this model", param="messages"
        )
    chat: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        chat["tool_calls"] = [
            {
                "id": f"call_{index}_{j}",
                "type": "function",
                "function": {
                    "name": call.get("function", {}).get("name"),
                    "arguments": json.dumps(call.get("function", {}).get("arguments", {})),
                },
            }
            for j, call in enumerate(message.tool_calls)
        ]
    if message.tool_name:
        chat["name"] = message.tool_name
    return chat


# ---------------------------------------------------------------------------- model listings


def _details(path: Path | None, engine: Engine | None) -> dict[str, Any]:
    family = engine.model_config.architecture if engine is not None else ""
    return {
        "parent_model": "",
        "format": "gguf" if path is not None and path.suffix == ".gguf" else "safetensors",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _entry(name: str, path: Path, engine: Engine | None) -> dict[str, Any]:
    modified = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat()
    return {
        "name": name,
        "model": name,
        "modified_at": modified,
        "size": _size(path),
        "digest": uuid.uuid5(uuid.NAMESPACE_URL, str(path)).hex,
        "details": _details(path, engine),
    }


@router.get("/api/tags")
async def tags(state: State) -> dict[str, Any]:
    """The models on this machine that the server serves or can load."""
    models = state.models
    sources = [e.source for e in models.entries.values()]
    if models.finder is not None:
        found = (models.finder.find(name) for name in models.finder.names())
        sources += [s for s in found if s is not None and s.name not in models.entries]
    engines = {e.name: e.engine for e in models.entries.values()}
    return {
        "models": [
            _entry(s.name, s.path, engines.get(s.name))
            for s in sources
            if s.path is not None and s.path.exists()
        ]
    }


@router.get("/api/ps")
async def ps(state: State) -> dict[str, Any]:
    """The loaded models, with their memory and when they unload (Ollama's expires_at)."""
    running = []
    for entry in state.models.entries.values():
        engine = entry.engine
        if engine is None:
            continue
        row = _entry(entry.name, engine.model_path, engine)
        row.pop("modified_at")
        running.append(
            {
                **row,
                "size": entry.memory,
                "expires_at": _expires_at(entry),
                "size_vram": 0,
                "context_length": engine.max_model_len,
            }
        )
    return {"models": running}


def _expires_at(entry: ModelEntry) -> str:
    """When the model unloads: its idle deadline, or a keep_alive from now while requests hold
    it; far in the future when it is kept loaded."""
    if entry.keep_alive == FOREVER:
        return datetime(9999, 12, 31, tzinfo=timezone.utc).isoformat()
    at = entry.expires_at if entry.expires_at is not None else time.time() + entry.keep_alive
    return datetime.fromtimestamp(at, timezone.utc).isoformat()


@router.post("/api/show")
async def show(req: ShowRequest, raw: Request, state: State) -> dict[str, Any]:
    engine = (await state.model(raw, req.model)).engine
    config = engine.model_config
    template = engine.tokenizer.chat_template or ""
    if engine.embeddings_only:
        capabilities = ["embedding"]
    else:
        capabilities = ["completion"] + (["tools"] if "tools" in template else [])
    entry = _entry(req.model, engine.model_path, engine)
    return {
        "license": "",
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": entry["details"],
        "model_info": {
            "general.architecture": config.architecture,
            f"{config.architecture}.context_length": engine.max_model_len,
            f"{config.architecture}.embedding_length": config.hidden_size,
            f"{config.architecture}.block_count": config.num_layers,
        },
        "capabilities": capabilities,
        "modified_at": entry["modified_at"],
    }


@router.get("/api/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.post("/api/embed")
async def embed(req: EmbedRequest, raw: Request, state: State) -> dict[str, Any]:
    """Normalized embeddings of each input (see /v1/embeddings)."""
    started = time.perf_counter()
    engine = (await state.model(raw, req.model, req.keep_alive)).engine
    loaded = time.perf_counter()
    dimensions = engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != dimensions:
        raise InvalidRequestError(
            f"this model's embeddings have {dimensions} dimensions", param="dimensions"
        )
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    vectors, tokens = await engine.embed(inputs, -1 if req.truncate else None)
    return {
        "model": req.model,
        "embeddings": vectors.tolist(),
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": int((loaded - started) * 1e9),
        "prompt_eval_count": tokens,
    }


async def _load_or_unload(req: _Generation, raw: Request, state: ServerState) -> str:
    """Ollama's way to load a model, a request with nothing to run; with keep_alive 0, to unload
    it. Returns the done_reason: "load" or "unload"."""
    if req.keep_alive is not None and parse_keep_alive(req.keep_alive) == 0:
        await state.models.unload(req.model)
        return "unload"
    await state.model(raw, req.model, req.keep_alive)
    return "load"


# ---------------------------------------------------------------------------- generation


@router.post("/api/chat", response_model=None)
async def chat(req: ChatRequest, raw: Request, state: State) -> dict | StreamingResponse:
    if not req.messages:
        reason = await _load_or_unload(req, raw, state)
        return _done(req.model, reason, message={"role": "assistant", "content": ""})
    counts = _Counts(time.perf_counter())
    model = await state.model(raw, req.model, req.keep_alive)
    counts.loaded = time.perf_counter()
    chat = req.chat_request()
    setup = chat_setup(chat, state, model)
    run = await RequestRun.start(
        state, model, [setup.prompt_ids], setup.params, _request_id(), 0, tenant(raw, None)
    )
    if req.stream:
        return _ndjson(_chat_lines(run, chat, setup, req.model, counts))
    (final,) = await run.finals(raw.is_disconnected)
    (choice,) = chat_choices(final, chat, setup)
    message = _ollama_message(choice["message"])
    return _done(req.model, _reason(choice), counts.of(final, run), message=message)


@router.post("/api/generate", response_model=None)
async def generate(req: GenerateRequest, raw: Request, state: State) -> dict | StreamingResponse:
    if req.suffix:
        raise InvalidRequestError("suffix (fill in the middle) is not supported", param="suffix")
    if req.images:
        raise InvalidRequestError("images are not supported by this model", param="images")
    if not req.prompt:
        return _done(req.model, await _load_or_unload(req, raw, state), response="")
    request_id = _request_id()
    counts = _Counts(time.perf_counter())
    model = await state.model(raw, req.model, req.keep_alive)
    counts.loaded = time.perf_counter()
    if req.raw:
        model.check_generates()
        completion = translated(CompletionRequest, {**req.fields(), "prompt": req.prompt})
        params = completion.sampling_params(completion.max_tokens, None)
        run = await RequestRun.start(
            state, model, [req.prompt], params, request_id, 0, tenant(raw, None)
        )
    else:
        messages = [{"role": "user", "content": req.prompt}]
        if req.system:
            messages.insert(0, {"role": "system", "content": req.system})
        chat = translated(ChatCompletionRequest, {**req.fields(), "messages": messages})
        setup = chat_setup(chat, state, model)
        run = await RequestRun.start(
            state, model, [setup.prompt_ids], setup.params, request_id, 0, tenant(raw, None)
        )
    if req.stream:
        return _ndjson(_generate_lines(run, req.model, counts))
    (final,) = await run.finals(raw.is_disconnected)
    output = final.outputs[0]
    reason = "length" if output.finish_reason == "length" else "stop"
    return _done(req.model, reason, counts.of(final, run), response=output.text)


def _request_id() -> str:
    return f"ollama-{uuid.uuid4().hex}"


def _reason(choice: dict[str, Any]) -> str:
    return "length" if choice["finish_reason"] == "length" else "stop"


def _ollama_message(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's assistant message as Ollama's: tool call arguments as objects."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):
        out["thinking"] = message["reasoning_content"]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.loads(call["function"]["arguments"] or "{}"),
                }
            }
            for call in message["tool_calls"]
        ]
    return out


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class _Counts:
    """A response's token counts and times (time.perf_counter()), for its last object."""

    started: float
    loaded: float | None = None  # once the model was loaded (at once when it already was)
    first_token: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0

    def of(self, final: RequestOutput, run: RequestRun) -> _Counts:
        self.first_token = run.timers[0].first_token_at
        self.prompt_tokens = len(final.prompt_token_ids)
        self.output_tokens = len(final.outputs[0].token_ids)
        return self


def _done(model: str, reason: str, counts: _Counts | None = None, **content: Any) -> dict[str, Any]:
    """The last object of a response: its counts and durations (nanoseconds, as Ollama gives
    them; prompt and output time split at the first token)."""
    body: dict[str, Any] = {
        "model": model,
        "created_at": _now(),
        **content,
        "done": True,
        "done_reason": reason,
    }
    if counts is None:
        return body
    end = time.perf_counter()
    first = counts.first_token if counts.first_token is not None else end
    loaded = counts.loaded if counts.loaded is not None else counts.started
    body.update(
        total_duration=int((end - counts.started) * 1e9),
        load_duration=int((loaded - counts.started) * 1e9),
        prompt_eval_count=counts.prompt_tokens,
        prompt_eval_duration=int((first - loaded) * 1e9),
        eval_count=counts.output_tokens,
        eval_duration=int((end - first) * 1e9),
    )
    return body


async def _chat_lines(
    run: RequestRun,
    chat: ChatCompletionRequest,
    setup: ChatSetup,
    model: str,
    counts: _Counts,
) -> AsyncIterator[dict[str, Any]]:
    """A line per piece of content; tool calls, whole, in a line once their output ends."""
    calls: dict[int, dict[str, Any]] = {}
    reason = "stop"
    async for chunk in chat_chunks(run, {}, chat, setup):
        if not chunk["choices"]:  # the last chunk: usage
            counts.prompt_tokens = chunk["usage"]["prompt_tokens"]
            counts.output_tokens = chunk["usage"]["completion_tokens"]
            counts.first_token = run.timers[0].first_token_at
            continue
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"].get("arguments") or ""
        if delta.get("content") or delta.get("reasoning_content"):
            message = {"role": "assistant", "content": delta.get("content", "")}
            if delta.get("reasoning_content"):
                message["thinking"] = delta["reasoning_content"]
            yield {"model": model, "created_at": _now(), "message": message, "done": False}
        if choice["finish_reason"] is not None:
            reason = _reason(choice)
    if calls:
        tool_calls = [
            {"function": {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
            for _, c in sorted(calls.items())
        ]
        message = {"role": "assistant", "content": "", "tool_calls": tool_calls}
        yield {"model": model, "created_at": _now(), "message": message, "done": False}
    yield _done(model, reason, counts, message={"role": "assistant", "content": ""})


async def _generate_lines(
    run: RequestRun, model: str, counts: _Counts
) -> AsyncIterator[dict[str, Any]]:
    reason = "stop"
    async for _, out in run.outputs():
        c = out.outputs[0]
        if c.text_delta:
            yield {"model": model, "created_at": _now(), "response": c.text_delta, "done": False}
        if c.finished:
            reason = "length" if c.finish_reason == "length" else "stop"
            counts.of(out, run)
    yield _done(model, reason, counts, response="")


def _ndjson(lines: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for line in lines:
                yield stream_json(line) + "\n"
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            yield stream_json(api_error(exc).body("/api/")) + "\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")
