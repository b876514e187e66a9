"""Fixtures for the tokenizer tests: llama.cpp's vocab-only GGUFs, the real models, and tokenizers
built once."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from tests.llama_cpp_files import VECTORS, vocab_file
from tokenmill.model.gguf_file import read_gguf_metadata
from tokenmill.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def vocab_gguf(tmp_path_factory: pytest.TempPathFactory):
    """Path to llama.cpp's vocab-only GGUF NAME; those committed here are xz-compressed."""
    folder = tmp_path_factory.mktemp("vocabs")

    def unpack(name: str) -> Path:
        packed = VECTORS / f"ggml-vocab-{name}.gguf.xz"
        if not packed.is_file():
            return vocab_file(name, ".gguf")
        path = folder / f"ggml-vocab-{name}.gguf"
        if not path.exists():
            path.write_bytes(lzma.decompress(packed.read_bytes()))
        return path

    return unpack


@pytest.fixture(scope="session")
def vocab_tokenizer(vocab_gguf):
    """The Tokenizer of llama.cpp's vocab-only GGUF NAME, built once per session."""
    built: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in built:
            built[name] = Tokenizer.from_gguf_metadata(read_gguf_metadata(vocab_gguf(name)))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm2_gguf))


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(gemma3_gguf))


def _transformers_tokenizer(path: Path):
    """transformers' tokenizer for a GGUF: what `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
    builds.

    It is made by the same two calls that loader makes, skipping its reading of the model config,
    which keeps these tests quick.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path):
    return _transformers_tokenizer(smollm2_gguf)


@pytest.fixture(scope="session")
def gemma3_hf(gemma3_gguf: Path):
    return _transformers_tokenizer(gemma3_gguf)
