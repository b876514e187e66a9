"""Load checkpoints as they are published: HF directories (safetensors) and GGUF files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from tokenmill.errors import ModelFileError
from tokenmill.model import families, kernels, mla, moe
from tokenmill.model.config import ModelConfig
from tokenmill.model.dense_linear import DenseLinear, invariant_kernel_builds
from tokenmill.model.gguf_file import GGUFFile
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import (
    COARSE_X_BLOCK,
    FINE_X_BLOCK,
    QuantEmbedding,
    QuantLinear,
    amx_tiles,
    dense_crossover,
    dense_packed_form,
    gguf_packed,
    keeps_no_dense_copy,
    merge_packed,
    takes_tiles,
)
from tokenmill.model.sharding import (
    Shard,
    ShardLayout,
    layout,
    sharded_config,
    slice_rows,
)
from tokenmill.model.transformer import Transformer

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for an HF directory without tokenizer files
    path: Path
    dtype: torch.dtype
    # whether every row is computed alike whatever its batch (see `load_model`)
    batch_invariant: bool = True
    shard: Shard | None = None  # the tensor-parallel rank this model is a shard of


def preferred_dtype() -> torch.dtype:
    """bf16 where the CPU multiplies it natively (AVX512-BF16 or AMX), else fp32: without those
    instructions oneDNN emulates its bf16 matmul, several times slower than fp32, on AVX-512 CPUs
    without BF16 too, where `torch.ops.mkldnn._is_mkldnn_bf16_supported()` still says yes."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return (
        torch.bfloat16 if native and torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    )


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A dtype by name; "auto" is `preferred_dtype()`."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return preferred_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from auto, fp32, bf16, fp16)")
    return DTYPES[dtype]


