"""The generic decoder-only transformer; per-family differences come from `ModelConfig`.

Internal parameter names follow the block structure (attn_norm, attn.q_proj, ffn_norm, mlp.*,
...); loaders map each checkpoint format's names onto them.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tokenmill.model import kernels
from tokenmill.model.attention import AttentionBatch, KVCache, kernel_fits, paged_attention
from tokenmill.model.config import ModelConfig, RopeSettings
from tokenmill.model.dense_linear import invariant_linear
from tokenmill.model.moe import MoE
from tokenmill.model.quant_linear import prompt_split, step_rows_within

# Plain calls: the modules an eager step calls most (norms, attention, decoder layers and
# `QuantLinear`) set `__call__ = forward`. nn.Module's own `__call__` runs its hook dispatch before
# `forward`, a few microseconds of Python a call, and an eager decode step makes about ten such
# calls a layer. Forward hooks therefore do not run on these modules. MLP keeps nn.Module's call,
# with its hooks (experts of a mixture are MLPs, which tests hook).
# Tuning log: `__call__ = forward`.


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma's (1 + w) form is folded into w by the loaders."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]  # not through nn.Module's __getattr__: a hot path
        if _fused_norm_fits(x, weight):
            return kernels.ops().rms_norm(x, weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * weight.float()).to(x.dtype)

    __call__ = forward  # without nn.Module's hook dispatch: see "Plain calls" above


def _kernel_fits(x: torch.Tensor) -> bool:
    """Whether tokenmill's one-pass elementwise kernels (norm, rotary, gated activation) may take x:
    CPU tensors in float32 or bf16. Compiled graphs call them too, rather than fusing their own
    versions, so that eager and compiled steps round alike."""
    return x.is_cpu and kernels.loaded() and x.dtype in (torch.bfloat16, torch.float32)


def _fused_norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether tokenmill's one-pass RMSNorm applies: rows, or heads of rows, with a contiguous last
    dimension in whole vectors."""
    return (
        _kernel_fits(x)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and x.dim() in (2, 3)
        and x.stride(-1) == 1
        and (x.dim() == 2 or x.stride(1) == x.shape[2])
        and x.shape[-1] % 16 == 0
    )


