"""Options and helpers shared by the commands that load a model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenmill.catalog import DEFAULT_MODEL, resolve_model
from tokenmill.engine.llm_engine import COMPILE_AFTER_BUSY_S, LLMEngine
from tokenmill.engine.tp_executor import EXECUTOR_BACKENDS
from tokenmill.errors import TokenmillError
from tokenmill.model.attention import KV_CACHE_DTYPES
from tokenmill.model.loader import LoadedModel, load_model


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "-m",
        default=None,
        help="catalog alias (pulled on first use), GGUF file or HF directory "
        f"(default: {DEFAULT_MODEL})",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="compute dtype for the weights (default: auto, bf16 where the CPU multiplies it "
        "natively, else fp32)",
    )
    add_quantization_args(parser)
    parser.add_argument(
        "--models-dir", default=None, help="model cache (default: ~/.cache/tokenmill/models)"
    )


def add_quantization_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization",
        "-q",
        default="auto",
        choices=["auto", "none", "gguf", "int8", "int4"],
        help="weights in memory: auto keeps a GGUF file's quantized weights packed (gguf) and "
        "leaves other checkpoints dense (none); int8/int4 quantize every linear layer",
    )
    parser.add_argument(
        "--dense-min-tokens",
        type=int,
        default=None,
        help="also keep dense copies of quantized layers for batches of at least this many "
        "tokens (faster prefill, more memory; needs --no-batch-invariant)",
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute every request's tokens alike whatever else shares its batch, so outputs do "
        "not depend on load (default: on); --no-batch-invariant lets the batch size pick faster "
        "or finer kernels",
    )


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_CACHE_DTYPES],
        help="dtype of the KV cache (default: auto, float16 for a float32 model on CPU, as "
        "llama.cpp keeps it, else the model's dtype)",
    )


def add_compile_arg(parser: argparse.ArgumentParser) -> None:
    """--compile / --no-compile for the offline commands, which leave it to the engine by default
    (`EngineConfig.compile` None)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode through compiled graphs, built or loaded on a background thread while eager "
        "steps run (outputs are the same either way), at each batch size where they time faster "
        "than eager steps; not loaded again where an earlier run timed them no faster at any "
        "batch size. Default: at once where an earlier run "
        f"(such as `serve`) cached them, else after {COMPILE_AFTER_BUSY_S:.0f} s of work; "
        "--compile builds them now, --no-compile stays eager. Off with "
        "--tensor-parallel-size above 1, whose steps run eagerly",
    )


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size and --distributed-executor-backend, for the commands that run the
    batching engine."""
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model's heads and MLP over this many processes (this one and N-1 "
        "workers), each with 1/N of the threads; steps then run eagerly, without compiled "
        "decode graphs (default: 1, one process)",
    )
    parser.add_argument(
        "--distributed-executor-backend",
        default="mp",
        choices=EXECUTOR_BACKENDS,
        help="how tensor-parallel workers run: mp, local processes; ray, Ray actors on this "
        "machine or on the Ray cluster of RAY_ADDRESS (default: mp)",
    )


def parallel_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
    }


def engine_from_args(args: argparse.Namespace, **options: Any) -> LLMEngine:
    """The engine of the command line's model: loaded here, or with --tensor-parallel-size above 1
    by each rank (its own shard). The caller shuts it down (`LLMEngine.shutdown`)."""
    if args.tensor_parallel_size == 1:
        return LLMEngine(load_from_args(args), **options)
    progress = sys.stderr.isatty()
    return LLMEngine(
        resolve_model(args.model, models_dir=args.models_dir, progress=progress),
        progress=progress,
        dtype=args.dtype,
        quantization=args.quantization,
        dense_min_tokens=args.dense_min_tokens,
        batch_invariant=args.batch_invariant,
        **parallel_options(args),
        **options,
    )


def load_from_args(args: argparse.Namespace, need_tokenizer: bool = True) -> LoadedModel:
    path = resolve_model(args.model, models_dir=args.models_dir, progress=sys.stderr.isatty())
    loaded = load_model(
        path,
        dtype=args.dtype,
        progress=sys.stderr.isatty(),
        quantization=args.quantization,
        dense_min_tokens=args.dense_min_tokens,
        batch_invariant=args.batch_invariant,
    )
    if need_tokenizer and loaded.tokenizer is None:
        raise TokenmillError(f"{path}: no tokenizer found (tokenizer.json is missing)")
    return loaded


def read_text_arg(text: str | None, file: str | None) -> str:
    """The text given on the command line or read from --file (exactly one of them)."""
    if (text is None) == (file is None):
        raise TokenmillError(
            "give the text either as an argument or with --file, not both or neither"
        )
    if file is None:
        return text
    try:
        with open(file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenmillError(f"cannot read {file}: {exc}") from exc
