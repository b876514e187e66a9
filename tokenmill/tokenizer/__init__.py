"""Tokenizers: GGUF vocabularies tokenized as llama.cpp does, Hugging Face folders, chat templates,
streaming."""

from tokenmill.tokenizer.detokenizer import IncrementalDetokenizer
from tokenmill.tokenizer.errors import TokenizerError
from tokenmill.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "TokenizerError"]