class Rotary:
    """Rotary embedding of one rope setting (rotate-half layout), evaluated for a step's
    positions."""

    def __init__(self, settings: RopeSettings, rotary_dim: int) -> None:
        self.inv_freq = settings.inv_freq(rotary_dim)
        self.long = settings.long_inv_freq(rotary_dim)
        self.factor = settings.attention_factor

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (T, 1, rotary_dim // 2), computed once per step and shared by
        layers."""
        # compiled graphs see the op, eager steps call its function without the op's dispatch
        # (whose first call imports torch._dynamo: over a second, on a server's first request)
        tables = torch.ops.tokenmill_rope.tables if torch.compiler.is_compiling() else rope_tables
        cos, sin = tables(positions, self.inv_freq.to(positions.device))
        if self.long is not None:  # LongRoPE: positions past the original context
            long_inv_freq, start = self.long
            long_cos, long_sin = tables(positions, long_inv_freq.to(positions.device))
            is_long = (positions >= start)[:, None]
            cos, sin = torch.where(is_long, long_cos, cos), torch.where(is_long, long_sin, sin)
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin of each position times each frequency (T, head_dim // 2). Compiled
    graphs call it as an op of its own (`tokenmill_rope::tables`), so that they use PyTorch's eager
    cos and sin: inductor's own differ from them in the last bit for about a third of the angles,
    and a decode token's rotation (hence its logits) would then depend on whether its step ran
    compiled or eagerly beside a prompt.

    The angles are float32 products; their cos and sin are taken in float64 and rounded once.
    ATen's float32 cos can be off by up to ~1e-4 on its first call after `torch._dynamo` is
    imported, in the rows another thread computes, and a process's first prompt would then rotate
    differently from the same prompt later (tuning log: `rope_tables`)."""
    freqs = (positions.float()[:, None] * inv_freq[None, :]).double()
    return freqs.cos().float(), freqs.sin().float()


@torch.library.custom_op("tokenmill_rope::tables", mutates_args=())
def _rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_tables(positions, inv_freq)


@_rope_tables.register_fake
def _rope_tables_shape(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], inv_freq.shape[0])
    return inv_freq.new_empty(shape), inv_freq.new_empty(shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (T, heads, head_dim) with tables from `Rotary.tables`; a partial rotary
    embedding turns the leading dimensions the tables cover and passes the rest through."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        rotated = apply_rotary(x[..., :turned], cos, sin)
        return torch.cat((rotated, x[..., turned:]), dim=-1)
    if _fused_rotary_fits(x, cos, sin):
        return kernels.ops().rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _fused_rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether tokenmill's one-pass rotary embedding applies: heads of rows with a contiguous last
    dimension, halves in whole vectors, tables of x's dtype."""
    return (
        _kernel_fits(x)
        and _rotary_tables_fit(cos, sin, x.dtype)
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[-1] % 32 == 0
    )


def _rotary_tables_fit(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the rotary kernels take these tables: contiguous, of the rotated tensor's dtype."""
    return cos.dtype == sin.dtype == dtype and cos.is_contiguous() and sin.is_contiguous()


def _fused_write_fits(qkv: torch.Tensor, rope: tuple | None, k_cache: torch.Tensor) -> bool:
    """Whether `tokenmill::rotary_write_kv` takes an eager step's fused projection to the cache:
    rows with contiguous columns, a rope over whole heads with tables of their dtype, a contiguous
    cache of a dtype it writes. Compiled graphs fuse the ops it replaces themselves."""
    if rope is None or torch.compiler.is_compiling() or not _kernel_fits(qkv):
        return False
    cos, sin = rope
    head_dim = k_cache.shape[-1]
    return (
        qkv.dim() == 2
        and qkv.stride(1) == 1
        and 2 * cos.shape[-1] == head_dim
        and head_dim % 32 == 0
        and _rotary_tables_fit(cos, sin, qkv.dtype)
        and k_cache.dim() == 3
        and k_cache.is_contiguous()
        and k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.layer_kv_head_count(layer),
            cfg.layer_head_dim(layer),
        )
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.head_dim**-0.5
        self.softcap = cfg.attn_logit_softcap
        self.window = cfg.layer_window(layer)
        self.q_size, self.kv_size = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        # the projections of k and v this layer has: none where it attends over another layer's
        # cache, k alone where its values are its keys' projection (Gemma 4's global layers)
        writes = cfg.kv_source(layer) == layer
        self.kv_parts = 0 if not writes else 1 if layer in cfg.k_as_v_layers else 2
        # q, k and v in one matmul (the loader concatenates the checkpoint's three projections)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + self.kv_parts * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.output_bias)
        # per head, or over all heads of q and of k at once (qk_norm_whole: OLMoE, OLMo 2)
        self.qk_norm_whole = cfg.qk_norm_whole
        q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm_whole else (self.head_dim,) * 2
        normed = cfg.qk_norm or cfg.qk_norm_whole
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps) if normed else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps) if normed and writes else None
        self.value_norm_eps = cfg.rms_norm_eps if cfg.value_norm else None
        # q, k and v go from the projection to the rope and the cache without norms, so that one
        # op may take them there (`_fused_write_fits`)
        self.unnormed_qkv = self.q_norm is None and self.value_norm_eps is None
        # under tensor parallelism: what each rank contributes to the gathers (model/sharding.py)
        self.gather = cfg.gather
        # a logit per head in each softmax's denominator (gpt-oss)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """rope: the step's cos and sin tables, None in a layer without rope."""
        tokens = x.shape[0]
        if self.kv_parts != 2:
            return self._forward_kv_parts(x, rope, k_cache, v_cache, batch, mask)
        qkv = self.qkv_proj(x)
        if self.unnormed_qkv and _fused_write_fits(qkv, rope, k_cache):
            q = kernels.ops().rotary_write_kv(
                qkv, *rope, k_cache, v_cache, batch.slot_mapping, self.num_heads
            )
            return self._attend_and_project(q, None, None, k_cache, v_cache, batch, mask)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.value_norm_eps is not None:
            v = rms_normalized(v, self.value_norm_eps)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self._attend_and_project(q, k, v, k_cache, v_cache, batch, mask)

    __call__ = forward  # without nn.Module's hook dispatch: see "Plain calls" above

    def _forward_kv_parts(
        self,
        x: torch.Tensor,
        rope: tuple | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """`forward` of a layer without a v projection (Gemma 4): its values are its keys'
        projection before the key norm and rope, or, with no k projection either, it attends
        over another layer's cache, which that layer wrote this step's K/V into already."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].reshape(tokens, self.num_heads, self.head_dim)
        k = v = None
        if self.kv_parts:
            v = qkv[:, self.q_size :].reshape(tokens, self.num_kv_heads, self.head_dim)
            k = v if self.k_norm is None else self.k_norm(v)
            if self.value_norm_eps is not None:
                v = rms_normalized(v, self.value_norm_eps)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if rope is not None:
            q = apply_rotary(q, *rope)
            k = None if k is None else apply_rotary(k, *rope)
        return self._attend_and_project(q, k, v, k_cache, v_cache, batch, mask)

    def _attend_and_project(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """Attention over the cache, then o_proj (under tensor parallelism, over every rank's
        heads, and every rank's rows gathered)."""
        sinks = None if self.sinks is None else self.sinks.float()
        out = paged_attention(
            q, k, v, k_cache, v_cache, batch, mask, self.scale, self.softcap, self.window, sinks
        )
        out = out.reshape(q.shape[0], self.q_size)
        if self.gather is None:
            return self.o_proj(out)
        out = self.o_proj(gather_columns(out, self.gather.attention))
        return gather_columns(out, self.gather.hidden)


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weights over the last dimension, computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def gather_columns(x: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    """Every tensor-parallel rank's columns of a (tokens, widths[rank]) tensor, concatenated in
    rank order. All-gather takes equal sizes, so a narrower rank's columns are padded for it."""
    width = max(widths)
    x = F.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x.contiguous()
    parts = [torch.empty_like(x) for _ in widths]
    dist.all_gather(parts, x)
    return torch.cat([part[:, :w] for part, w in zip(parts, widths)], dim=1)


# The MLP activations by config name; tokenmill::gated_activation knows the same names.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}

# The most bytes of gate/up products an MLP call holds at once: a prompt's rows pass through the
# MLP in chunks that keep them under it. glibc hands out blocks over its 32 MB mmap threshold (the
# most `_configure_cpu_allocator` may set) as fresh mappings, so every call of a larger product
# would fault its pages in anew; blocks under it are reused from the heap. Rows are independent,
# so the chunks change no value (tuning log: `MLP_CHUNK_BYTES`).
MLP_CHUNK_BYTES = 16 << 20


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        """intermediate_size: the width, when not the config's (an expert's)."""
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.act_name = cfg.hidden_act
        # under tensor parallelism: what each rank contributes to the gathers (model/sharding.py)
        self.gather = cfg.gather
        # the gate/up width that sets a chunk's rows (`MLP_CHUNK_BYTES`): under tensor parallelism
        # the widest rank's, so that every rank cuts the same chunks, each of which gathers
        self.chunk_width = 2 * (max(cfg.gather.intermediate) if cfg.gather else width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(1, MLP_CHUNK_BYTES // (self.chunk_width * x.element_size()))
        if x.dim() == 2 and x.shape[0] > rows:
            return torch.cat([self._chunk(x, start, rows) for start in range(0, x.shape[0], rows)])
        return self._forward(x)

    def _chunk(self, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
        part = x[start : start + rows]
        with step_rows_within(start, part.shape[0]):
            return self._forward(part)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if _fused_activation_fits(gate_up):
            act = kernels.ops().gated_activation(gate_up, self.act_name)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = ACTIVATIONS[self.act_name](gate) * up
        if self.gather is None:
            return self.down_proj(act)
        out = self.down_proj(gather_columns(act, self.gather.intermediate))
        return gather_columns(out, self.gather.hidden)


def _fused_activation_fits(gate_up: torch.Tensor) -> bool:
    """Whether the C++ act(gate) * up applies: a contiguous (tokens, 2 x width) tensor."""
    return _kernel_fits(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        pre, post = not cfg.post_norm, cfg.sandwich_norm or cfg.post_norm
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pre else None
        if cfg.mla is not None:
            # imported here: model/mla.py builds on this module's norm and rotary embedding
            from tokenmill.model.mla import LatentAttention

            self.attn = LatentAttention(cfg, layer)
        else:
            self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pre else None
        self.mlp = (
            MoE(cfg, lambda width: MLP(cfg, width))
            if cfg.layer_is_moe(layer)
            else MLP(cfg, cfg.layer_intermediate_size(layer))
        )
        self.attn_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post else None
        self.ffn_post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if post else None
        self.residual_scale = cfg.residual_scale
        # Gemma 4: the layer's per-layer input gated by its output, projected back and added
        # (`Transformer.per_layer_inputs`), then the whole stream times a learned scalar
        width = cfg.per_layer_input_size
        self.per_layer_gate = nn.Linear(cfg.hidden_size, width, bias=False) if width else None
        self.per_layer_proj = nn.Linear(width, cfg.hidden_size, bias=False) if width else None
        self.per_layer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if width else None
        self.act_name = cfg.hidden_act
        self.layer_scalar = nn.Parameter(torch.ones(1)) if cfg.layer_scalars else None

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | tuple[torch.Tensor, ...],
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """per_layer_input: this layer's (T, per_layer_input_size) input, where the model has
        them."""
        x = h if self.attn_norm is None else self.attn_norm(h)
        a = self.attn(x, rope, k_cache, v_cache, batch, mask)
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        if self.residual_scale != 1.0:
            a = a * self.residual_scale
        h = h + a
        m = self.mlp(h if self.ffn_norm is None else self.ffn_norm(h))
        if self.ffn_post_norm is not None:
            m = self.ffn_post_norm(m)
        if self.residual_scale != 1.0:
            m = m * self.residual_scale
        h = h + m
        if self.per_layer_gate is not None:
            gated = ACTIVATIONS[self.act_name](self.per_layer_gate(h)) * per_layer_input
            h = h + self.per_layer_norm(self.per_layer_proj(gated))
        if self.layer_scalar is not None:
            h = h * self.layer_scalar.to(h.dtype)
        return h

    __call__ = forward  # without nn.Module's hook dispatch: see "Plain calls" above

    def kernel_weights(self, h: torch.Tensor) -> object | None:
        """The layer as `tokenmill::decoder_layer` computes it for rows like h (a
        `DecoderLayerWeights`, bound anew on each call: `Transformer` keeps them), or None for a
        layer it does not compute: it takes a pre-norm layer (with post norms or without) of
        attention with q, k and v in one projection (with per-head q/k norms or without) and a
        plain MLP without hooks, outside tensor parallelism, each linear layer in a form it
        multiplies by (`_bound_linear`), every norm with the layer's eps."""
        if type(self.mlp) is not MLP or _has_hooks(self.mlp):
            return None
        return self._bind_kernel_weights(h)

    def _bind_kernel_weights(self, h: torch.Tensor) -> object | None:
        attn, mlp = self.attn, self.mlp
        if type(attn) is not Attention or self.attn_norm is None:
            return None
        head_norms = [attn.q_norm, attn.k_norm] if attn.q_norm is not None else []
        post_norms = (
            [self.attn_post_norm, self.ffn_post_norm] if self.attn_post_norm is not None else []
        )
        norms = [self.attn_norm, self.ffn_norm, *head_norms, *post_norms]
        plain = (
            attn.kv_parts == 2
            and attn.value_norm_eps is None
            and not attn.qk_norm_whole
            and attn.gather is None
            and mlp.gather is None
            and attn.head_dim % 16 == 0
            and all(norm.eps == self.attn_norm.eps for norm in norms)
            and all(_fused_norm_fits(h, norm.weight) for norm in [*norms[:2], *post_norms])
            and all(norm.weight.dtype in (torch.float32, torch.bfloat16) for norm in head_norms)
            and self.residual_scale == 1.0
            and self.per_layer_gate is None
            and self.layer_scalar is None
        )
        if not plain:
            return None
        linears = [
            _bound_linear(linear, h)
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if any(linear is None for linear in linears):
            return None
        qkv, o, gate_up, down = linears
        q_norm, k_norm = [norm.weight for norm in head_norms] or [None, None]
        attn_post_norm, ffn_post_norm = [norm.weight for norm in post_norms] or [None, None]
        return kernels.ops().DecoderLayerWeights(
            attn_norm=self.attn_norm.weight,
            ffn_norm=self.ffn_norm.weight,
            q_norm=q_norm,
            k_norm=k_norm,
            attn_post_norm=attn_post_norm,
            ffn_post_norm=ffn_post_norm,
            eps=self.attn_norm.eps,
            qkv=qkv,
            o=o,
            gate_up=gate_up,
            down=down,
            heads=attn.num_heads,
            scale=attn.scale,
            softcap=attn.softcap,
            sinks=None if attn.sinks is None else attn.sinks.float(),
            activation=mlp.act_name,
        )


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


@dataclass(frozen=True)
class _KernelPlan:
    """What `Transformer._kernel_layer_calls` checks and binds once per model, dtype, one row or
    more, and cache dtype: each layer's weights, rope kind, cache index and window, the most rows
    one MLP call takes (`MLP_CHUNK_BYTES`), and the MLPs whose hooks each step checks."""

    layers: tuple[tuple[object, str, int, int | None], ...]
    max_rows: int
    mlps: tuple[nn.Module, ...]


# `Transformer._kernel_plan` by model, then by (dtype, one row, cache dtype): kept outside the
# modules, whose state the compiled graphs' builds pickle, which the bound C++ objects do not
# support. None: the model's steps of that key keep the Python forward.
_KERNEL_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _KernelPlan | None]] = (
    weakref.WeakKeyDictionary()
)


def _bound_linear(linear: nn.Module, x: torch.Tensor) -> object | None:
    """A linear layer as `tokenmill::decoder_layer` multiplies rows like x by it (a
    `BoundLinear`), or None where its forward takes another way."""
    if hasattr(linear, "bound"):  # QuantLinear, DenseLinear
        return linear.bound(x)
    if type(linear) is nn.Linear:
        return kernels.ops().bind_linear(linear.weight, linear.bias)
    return None


class Transformer(nn.Module):
    """Decoder over a flat batch of new tokens from many sequences (see `AttentionBatch`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # the loader supplies the table: an explicit `_weight` skips the random init, whose
        # normal_() on the meta device imports torch._dynamo, which takes seconds of the start
        self.embed = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotaries = {
            kind: Rotary(cfg.layer_rope(i), cfg.layer_rope_dim(i))
            for i, kind in enumerate(cfg.layer_types)
        }
        # each layer's cache tensor: its own, or the one of the layer it shares (Gemma 4)
        sources = [cfg.kv_source(i) for i in range(cfg.num_layers)]
        self.cache_index = [cfg.cache_layers().index(source) for source in sources]
        # Gemma 4's per-layer inputs (see `per_layer_inputs`); the loader supplies the weights
        width = cfg.per_layer_input_size * cfg.num_layers
        self.per_layer_embed = (
            nn.Embedding(cfg.vocab_size, width, _weight=torch.empty(cfg.vocab_size, width))
            if width
            else None
        )
        self.per_layer_model_proj = nn.Linear(cfg.hidden_size, width, bias=False) if width else None
        self.per_layer_proj_norm = (
            RMSNorm(cfg.per_layer_input_size, cfg.rms_norm_eps) if width else None
        )
        # a tied head multiplies through `invariant_linear` (set by the loader for batch-invariant
        # fp32 models), else through F.linear
        self.invariant_head = False

    def forward(
        self, input_ids: torch.Tensor, cache: KVCache, batch: AttentionBatch
    ) -> torch.Tensor:
        """Hidden states (T, hidden) after the final norm for the flat token list `input_ids`."""
        h = self.embed(input_ids)
        if self.config.embed_scale != 1.0:
            h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype)
        masks = {
            window: batch.mask(window) for window in {layer.attn.window for layer in self.layers}
        }
        ropes = {kind: r.tables(batch.positions, h.dtype) for kind, r in self.rotaries.items()}
        calls = self._kernel_layer_calls(h, batch, masks, ropes, cache)
        if calls is not None:
            decoder_layer = kernels.ops().decoder_layer
            for args in calls:
                h = decoder_layer(h, *args)
            return self.norm(h)
        no_rope = self.config.no_rope_layers
        per_layer = None if self.per_layer_embed is None else self.per_layer_inputs(input_ids, h)
        for i, (kind, layer) in enumerate(zip(self.config.layer_types, self.layers)):
            rope = None if i in no_rope else ropes[kind]
            c = self.cache_index[i]
            mask = masks[layer.attn.window]
            if per_layer is None:
                h = layer(h, rope, cache.k[c], cache.v[c], batch, mask)
            else:
                h = layer(h, rope, cache.k[c], cache.v[c], batch, mask, per_layer[:, i])
        return self.norm(h)

    def _kernel_layer_calls(
        self,
        h: torch.Tensor,
        batch: AttentionBatch,
        masks: dict[int | None, torch.Tensor | tuple[torch.Tensor, ...]],
        ropes: dict[str, tuple[torch.Tensor, torch.Tensor]],
        cache: KVCache,
    ) -> list[tuple] | None:
        """Each layer's arguments after h for `tokenmill::decoder_layer`, where it computes every
        layer of this eager step (`_kernel_plan`): the step's tokens attend through the decode
        kernel in one call (a decode step, or prompts with `token_context_slots`) and are few
        enough for one MLP call, and no MLP has a hook. None otherwise: the layers' Python
        forwards, which call the same ops where these hold."""
        if torch.compiler.is_compiling() or not _kernel_fits(h) or h.dim() != 2:
            return None
        if batch.token_context_slots is not None:
            slots = batch.token_context_slots
        elif batch.max_q == 1 and batch.parts is None:
            slots = batch.context_slots
        else:
            return None
        plan = self._kernel_plan(h, ropes, cache)
        if plan is None or h.shape[0] > plan.max_rows or any(map(_has_hooks, plan.mlps)):
            return None
        return [
            (
                weights,
                *ropes[kind],
                cache.k[c],
                cache.v[c],
                batch.slot_mapping,
                slots,
                masks[window],
            )
            for weights, kind, c, window in plan.layers
        ]

    def _kernel_plan(
        self, h: torch.Tensor, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]], cache: KVCache
    ) -> _KernelPlan | None:
        """The step-invariant part of `_kernel_layer_calls`, built on the first step of its key
        (rows like h, the cache's dtype): every layer one `decoder_layer` takes
        (`DecoderLayer.kernel_weights`), with a rope over whole heads (the rope tables are of h's
        dtype and their kind's width on every step) and a cache `tokenmill::rotary_write_kv` and
        the decode kernel take; else None."""
        plans = _KERNEL_PLANS.setdefault(self, {})
        # the layers bind their products for rows of one kind: all prompt tokens, or none
        prompts = prompt_split(h.shape[0])
        if 0 < prompts < h.shape[0]:
            return None
        key = (h.dtype, h.shape[0] == 1, cache.k[0].dtype, prompts == 0)
        if key in plans:
            return plans[key]  # the caller checks the MLPs' hooks on every step
        if any(_has_hooks(layer.mlp) for layer in self.layers):
            return None  # not kept: the plan holds for steps after the hooks are gone
        plans[key] = None
        if self.per_layer_embed is not None or self.config.no_rope_layers:
            return None
        layers, max_rows = [], 1 << 62
        for kind, layer, c in zip(self.config.layer_types, self.layers, self.cache_index):
            weights, attn, k_cache = layer.kernel_weights(h), layer.attn, cache.k[c]
            # h stands in for the q/k/v projection in `_fused_write_fits`: rows of its dtype
            if (
                weights is None
                or not _fused_write_fits(h, ropes[kind], k_cache)
                or not kernel_fits(h.dtype, k_cache.dtype, attn.head_dim, h.device)
            ):
                return None
            layers.append((weights, kind, c, attn.window))
            chunk_rows = MLP_CHUNK_BYTES // (layer.mlp.chunk_width * h.element_size())
            max_rows = min(max_rows, max(1, chunk_rows))
        mlps = tuple(layer.mlp for layer in self.layers)
        plans[key] = _KernelPlan(tuple(layers), max_rows, mlps)
        return plans[key]

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Gemma 4's per-layer inputs (T, layers, width): each token's rows of the second
        embedding table (times sqrt(width)) plus the normed projection of its scaled main
        embedding h (times hidden_size ** -0.5), over sqrt(2)."""
        cfg = self.config
        shape = (input_ids.shape[0], cfg.num_layers, cfg.per_layer_input_size)
        width = cfg.per_layer_input_size
        table = self.per_layer_embed(input_ids) * torch.tensor(width**0.5, dtype=h.dtype)
        projected = self.per_layer_model_proj(h) * cfg.hidden_size**-0.5
        projected = self.per_layer_proj_norm(projected.reshape(shape))
        return (projected + table.reshape(shape)) * 2**-0.5

    @property
    def device(self) -> torch.device:
        return next(itertools.chain(self.parameters(), self.buffers())).device

    def logits(
        self,
        hidden: torch.Tensor | None = None,
        *,
        products: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        argmax_only: bool = False,
    ) -> torch.Tensor:
        """Float32 logits (T, vocab) of final hidden states (T, hidden): the output head, then the
        division by `logits_scaling` and the soft cap where the model has them. The only way to
        make logits.

        products: the output head's products (`head_products`) in place of hidden states, for a
        caller that ran the head itself (the compiled decode graph does). out: a float32 buffer
        of at least T rows to write the logits into, instead of a new tensor. argmax_only: the
        caller only takes each row's argmax, so the head's products may come back as they are,
        in the model's dtype, when the model has no soft cap (a float32 copy of a large
        vocabulary's logits is a noticeable part of a decode step).
        """
        if products is None:
            products = self.head_products(hidden)
        cap = self.config.final_logit_softcap
        if argmax_only and cap is None:  # a positive logits_scaling keeps the argmax
            return products
        if out is None:
            logits = products.float()
        else:  # products that the head wrote into out (`head_products`) stay where they are
            logits = out[: products.shape[0]]
            if products.data_ptr() != logits.data_ptr():
                logits.copy_(products)
        if self.config.logits_scaling != 1.0:
            logits.div_(self.config.logits_scaling)
        if cap is not None:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def head_products(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output head's matmul (T, vocab), in the model's dtype: what `logits` finishes.
        out: a contiguous tensor of the model's dtype, at least T rows of the head's width, that
        the caller reuses from call to call; the products go into its first T rows where the
        head's kernel writes there (`QuantLinear.forward_into`), else into a new tensor."""
        if self.lm_head is not None:
            if out is not None and hasattr(self.lm_head, "forward_into"):  # QuantLinear
                return self.lm_head.forward_into(hidden, out[: hidden.shape[0]])
            return self.lm_head(hidden)
        if self.invariant_head:
            return invariant_linear(hidden, self.embed.weight)
        return F.linear(hidden, self.embed.weight)
