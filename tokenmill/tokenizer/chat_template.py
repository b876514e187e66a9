"""Render chat templates exactly as transformers' `apply_chat_template(..., tokenize=False)` does.

Templates are Jinja2 from model authors, so they run sandboxed, with the environment transformers
gives them: `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, and a
`tojson` that keeps non-ASCII text and does not HTML-escape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.tokenizer.errors import TokenizerError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys=False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict` for templates, without the type's own attributes to climb through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # no named self, as in Jinja, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes ({name!r})"
            )


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(
            f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})"
        ) from exc


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TokenizerError(
            f"chat messages must be dicts with 'role' and 'content', got {message!r}"
        )
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_KEYS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str],
    extra: Mapping[str, Any],
) -> str:
    """The prompt text, from messages prepared as transformers prepares them.

    Keys whose value is None are dropped (templates test for a key, not for None), and reasoning
    given as `reasoning` or `thinking` is also offered as `reasoning_content`, and the reverse.
    """
    if not messages:
        raise TokenizerError("cannot apply a chat template to an empty conversation")
    messages = [_prepare(message) for message in messages]
    variables = {**special_tokens, **extra}
    try:
        return _compile(template).render(
            messages=messages,
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        # the template is the model's code, not ours
        raise TokenizerError(f"the chat template rejected the conversation: {exc}") from exc


_TEMPLATES = Path(__file__).parent / "templates"


def builtin_chat_template(architecture: str) -> str | None:
    """The family's published template, for GGUF files converted without one (Gemma 3 270M)."""
    path = _TEMPLATES / f"{architecture}.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else None