def dtype_name(dtype: str | torch.dtype) -> str:
    """The short name (fp32, bf16, fp16) of a dtype or dtype name, "auto" resolved."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        parse_dtype(dtype)
    ]


QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
# our fused projections and the checkpoint projections they are made of
FUSED = {
    "attn.qkv_proj": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "attn.o_proj": ("attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}
# fused projections whose activations round per 8 in the tile kernel (`FINE_X_BLOCK`), the rest per
# 32: the MLP's down projection takes act(gate) x up, the q/k/v projection the attention norm's
# output, whose outliers cost those layers most at 32
FINE_X_BLOCK_TARGETS = frozenset({"attn.qkv_proj", "mlp.down_proj"})
Weight = torch.Tensor | GGMLWeight


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "fp32",
    progress: bool = True,
    quantization: str = "auto",
    dense_min_tokens: int | None = None,
    batch_invariant: bool = True,
    head_rows: Sequence[int] | None = None,
    shard: Shard | None = None,
    while_kernels_build: bool = False,
) -> LoadedModel:
    """Load a model and its tokenizer from a GGUF file or an HF directory.

    quantization: "none" dequantizes everything to `dtype`; "gguf" keeps a GGUF file's quantized
    weights packed (exact int4 for Q4_0/Q4_1/Q4_K, exact 5-bit for Q5_0/Q5_1/Q5_K where the int4 row
    kernel serves, int8 per row otherwise); "int8"/"int4"
    quantize every linear layer; "auto" is "gguf" for GGUF files and "none" otherwise.
    dense_min_tokens: quantized layers also keep a dense copy, used for batches of at least that
    many tokens (prefill, wide decode), where dense matmuls beat the weight-only kernels. None
    picks the measured crossover (`quant_linear.dense_crossover`: in fp32, no copy where tokenmill's
    row kernels serve, else 65 tokens; in bf16, none for the tile kernel where it has AMX, 48 for
    it elsewhere (AVX-512 with VNNI), else 16 for int4 and 8 for int8); 0 keeps no copies.
    batch_invariant: quantized layers compute every row alike whatever the batch (`QuantLinear`),
    so they keep no dense copies: a copy's float matmul rounds differently from the packed kernel;
    dense fp32 layers and a tied fp32 head multiply through `tokenmill::dense_linear`
    (`DenseLinear`), whose kernels are then built here if need be.
    head_rows: the output head computes the logits of these token ids only, in this order (a
    draft model's reduced vocabulary, see `SpeculativeConfig.draft_vocab_size`).
    shard: load only this tensor-parallel rank's share of the weights (see model/sharding.py); the
    returned config then holds the rank's own head and intermediate counts.
    while_kernels_build: load without waiting for tokenmill's kernels to build, in PyTorch's
    layouts throughout (`kernels.deferred`): a stop-gap, which the caller loads again once they
    are built.
    """
    if batch_invariant and dense_min_tokens:
        raise ValueError(
            "dense copies of quantized layers (dense_min_tokens / --dense-min-tokens) switch a "
            "layer's arithmetic by batch size, so a request's output would depend on its batch; "
            "drop the option, or turn batch invariance off (--no-batch-invariant)"
        )
    path = Path(path)
    dtype = parse_dtype(dtype)
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})"
        )
    config, weights, tokenizer = _open(path)
    if shard is not None and (
        config.moe is not None
        or config.qk_norm_whole
        or config.mla is not None
        or config.layers_differ
    ):
        raise ValueError(
            f"tensor parallelism does not split {config.architecture} models yet (mixture-of-"
            "experts layers, q/k norms over all heads, latent attention or layers of different "
            "shapes); run them with --tensor-parallel-size 1"
        )
    if quantization == "auto":
        quantization = "none" if path.is_dir() else "gguf"
    builder = _Builder(
        config,
        dtype,
        path,
        quantization,
        0 if batch_invariant else dense_min_tokens,
        batch_invariant,
        head_rows,
        shard,
    )
    with kernels.deferred() if while_kernels_build else contextlib.nullcontext():
        model = builder.build(weights, progress)
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        path=path,
        dtype=dtype,
        batch_invariant=batch_invariant,
        shard=shard,
    )


def open_model_info(path: str | Path) -> tuple[ModelConfig, Tokenizer | None]:
    """A model's configuration and tokenizer, without loading its weights (for a process that
    tokenizes for engines running elsewhere)."""
    config, _, tokenizer = _open(Path(path))
    return config, tokenizer


def _open(
    path: Path,
) -> tuple[ModelConfig, Iterator[tuple[str, Weight]], Tokenizer | None]:
    """Configuration, weights (read lazily, as they are iterated) and tokenizer of a model."""
    if path.is_dir():
        return _open_hf_dir(path)
    if path.is_file() and path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFileError(
            path,
            "pickle checkpoints are refused (they can run code when loaded); "
            "use a safetensors or GGUF version of this model",
        )
    if path.is_file():
        return _open_gguf(path)
    raise ModelFileError(path, "no such file or directory")


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the loaders look for, by our name, with its shape in the checkpoint."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    width = cfg.per_layer_input_size
    if width:
        shapes |= {
            "per_layer_embed.weight": (cfg.vocab_size, cfg.num_layers * width),
            "per_layer_model_proj.weight": (cfg.num_layers * width, h),
            "per_layer_proj_norm.weight": (width,),
        }
    for i in range(cfg.num_layers):
        head_dim = cfg.layer_head_dim(i)
        q, kv = cfg.num_heads * head_dim, cfg.layer_kv_head_count(i) * head_dim
        ffn = cfg.layer_intermediate_size(i)
        layer = {
            "attn.q_proj.weight": (q, h),
            "attn.k_proj.weight": (kv, h),
            "attn.v_proj.weight": (kv, h),
            "attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (ffn, h),
            "mlp.up_proj.weight": (ffn, h),
            "mlp.down_proj.weight": (h, ffn),
        }
        if cfg.attention_bias:
            layer |= {
                "attn.q_proj.bias": (q,),
                "attn.k_proj.bias": (kv,),
                "attn.v_proj.bias": (kv,),
            }
        if cfg.output_bias:
            layer["attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            layer |= {
                "mlp.gate_proj.bias": (ffn,),
                "mlp.up_proj.bias": (ffn,),
                "mlp.down_proj.bias": (h,),
            }
        if not cfg.post_norm:
            layer |= {"attn_norm.weight": (h,), "ffn_norm.weight": (h,)}
        if cfg.qk_norm:
            layer |= {"attn.q_norm.weight": (head_dim,), "attn.k_norm.weight": (head_dim,)}
        if cfg.qk_norm_whole:
            layer |= {"attn.q_norm.weight": (q,), "attn.k_norm.weight": (kv,)}
        if cfg.attention_sinks:
            layer["attn.sinks"] = (cfg.num_heads,)
        if cfg.layer_is_moe(i):
            layer = {k: v for k, v in layer.items() if not k.startswith("mlp.")}
            layer |= {f"mlp.{k}": v for k, v in moe.layer_shapes(cfg).items()}
        if cfg.sandwich_norm or cfg.post_norm:
            layer |= {"attn_post_norm.weight": (h,), "ffn_post_norm.weight": (h,)}
        if cfg.mla is not None:
            layer = {k: v for k, v in layer.items() if not k.startswith("attn.")}
            layer |= {f"attn.{k}": v for k, v in mla.layer_shapes(cfg).items()}
        if width:
            layer |= {
                "per_layer_gate.weight": (width, h),
                "per_layer_proj.weight": (h, width),
                "per_layer_norm.weight": (h,),
            }
        if cfg.layer_scalars:
            layer["layer_scalar"] = (1,)
        # the projections (and k norm) a layer without keys or values of its own lacks
        absent = ("attn.v_proj",) if i in cfg.k_as_v_layers else ()
        if cfg.kv_source(i) != i:
            absent = ("attn.k_proj", "attn.v_proj", "attn.k_norm")
        layer = {k: v for k, v in layer.items() if k.rpartition(".")[0] not in absent}
        shapes |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    return shapes


class _Builder:
    """Turns checkpoint tensors into the model: fused projections, quantized or dense layers."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        path: Path,
        quantization: str,
        dense_min_tokens: int | None,
        batch_invariant: bool,
        head_rows: Sequence[int] | None = None,
        shard: Shard | None = None,
    ) -> None:
        self.config, self.dtype, self.path = config, dtype, path
        self.quantization = quantization
        self.dense_min_tokens = dense_min_tokens
        self.batch_invariant = batch_invariant
        self.head_rows = head_rows
        self.shard = shard

    def build(self, weights: Iterator[tuple[str, Weight]], progress: bool) -> Transformer:
        expected = checkpoint_shapes(self.config)
        state: dict[str, Weight] = {}
        for name, tensor in tqdm(
            mla.up_projections(
                moe.expert_tensors(_split_fused(weights, self.config, self.path)), self.config
            ),
            desc=f"loading {self.path.name}",
            total=len(expected),
            unit="tensor",
            disable=not progress,
            leave=False,
        ):
            if name not in expected:
                continue
            if tuple(tensor.shape) != expected[name]:
                raise ModelFileError(
                    self.path,
                    f"shape {tuple(tensor.shape)} does not match the config's {expected[name]}",
                    tensor=name,
                )
            state[name] = tensor
        missing = sorted(set(expected) - set(state))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelFileError(self.path, f"missing tensors: {', '.join(missing[:3])}{more}")

        lay = None if self.shard is None else layout(self.config, self.shard)
        config = self.config if lay is None else sharded_config(self.config, self.shard)
        with torch.device("meta"):
            model = Transformer(config)
        for i, layer in enumerate(model.layers):
            for target, parts in FUSED.items():
                if target.startswith("mlp.") and config.layer_is_moe(i):
                    continue
                if target == "attn.qkv_proj" and config.mla is not None:
                    continue  # latent attention's projections (`_build_mla`)
                parts = [p for p in parts if f"layers.{i}.{p}.weight" in expected]  # see k_as_v
                ws = [state.pop(f"layers.{i}.{p}.weight") for p in parts]
                bs = [state.pop(f"layers.{i}.{p}.bias", None) for p in parts]
                if lay is not None:
                    ws, bs = self._shard_rows(target, ws, bs, lay)
                owner, attr = target.split(".")
                x_block = FINE_X_BLOCK if target in FINE_X_BLOCK_TARGETS else COARSE_X_BLOCK
                setattr(getattr(layer, owner), attr, self.linear(ws, bs, x_block))
            if config.layer_is_moe(i):
                self._build_moe(f"layers.{i}.mlp", layer.mlp, state)
            if config.mla is not None:
                self._build_mla(f"layers.{i}.attn", layer.attn, state)
            if config.per_layer_input_size:
                for attr in ("per_layer_gate", "per_layer_proj"):
                    weight = state.pop(f"layers.{i}.{attr}.weight")
                    setattr(layer, attr, self.linear([weight], [None], COARSE_X_BLOCK))
        if config.per_layer_input_size:
            self._build_per_layer_inputs(model, state)
        embed = state.pop("embed.weight")
        head = state.pop("lm_head.weight", None)
        keep_quantized = self.quantization == "gguf" and isinstance(embed, GGMLWeight)
        if self.head_rows is not None:  # its own layer of those rows, tied or not
            rows = _select_rows(embed if head is None else head, self.head_rows)
            model.lm_head = self.linear([rows], [None], x_block=COARSE_X_BLOCK)
            _release([head] if head is not None else [])
        elif head is not None:
            model.lm_head = self.linear([head], [None], x_block=COARSE_X_BLOCK)
        elif keep_quantized or self.quantization in ("int8", "int4"):
            # tied, but the head needs its own packed form
            model.lm_head = self.linear([embed], [None], x_block=COARSE_X_BLOCK)
        if model.lm_head is None and self.batch_invariant and self.dtype == torch.float32:
            invariant_kernel_builds()  # the tied head multiplies by the embedding's table
            model.invariant_head = True
        if keep_quantized:
            # looked up from the file's rows as they are: a tied head's re-quantized int8 rows
            # would cost perplexity to save only the pages of rows never looked up
            model.embed = QuantEmbedding(embed, self.dtype)
        else:
            model.embed = nn.Embedding.from_pretrained(_dense(embed, self.dtype), freeze=True)
        _release([embed])
        model.load_state_dict(
            {k: _dense(v, self.dtype) for k, v in state.items()}, strict=False, assign=True
        )
        left = [
            n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta
        ]
        if left:
            raise ModelFileError(self.path, f"no weights for {', '.join(left[:3])}")
        return model.eval().requires_grad_(False)

    def _build_per_layer_inputs(self, model: Transformer, state: dict[str, Weight]) -> None:
        """Gemma 4's second embedding table, looked up from the file's rows where it stays
        quantized (as the main one: it is the largest tensor of the smaller models), and the
        projection of the main embedding."""
        table = state.pop("per_layer_embed.weight")
        if self.quantization == "gguf" and isinstance(table, GGMLWeight):
            model.per_layer_embed = QuantEmbedding(table, self.dtype)
        else:
            model.per_layer_embed = nn.Embedding.from_pretrained(
                _dense(table, self.dtype), freeze=True
            )
            _release([table])
        weight = state.pop("per_layer_model_proj.weight")
        model.per_layer_model_proj = self.linear([weight], [None], COARSE_X_BLOCK)

    def _build_moe(self, prefix: str, block: moe.MoE, state: dict[str, Weight]) -> None:
        """The layers of a mixture-of-experts feed-forward. The router and the shared expert's gate
        stay dense (in the model's dtype), as llama.cpp keeps them: a rounded score could pick
        another expert."""
        block.router = self.linear(
            [state.pop(f"{prefix}.router.weight")],
            [state.pop(f"{prefix}.router.bias", None)],
            COARSE_X_BLOCK,
            packed=False,
        )
        for e, expert in enumerate(block.experts):
            self._build_mlp(f"{prefix}.experts.{e}", expert, state)
        if block.shared_expert is not None:
            self._build_mlp(f"{prefix}.shared_expert", block.shared_expert, state)
        if block.shared_gate is not None:
            weight = state.pop(f"{prefix}.shared_gate.weight")
            block.shared_gate = self.linear([weight], [None], COARSE_X_BLOCK, packed=False)
        if block.score_bias is not None:  # float32, as the scores it is added to
            bias = _dense(state.pop(f"{prefix}.score_bias"), torch.float32)
            block.score_bias = nn.Parameter(bias, requires_grad=False)

    def _build_mla(self, prefix: str, attn: mla.LatentAttention, state: dict[str, Weight]) -> None:
        """The projections of a latent attention layer, packed or dense as any other; its norms and
        per-head up-projections (dense) load with the rest of the state."""
        names = ["q_a_proj", "q_b_proj"] if attn.settings.q_lora_rank else ["q_proj"]
        for name in [*names, "kv_a_proj_with_mqa"]:
            weight = state.pop(f"{prefix}.{name}.weight")
            layer = self.linear([weight], [None], COARSE_X_BLOCK)
            setattr(attn, name, layer)

    def _build_mlp(self, prefix: str, mlp: nn.Module, state: dict[str, Weight]) -> None:
        gate, up, down = (f"{prefix}.{p}" for p in ("gate_proj", "up_proj", "down_proj"))
        mlp.gate_up_proj = self.linear(
            [state.pop(f"{gate}.weight"), state.pop(f"{up}.weight")],
            [state.pop(f"{gate}.bias", None), state.pop(f"{up}.bias", None)],
            COARSE_X_BLOCK,
        )
        mlp.down_proj = self.linear(
            [state.pop(f"{down}.weight")],
            [state.pop(f"{down}.bias", None)],
            FINE_X_BLOCK,
        )

    def _shard_rows(
        self,
        target: str,
        weights: list[Weight],
        biases: list[torch.Tensor | None],
        lay: ShardLayout,
    ) -> tuple[list[Weight], list[torch.Tensor | None]]:
        """This rank's output rows of a projection (see model/sharding.py): its heads of q, k and
        v, its intermediate rows of gate and up, its hidden rows of o_proj and down_proj."""
        d = self.config.head_dim
        if target == "attn.qkv_proj":
            kv = range(lay.kv_heads.start * d, lay.kv_heads.stop * d)
            parts = [range(lay.q_heads.start * d, lay.q_heads.stop * d), kv, kv]
        elif target == "mlp.gate_up_proj":
            parts = [lay.ffn, lay.ffn]
        else:
            parts = [lay.hidden]
        rows = [slice_rows(w, r) for w, r in zip(weights, parts)]
        return rows, [None if b is None else slice_rows(b, r) for b, r in zip(biases, parts)]

    def linear(
        self,
        weights: list[Weight],
        biases: list[torch.Tensor | None],
        x_block: int,
        packed: bool = True,
    ) -> nn.Module:
        """One module computing the concatenated outputs of these checkpoint projections (x_block:
        see `QuantLinear`); packed: False keeps the layer dense whatever the quantization."""
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)]
            )
            bias = bias.to(self.dtype)
        rows = sum(w.shape[0] for w in weights)
        q = self.quantization
        quantize = packed and (
            q in ("int8", "int4")
            or (q == "gguf" and all(isinstance(w, GGMLWeight) for w in weights))
        )
        num_cols = weights[0].shape[1]
        if not quantize:
            invariant = self.batch_invariant and self.dtype == torch.float32
            if invariant:  # built before the first step, as for packed layers
                invariant_kernel_builds()
            layer = (DenseLinear if invariant else nn.Linear)(
                num_cols, rows, bias=bias is not None, device="meta"
            )
            dense = _cat_rows([_dense(w, self.dtype) for w in weights])
            layer.weight = nn.Parameter(dense.contiguous(), requires_grad=False)
            if bias is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            return layer
        tiles = takes_tiles(rows, num_cols)
        if q == "gguf":
            # a switching layer keeps int8 rows for Q6_K and float scales, the forms its AMX
            # batches were measured with (tuning log: `q6_tiles`)
            kind, data = gguf_packed(weights, tiles, self.batch_invariant or not amx_tiles())
        else:
            kind, data = merge_packed(
                [dense_packed_form(_dense(w, torch.float32), q) for w in weights]
            )
        threshold = (
            self.dense_min_tokens
            if self.dense_min_tokens is not None
            else dense_crossover(kind, self.dtype, tiles)
        )
        if keeps_no_dense_copy(kind, rows * num_cols):
            threshold = 0
        dense = None
        if threshold > 0:
            dense = _cat_rows([_dense(w, self.dtype) for w in weights]).contiguous()
        _release(weights)
        return QuantLinear(
            rows,
            num_cols,
            self.dtype,
            **{kind: data},
            bias=bias,
            dense=dense,
            dense_min_tokens=threshold,
            tiles=tiles,
            x_block=x_block,
            batch_invariant=self.batch_invariant,
        )


