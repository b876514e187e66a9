"""Load checkpoints as they are published: HF directories (safetensors) and GGUF files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from tqdm.auto import tqdm

from tokenmill.errors import ModelFileError
from tokenmill.model import families
from tokenmill.model.config import ModelConfig
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.transformer import Transformer

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: "Tokenizer | None"  # None for an HF directory without tokenizer files
    path: Path
    dtype: torch.dtype


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from fp32, bf16, fp16)")
    return DTYPES[dtype]


def load_model(path: str | Path, dtype: str | torch.dtype = "fp32", progress: bool = True) -> LoadedModel:
    """Load a model and its tokenizer from a GGUF file or an HF directory."""
    path = Path(path)
    dtype = parse_dtype(dtype)
    if path.is_dir():
        config, weights, tokenizer = _open_hf_dir(path)
    elif path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(path, "pickle checkpoints are refused (they can run code when loaded); "
                             "use a safetensors or GGUF version of this model")
    elif path.is_file():
        config, weights, tokenizer = _open_gguf(path)
    else:
        raise ModelFileError(path, "no such file or directory")
    model = _build(config, weights, dtype, path, progress)
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, path=path, dtype=dtype)


def _build(config: ModelConfig, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
           path: Path, progress: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    expected = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tqdm(weights, desc=f"loading {path.name}", total=len(expected), unit="tensor",
                             disable=not progress, leave=False):
        if name not in expected:
            continue
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ModelFileError(path, f"shape {tuple(tensor.shape)} does not match the config's "
                                 f"{tuple(expected[name].shape)}", tensor=name)
        state[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelFileError(path, f"missing tensors: {', '.join(missing[:3])}{more}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------- HF directories

def _open_hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], "Tokenizer | None"]:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelFileError(path, "not a model directory: config.json is missing")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise ModelFileError(path, f"only pickle checkpoints found ({', '.join(pickles[:3])}); they are "
                                 "refused because loading them can run code: use a safetensors version")
        raise ModelFileError(path, "no *.safetensors files found")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise ModelFileError(index, f"malformed safetensors index ({exc})") from exc
        shards = [path / name for name in shard_names]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ModelFileError(path, f"shards listed in the index are missing: {', '.join(absent)}")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; report one line
        raise ModelFileError(path / "config.json", f"unreadable config ({exc})") from exc
    try:
        config = families.config_from_hf(getattr(hf_config, "text_config", None) or hf_config)
    except ValueError as exc:
        raise ModelFileError(path / "config.json", str(exc)) from exc
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenmill.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(path)
    return config, _hf_weights(shards, config), tokenizer


def _hf_weights(shards: list[Path], config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    offset = families.hf_norm_offset(config)
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:  # memory-mapped
                for hf_name in f.keys():
                    name = families.hf_tensor_name(hf_name, config)
                    if name is None:
                        continue
                    tensor = f.get_tensor(hf_name)
                    if offset and "norm" in name:
                        tensor = tensor.float() + offset
                    yield name, tensor
        except SafetensorError as exc:
            raise ModelFileError(shard, f"malformed safetensors file ({exc})") from exc


# ---------------------------------------------------------------- GGUF files

def _open_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], "Tokenizer"]:
    from tokenmill.tokenizer import Tokenizer
    from tokenmill.tokenizer.chat_template import builtin_chat_template

    gguf = GGUFFile(path)
    try:
        config = families.config_from_gguf(gguf.metadata, set(gguf.tensors), str(path))
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from exc
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3 rope scaling, precomputed by the converter
        factors = _dense(gguf, "rope_freqs.weight")
        config.rope = type(config.rope)(theta=config.rope.theta, freq_factors=tuple(factors.tolist()))
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = builtin_chat_template(config.architecture)
    return config, _gguf_weights(gguf, config), tokenizer


def _dense(gguf: GGUFFile, name: str) -> torch.Tensor:
    tensor = gguf.load(name)
    return tensor.dequantize() if isinstance(tensor, GGMLWeight) else tensor


def _gguf_weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = families.gguf_qk_permuted(config)
    for gguf_name in gguf.tensors:
        name = families.gguf_tensor_name(gguf_name)
        if name is None:
            continue
        tensor = _dense(gguf, gguf_name)
        if permuted and name.endswith(("attn.q_proj.weight", "attn.k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            tensor = unpermute_rows(tensor, heads)
        yield name, tensor


def unpermute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rope pairs) back to HF's rotate-half order."""
    rows = tensor.shape[0]
    return tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
