"""OpenAI's response pieces: usage, logprobs blocks and server-sent-event framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.outputs import RequestOutput, TokenLogprobs
from tokenmill.server.errors import api_error
from tokenmill.tokenizer import Tokenizer


def finite(logprob: float) -> float:
    """JSON has no -inf: impossible tokens get -9999.0, as vLLM reports them."""
    return max(-9999.0, logprob)


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """The usage block of a response whose prompts ended with these outputs."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)},
    }


def completion_logprobs(
    token_ids: list[int], entries: list[TokenLogprobs] | None, prompt_part: dict | None = None
) -> dict:
    """A /v1/completions logprobs block for these tokens, after prompt_part (the echoed prompt's
    block) when there is one."""
    tokens, token_lps, tops, offsets = [], [], [], []
    if prompt_part:
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        tokens, token_lps, tops, offsets = (list(prompt_part[k]) for k in keys)
    offset = offsets[-1] + len(tokens[-1]) if tokens else 0
    for token_id, entry in zip(token_ids, entries or []):
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token)
        token_lps.append(finite(chosen.logprob))
        tops.append({lp.decoded_token: finite(lp.logprob) for lp in entry.values()})
        offsets.append(offset)
        offset += len(chosen.decoded_token)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def echo_logprobs(final: RequestOutput, tokenizer: Tokenizer) -> dict:
    """The /v1/completions logprobs block of an echoed prompt (None where the prompt's first
    token has no logprob)."""
    ids, entries = final.prompt_token_ids, final.prompt_logprobs or []
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [
            None if e is None else finite(e[t].logprob) for t, e in zip(ids, entries)
        ],
        "top_logprobs": [
            None if e is None else {lp.decoded_token: finite(lp.logprob) for lp in e.values()}
            for e in entries
        ],
        "text_offset": offsets,
    }


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprobs], top_k: int) -> dict:
    """A /v1/chat/completions logprobs block: each token with its top_k alternatives by rank."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry[token_id]
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        content.append(
            {
                "token": chosen.decoded_token,
                "logprob": finite(chosen.logprob),
                "bytes": list(chosen.decoded_token.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token,
                        "logprob": finite(lp.logprob),
                        "bytes": list(lp.decoded_token.encode()),
                    }
                    for lp in ranked
                    if lp.rank <= top_k
                ],
            }
        )
    return {"content": content}


# Characters JSON leaves as they are but line readers break lines at (str.splitlines, and httpx's
# `aiter_lines`, with which the `ollama` client and many others read streams): written as JSON
# escapes, which every parser reads back as the same characters, so that an event stays one line
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def stream_json(payload: dict | str) -> str:
    """payload (or JSON text) as the JSON of one line of a stream: a server-sent event's data or an
    NDJSON line, with no character inside that a line reader takes for a line break."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return data.translate(_LINE_BREAKS_IN_JSON)


def sse(payload: dict | str) -> str:
    """One server-sent event. Payloads hold no NaN or Infinity (see `finite`)."""
    return f"data: {stream_json(payload)}\n\n"


async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The chunks as server-sent events, closed by [DONE]. The status line is sent before the
    first chunk, so an error raised midway is reported in-band, as its error body."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        yield sse(api_error(exc).body())
    yield sse("[DONE]")