def _split_fused(
    weights: Iterator[tuple[str, Weight]], cfg: ModelConfig, path: Path
) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with each fused one (Phi-3's qkv and gate/up) split into the
    projections it stacks; the builder fuses them its own way again."""
    for name, tensor in weights:
        parts = families.fused_parts(name, cfg)
        if parts is None:
            yield name, tensor
            continue
        total = sum(rows for _, rows in parts)
        if tensor.shape[0] != total:
            raise ModelFileError(
                path,
                f"{tensor.shape[0]} rows where the config gives {total}",
                tensor=name,
            )
        start = 0
        for part, rows in parts:
            yield part, slice_rows(tensor, range(start, start + rows))
            start += rows


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked by rows; a single part as it is (a copy of a 262k-row head would double
    its memory while loading)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _select_rows(weight: Weight, rows: Sequence[int]) -> Weight:
    """These rows of a checkpoint tensor, in this order (a GGML tensor's stay quantized)."""
    index = torch.tensor(rows, dtype=torch.int64)
    if isinstance(weight, GGMLWeight):
        return GGMLWeight(weight.data[index], weight.qtype, (len(rows), *weight.shape[1:]))
    return weight[index]


def _release(weights: list[Weight]) -> None:
    """Let go of the file pages of weights converted into their in-memory form."""
    for w in weights:
        if isinstance(w, GGMLWeight) and w.release is not None:
            w.release()


def _dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, GGMLWeight) else w.to(dtype)


# ---------------------------------------------------------------- HF directories


def _open_hf_dir(
    path: Path,
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], Tokenizer | None]:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelFileError(path, "not a model directory: config.json is missing")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise ModelFileError(
                path,
                f"only pickle checkpoints found ({', '.join(pickles[:3])}); they are "
                "refused because loading them can run code: use a safetensors version",
            )
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
            raise ModelFileError(
                path, f"shards listed in the index are missing: {', '.join(absent)}"
            )
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
    weights = _hf_weights(shards, config)
    if families.hf_interleaved_experts(config):
        weights = moe.deinterleave_hf_experts(weights)
    return config, weights, tokenizer


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


