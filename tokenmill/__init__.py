"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"
