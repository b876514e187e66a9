"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"

import os  # noqa: E402

# PyTorch's CPU allocator backs large tensors (the weights) with 2 MB pages when this is set before
# its first allocation: a decode step streams every weight, and with 4 kB pages its speed varied
# from process to process (Gemma 3's batch-1 step: 12-19 ms, against 11.7-12.6 ms with huge pages).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tokenmill.catalog import cache_root  # noqa: E402

# Compiled graphs persist beside the models (inductor's default is under /tmp). Set before anything
# asks inductor for its cache directory: loading a model already does, and its answer then holds.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))

from tokenmill.sample import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in the model stack; import it on first use so `import tokenmill` stays light
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