def _open_gguf(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]], Tokenizer]:
    from tokenmill.tokenizer import Tokenizer
    from tokenmill.tokenizer.chat_template import builtin_chat_template

    gguf = GGUFFile(path)
    try:
        config = families.config_from_gguf(gguf.metadata, set(gguf.tensors), str(path))
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from exc
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3 rope scaling, precomputed by the converter
        factors = _dense(gguf.load("rope_freqs.weight"), torch.float32)
        config.rope = type(config.rope)(
            theta=config.rope.theta, freq_factors=tuple(factors.tolist())
        )
    if "rope_factors_long.weight" in gguf.tensors:  # Phi-3's LongRoPE
        short, long = (
            _dense(gguf.load(f"rope_factors_{kind}.weight"), torch.float32).tolist()
            for kind in ("short", "long")
        )
        try:
            config.rope = families.gguf_longrope(gguf.metadata, config, short, long)
        except ValueError as exc:
            raise ModelFileError(path, str(exc)) from exc
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = builtin_chat_template(config.architecture)
    return config, _gguf_weights(gguf, config), tokenizer


def _gguf_weights(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, Weight]]:
    permuted = families.gguf_qk_permuted(config)
    for gguf_name in gguf.tensors:
        name = families.gguf_tensor_name(gguf_name, config)
        if name is None:
            continue
        tensor = gguf.load(gguf_name)
        if permuted and name.endswith(
            ("attn.q_proj.weight", "attn.k_proj.weight", "q_proj.bias", "k_proj.bias")
        ):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            if isinstance(tensor, GGMLWeight):  # rows are independent blocks: permute the raw bytes
                permuted = GGMLWeight(
                    unpermute_rows(tensor.data, heads), tensor.qtype, tensor.shape
                )
                _release([tensor])  # the permuted copy replaces the file's bytes
                tensor = permuted
            else:
                tensor = unpermute_rows(tensor, heads)
        yield name, tensor


def unpermute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rope pairs) back to HF's rotate-half order."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
    )
