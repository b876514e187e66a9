"""The tokenizer a model is served with: text to ids and back, and its chat template.

Tokenization runs in Hugging Face `tokenizers` (Rust). From a GGUF file it is rebuilt to tokenize as
llama.cpp does (see `gguf_vocab`); from a Hugging Face folder it is the folder's own
`tokenizer.json`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from tokenmill.tokenizer.chat_template import render_chat_template
from tokenmill.tokenizer.errors import TokenizerError
from tokenmill.tokenizer.gguf_vocab import (
    build_backend,
    default_add_bos,
    default_add_eos,
    gguf_token_types,
    gguf_tokens,
    special_token_ids,
    stop_token_ids,
)

_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Encode, decode and chat-template rendering for one model."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        stop_token_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
    ) -> None:
        if add_bos and bos_token_id is None:
            raise TokenizerError(
                "the tokenizer asks for a BOS token to be added but names no BOS token"
            )
        if add_eos and eos_token_id is None:
            raise TokenizerError(
                "the tokenizer asks for an EOS token to be added but names no EOS token"
            )
        self._backend = backend
        self._lock = threading.Lock()  # encode_special_tokens is a setting of the shared backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.stop_token_ids = stop_token_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        # e.g. {"bos_token": "<s>"}: what chat templates see
        self.special_tokens = dict(special_tokens)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From the plain-Python metadata of a GGUF file (see `read_gguf_metadata`)."""
        tokens = gguf_tokens(metadata)
        types = gguf_token_types(metadata, tokens)

        ids = special_token_ids(metadata, len(tokens))
        return cls(
            build_backend(metadata, tokens, types),
            bos_token_id=ids.get("bos_token"),
            eos_token_id=ids.get("eos_token"),
            stop_token_ids=stop_token_ids(metadata, tokens, types, ids.get("eos_token")),
            add_bos=default_add_bos(metadata),
            add_eos=default_add_eos(metadata),
            chat_template=metadata.get("tokenizer.chat_template"),
            special_tokens={name: tokens[i] for name, i in ids.items()},
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model folder: `tokenizer.json` plus the configs saved beside it."""
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{folder}: no tokenizer.json (tokenmill reads Hugging Face fast-tokenizer folders)"
            )
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        # a saved truncation or padding setting would cut or pad every prompt
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        special_tokens = {
            name: token
            for name in _SPECIAL_NAMES
            if (token := _token_text(config.get(name, special_map.get(name))))
        }
        bos_id = (
            backend.token_to_id(special_tokens["bos_token"])
            if "bos_token" in special_tokens
            else None
        )
        eos_id = (
            backend.token_to_id(special_tokens["eos_token"])
            if "eos_token" in special_tokens
            else None
        )
        # Without flags in the config, BOS/EOS are whatever the tokenizer's post-processor adds.
        framing = backend.encode("", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token", bos_id is not None and framing[:1] == [bos_id])
        add_eos = config.get("add_eos_token", eos_id is not None and framing[-1:] == [eos_id])
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id", [])
        stops = {eos_id} if eos_id is not None else set()
        stops.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            stop_token_ids=frozenset(stops),
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            chat_template=_hf_chat_template(folder, config),
            special_tokens=special_tokens,
        )

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`.

        `add_bos=None` applies the model's defaults (BOS, and EOS where the model asks for it);
        True or False forces BOS on or off and adds no EOS. With `parse_special=False`, text such as
        "<|im_start|>" in user input is tokenized as plain text instead of becoming a control token.
        """
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_token_id is None:
                raise TokenizerError("cannot add a BOS token: this tokenizer has none")
            ids.insert(0, self.bos_token_id)
        if add_bos is None and self.add_eos:
            ids.append(self.eos_token_id)
        return ids

    def encode_framed(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids for `text` framed by the tokenizer's own post-processor (e.g. BERT's
        [CLS] ... [SEP]), as transformers and sentence-transformers encode a text for an
        encoder. With `max_tokens`, the text is cut so that text and framing fit in it."""
        with self._lock:
            self._backend.encode_special_tokens = False
            if max_tokens is None:
                return self._backend.encode(text, add_special_tokens=True).ids
            self._backend.enable_truncation(max_tokens)
            try:
                return self._backend.encode(text, add_special_tokens=True).ids
            finally:
                self._backend.no_truncation()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text for `ids`; control tokens are written out unless `skip_special_tokens`."""
        ids = list(ids)
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(
                f"token id {bad} is outside the vocabulary (size {self.vocab_size})"
            )
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer as Hugging Face `tokenizers` serializes it (for llguidance)."""
        return self._backend.to_str()

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not, such as "<tool_call>") whose text this
        is, or None where the text is not one."""
        for token_id, token in self._backend.get_added_tokens_decoder().items():
            if token.content == text:
                return token_id
        return None

    def added_token_ids(self) -> list[int]:
        """The ids of every added token (the special tokens and such as "<tool_call>")."""
        return list(self._backend.get_added_tokens_decoder())

    def id_to_piece(self, id: int) -> str:
        """The vocabulary entry for `id` as stored (e.g. "▁Hello" or "ĠHello"), not decoded text."""
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(
                f"token id {id} is outside the vocabulary (size {self.vocab_size})"
            )
        return self._backend.id_to_token(id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers renders it; encode it to get ids."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template; send a plain prompt instead of messages"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self.special_tokens,
            extra=extra,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(token: Any) -> str | None:
    """A special token as configs write it: a string, or an AddedToken dict with "content"."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja`, else `chat_template.json`, else the config's (default) template."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get(
        "chat_template", config.get("chat_template")
    )
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict)
        }
        template = named.get("default")
    return template
