"""tokenmill: an LLM inference engine and OpenAI-compatible server on PyTorch."""

__version__ = "0.1.0"

from tokenmill.sample import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in the model stack; import it on first use so `import tokenmill` stays light
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
