"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token, and each expert that
a step's tokens picked runs once, over all of its tokens.

The step's (token, expert) pairs are sorted by expert, so each expert's gate/up and down
projections (packed or dense layers, built by the loader like any other) multiply the rows routed
to it in one call: the work grows with tokens x top_k, and an expert no token picked costs nothing.
The outputs go back to their (token, slot) places and are summed slot by slot in the router's
order, so a token's result depends on its own routing only, never on the rest of the batch (the
layers themselves compute each row alike whatever the batch: see `QuantLinear`, `DenseLinear`).

Checkpoints store experts one by one (HF) or stacked in one tensor per projection (GGUF's
`ffn_*_exps`, fused HF tensors); `expert_tensors` turns a stack into per-expert views of it, so a
GGUF stack stays in its packed format, each expert's rows a slice of the file's bytes. gpt-oss's HF
stacks are (experts, in, out) with gate and up in alternate columns: `deinterleave_hf_experts`
turns them into the (experts, out, in) stacks of gate rows then up rows that the others have.

gpt-oss's experts (`ClampedSwiGLU`) have biases and a clamped SwiGLU of their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
from torch import nn

from tokenmill.model.config import ModelConfig, MoESettings
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import step_rows_within

Weight = torch.Tensor | GGMLWeight


class MoE(nn.Module):
    """Router, routed experts and, where the family has one, a shared expert every token runs.

    make_mlp(width) builds one gated MLP of that intermediate width (the decoder's own MLP)."""

    def __init__(self, cfg: ModelConfig, make_mlp: Callable[[int], nn.Module]) -> None:
        super().__init__()
        moe = cfg.moe
        self.settings = moe
        self.router = nn.Linear(cfg.hidden_size, moe.num_experts, bias=moe.router_bias)
        if moe.swiglu_limit is not None:

            def make_mlp(width: int) -> nn.Module:
                return ClampedSwiGLU(cfg.hidden_size, width, moe.swiglu_limit, moe.swiglu_alpha)

        self.experts = nn.ModuleList(
            make_mlp(moe.intermediate_size) for _ in range(moe.num_experts)
        )
        shared = moe.shared_intermediate_size
        self.shared_expert = make_mlp(shared) if shared else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if moe.shared_gate else None
        # added to the scores to choose the experts (DeepSeek-V3), float32 as the scores
        self.score_bias = (
            nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
            if moe.score_bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.router(x), self.settings, self.score_bias)
        with step_rows_within(0, None):  # an expert's rows are the tokens routed to it
            out = run_experts(x, weights, experts, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out


class ClampedSwiGLU(nn.Module):
    """gpt-oss's expert: down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) with
    g = min(gate, limit), gate and up in one biased matmul (gate rows, then up rows), as
    transformers' `GptOssExperts` computes it; the loader replaces both layers."""

    def __init__(self, hidden: int, width: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width)
        self.down_proj = nn.Linear(width, hidden)
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


def route(
    logits: torch.Tensor, settings: MoESettings, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's expert weights (tokens, top_k) in float32 and expert ids (tokens, top_k),
    from the router's logits (tokens, experts), as the family scores them; score_bias: added to
    the scores to choose the experts, not to their weights."""
    logits = logits.float()
    if settings.scoring == "topk_softmax":
        top, experts = logits.topk(settings.top_k, dim=-1)
        weights = top.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if settings.scoring == "softmax" else logits.sigmoid()
        choice = scores if score_bias is None else scores + score_bias.float()
        if settings.topk_groups < settings.num_groups:
            choice = _best_groups_only(choice, settings)
        if choice is scores:
            weights, experts = scores.topk(settings.top_k, dim=-1)
        else:
            experts = choice.topk(settings.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
    if settings.norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if settings.routed_scale != 1.0:
        weights = weights * settings.routed_scale
    return weights, experts


def _best_groups_only(choice: torch.Tensor, settings: MoESettings) -> torch.Tensor:
    """The choice scores with every expert outside each token's `topk_groups` best groups at
    -inf: groups ranked by their best score, or by the sum of their best two for sigmoid scores
    (DeepSeek-V2's group_limited_greedy and V3's noaux_tc)."""
    groups = choice.view(choice.shape[0], settings.num_groups, -1)
    if settings.scoring == "sigmoid":
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = groups.amax(dim=-1)
    best = group_scores.topk(settings.topk_groups, dim=-1).indices
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return groups.masked_fill(~kept[:, :, None], float("-inf")).view_as(choice)


def run_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, layers: nn.ModuleList
) -> torch.Tensor:
    """sum over slots s of weights[t, s] * layers[experts[t, s]](x[t]), for every token t.

    Pairs are grouped by expert (a stable sort), each expert with tokens runs once over its
    gathered rows, and the products are summed per token in float32, slot by slot."""
    tokens, top_k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair p = token * top_k + slot, grouped by expert
    counts = torch.bincount(flat, minlength=len(layers))
    used = counts.nonzero().flatten()
    ends = counts[used].cumsum(0).tolist()
    rows = x.index_select(0, order // top_k)
    outputs = []
    start = 0
    for expert, end in zip(used.tolist(), ends):
        outputs.append(layers[expert](rows[start:end]))
        start = end
    by_pair = torch.empty((tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
    by_pair[order] = torch.cat(outputs)
    by_pair = by_pair.view(tokens, top_k, -1)
    out = by_pair[:, 0].float() * weights[:, :1]
    for slot in range(1, top_k):
        out += by_pair[:, slot].float() * weights[:, slot : slot + 1]
    return out.to(x.dtype)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of one MoE feed-forward, by our name under `mlp.`, with shapes."""
    moe, h = cfg.moe, cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"router.weight": (moe.num_experts, h)}
    if moe.router_bias:
        shapes["router.bias"] = (moe.num_experts,)
    for e in range(moe.num_experts):
        shapes |= _mlp_shapes(f"experts.{e}", h, moe.intermediate_size)
        if moe.expert_bias:
            width = moe.intermediate_size
            shapes |= {
                f"experts.{e}.gate_proj.bias": (width,),
                f"experts.{e}.up_proj.bias": (width,),
                f"experts.{e}.down_proj.bias": (h,),
            }
    if moe.shared_intermediate_size:
        shapes |= _mlp_shapes("shared_expert", h, moe.shared_intermediate_size)
    if moe.shared_gate:
        shapes["shared_gate.weight"] = (1, h)
    if moe.score_bias:
        shapes["score_bias"] = (moe.num_experts,)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


# a stack of every expert's projection: (experts, rows, cols), rows of gate and up in one for
# gate_up_proj
_STACKED = re.compile(
    r"(layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)\.(\w+)"
)


def expert_tensors(weights: Iterator[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with every stack of experts split into one tensor per expert (views
    of the stack: a GGUF stack's slices are its packed bytes); a shared expert's gate stored as a
    vector (GGUF) becomes its one-row matrix."""
    for name, tensor in weights:
        m = _STACKED.fullmatch(name)
        if m is None:
            if name.endswith("mlp.shared_gate.weight") and tensor.dim() == 1:
                tensor = tensor[None]
            yield name, tensor
            continue
        prefix, proj, kind = m.groups()
        count = tensor.shape[0]
        for e in range(count):
            part = _expert(tensor, e, count)
            if proj == "gate_up_proj":
                half = part.shape[0] // 2
                yield f"{prefix}.{e}.gate_proj.{kind}", _rows(part, 0, half)
                yield f"{prefix}.{e}.up_proj.{kind}", _rows(part, half, 2 * half)
            else:
                yield f"{prefix}.{e}.{proj}.{kind}", part


def deinterleave_hf_experts(
    weights: Iterator[tuple[str, Weight]],
) -> Iterator[tuple[str, Weight]]:
    """gpt-oss's HF stacks (`experts.gate_up_proj` (experts, hidden, 2 x width) with gate and up in
    alternate columns, its bias alike, `experts.down_proj` (experts, width, hidden)) as the
    (experts, rows, cols) stacks of gate rows then up rows that `expert_tensors` splits; the
    other tensors as they are."""
    for name, tensor in weights:
        m = _STACKED.fullmatch(name)
        if m is None:
            yield name, tensor
            continue
        proj, kind = m.group(2), m.group(3)
        if proj == "gate_up_proj":
            if kind == "weight":
                tensor = tensor.transpose(1, 2)
            tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        elif kind == "weight":
            tensor = tensor.transpose(1, 2)
        yield name, tensor.contiguous()


def _expert(stack: Weight, e: int, count: int) -> Weight:
    """Expert e's slice of a stack. A GGUF stack's file pages are let go of with its last
    expert's slice (the loader releases each weight once it has packed it, experts in order)."""
    if not isinstance(stack, GGMLWeight):
        return stack[e]
    rows = stack.shape[1]
    release = stack.release if e == count - 1 else None
    data = stack.data[e * rows : (e + 1) * rows]
    return GGMLWeight(data, stack.qtype, tuple(stack.shape[1:]), release)


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.data[start:stop], w.qtype, (stop - start, *w.shape[1:]), w.release)
    return w[start:stop]
