"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"

import os  # noqa: E402


def _configure_cpu_allocator() -> None:
    """Large tensors on 2 MB pages, and their memory reused rather than mapped anew.

    PyTorch's CPU allocator backs large tensors (the weights) with 2 MB pages when
    THP_MEM_ALLOC_ENABLE is set before its first allocation: a decode step streams every weight,
    and with 4 kB pages its speed varies from process to process. Those 2 MB-aligned
    blocks are then mapped anew and faulted in on every use unless glibc keeps freed blocks of up
    to 32 MB in its heap (and up to 64 MB of free heap mapped): without that, huge pages alone make
    batched decode slower than 4 kB pages. The cost is a few tens of MB of resident memory.
    """
    import ctypes
    import sys

    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc only: other C libraries go without
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 64 << 20)


_configure_cpu_allocator()

from tokenmill.catalog import cache_root  # noqa: E402

# Compiled graphs persist beside the models (inductor's default is under /tmp). Set before anything
# asks inductor for its cache directory: loading a model already does, and its answer then holds.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))

from tokenmill.sample import SamplingParams, StructuredOutputs  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in the model stack; import it on first use so `import tokenmill` stays light
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]
