"""Batched token sampling on tensors: one step for B rows, each with its own SamplingParams.

Order (as vLLM v1): min_tokens masking, logit bias and penalties change the raw logits
("processed logits"); logprobs and greedy picks come from those; random rows then divide by their
temperature, apply top-k, top-p and min-p, and sample by inverse CDF (one uniform draw per row) so
that rows with a seed draw from their own generator and give the same tokens whatever batch
they are in.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from tokenmill.model import kernels
from tokenmill.sample.params import SamplingParams

Index = tuple[torch.Tensor, torch.Tensor]


@dataclass
class SamplingBatch:
    """Per-step tensors for the B rows being sampled.

    An optional field is None when no row uses that feature, so the common case (plain greedy or
    plain temperature sampling) does no work for it. Rows with a feature off hold a neutral value
    (top_k = vocab size, top_p = 1, penalty 1 or 0, ...).
    """

    greedy: torch.Tensor  # (B,) bool
    temperature: torch.Tensor  # (B,) float32, 1.0 on greedy rows so dividing by it is harmless
    top_k: torch.Tensor | None  # (B,) int64 in [1, V]
    top_p: torch.Tensor | None  # (B,) float32
    min_p: torch.Tensor | None  # (B,) float32
    repetition_penalty: torch.Tensor | None  # (B,) float32
    presence_penalty: torch.Tensor | None  # (B,) float32
    frequency_penalty: torch.Tensor | None  # (B,) float32
    # (B, V) bool: token occurs in the prompt (repetition penalty only)
    prompt_mask: torch.Tensor | None
    output_counts: torch.Tensor | None  # (B, V) float32: occurrences in the output so far
    bias_index: Index | None  # (rows, token ids) of logit_bias entries
    bias_values: torch.Tensor | None  # float32 biases matching bias_index
    # (rows, token ids) to mask while the output is shorter than min_tokens
    min_tokens_index: Index | None
    seeded_rows: list[int]  # random rows that draw from their own generator
    generators: list[torch.Generator]  # one per seeded row
    any_unseeded_random: bool  # whether the batched draw is needed
    all_greedy: bool  # plain Python flags, so branching on them needs no device sync
    all_random: bool
    max_num_logprobs: int | None  # largest `logprobs` requested in the batch, None if none
    # rows whose tokens are constrained (int64) and, per row, the tokens they may take as a bitmask
    # (int32 words, bit b of word w allowing token 32 w + b; tokens past its words are banned)
    allowed_rows: torch.Tensor | None = None
    allowed_bits: torch.Tensor | None = None

    @property
    def needs_processing(self) -> bool:
        """Whether `process_logits` changes any logit (allowed tokens, min_tokens, logit bias,
        penalties)."""
        return (
            self.allowed_rows is not None
            or self.min_tokens_index is not None
            or self.bias_index is not None
            or self.output_counts is not None
        )

    @property
    def argmax_only(self) -> bool:
        """Whether the batch takes each row's highest logit as it is: the logits' dtype may then
        stay the model's (an argmax needs no float32 copy)."""
        return self.all_greedy and self.max_num_logprobs is None and not self.needs_processing

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        stop_ids_for_min_tokens: list[frozenset[int]],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Gather the rows' parameters into tensors on `device`.

        generators[i] is the request's own generator (seeded once, kept across steps) or None;
        stop_ids_for_min_tokens[i] are the ids (EOS, stop_token_ids) banned until row i has
        min_tokens output tokens.
        """
        lengths = {
            len(params),
            len(prompt_ids),
            len(output_ids),
            len(generators),
            len(stop_ids_for_min_tokens),
        }
        if len(lengths) != 1:
            raise ValueError("SamplingBatch.build needs one entry per row in every list")

        def column(
            values: list[float], neutral: float, dtype: torch.dtype = torch.float32
        ) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        repetition = column([p.repetition_penalty for p in params], 1.0)
        presence = column([p.presence_penalty for p in params], 0.0)
        frequency = column([p.frequency_penalty for p in params], 0.0)
        needs_counts = repetition is not None or presence is not None or frequency is not None

        bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        banned = [
            (i, t)
            for i, (p, out, stops) in enumerate(zip(params, output_ids, stop_ids_for_min_tokens))
            if len(out) < p.min_tokens
            for t in sorted(stops)
        ]
        random_rows = [
            (i, g) for i, (g, is_greedy) in enumerate(zip(generators, greedy)) if not is_greedy
        ]
        seeded = [(i, g) for i, g in random_rows if g is not None]
        requested = [p.logprobs for p in params if p.logprobs is not None]

        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                dtype=torch.float32,
                device=device,
            ),
            top_k=column(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                vocab_size,
                torch.int64,
            ),
            top_p=column([p.top_p for p in params], 1.0),
            min_p=column([p.min_p for p in params], 0.0),
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_mask=_token_counts(prompt_ids, vocab_size, device) > 0
            if repetition is not None
            else None,
            output_counts=_token_counts(output_ids, vocab_size, device).float()
            if needs_counts
            else None,
            bias_index=_index([(i, t) for i, t, _ in bias], device) if bias else None,
            bias_values=torch.tensor([b for *_, b in bias], dtype=torch.float32, device=device)
            if bias
            else None,
            min_tokens_index=_index(banned, device) if banned else None,
            seeded_rows=[i for i, _ in seeded],
            generators=[g for _, g in seeded],
            any_unseeded_random=len(seeded) < len(random_rows),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            max_num_logprobs=max(requested) if requested else None,
        )


def request_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator a seeded request keeps for its whole life (None when it has no seed)."""
    if params.seed is None:
        return None
    # torch wants unsigned
    return torch.Generator(device=device).manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)


def _token_counts(
    ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """(B, V) int64 occurrence counts, from one bincount over row-offset flat ids."""
    lengths = torch.tensor([len(r) for r in ids], device=device)
    flat = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(
        torch.arange(len(ids), device=device), lengths, output_size=len(flat)
    )
    counts = torch.bincount(rows * vocab_size + flat, minlength=len(ids) * vocab_size)
    return counts.view(len(ids), vocab_size)


def _index(pairs: list[tuple[int, int]], device: torch.device | str) -> Index:
    rows, cols = torch.tensor(pairs, dtype=torch.int64, device=device).unbind(1)
    return rows, cols


@dataclass
class SamplerOutput:
    """Sampled ids and, when any row asked, logprobs.

    Logprobs are log_softmax of the processed logits: after bias, min_tokens masking and penalties
    but before temperature, top-k, top-p and min-p (vLLM's "processed_logprobs"), so they describe
    the model's adjusted distribution rather than the truncated one sampled from.
    """

    token_ids: torch.Tensor  # (B,) int64
    # (B,) bool: whether the row's highest processed logit is finite, i.e. it has no NaN or +inf and
    # not only -inf; a request whose row is not must fail (its token means nothing)
    usable: torch.Tensor
    logprobs: torch.Tensor | None  # (B,) logprob of the sampled token
    top_ids: torch.Tensor | None  # (B, k) int64, k = max requested logprobs in the batch
    top_logprobs: torch.Tensor | None  # (B, k)

    def select(self, rows: torch.Tensor) -> SamplerOutput:
        """These rows only, in this order."""
        picked = (self.token_ids, self.usable, self.logprobs, self.top_ids, self.top_logprobs)
        return SamplerOutput(*(None if t is None else t[rows] for t in picked))


class Sampler:
    """Pick one token per row from (B, V) logits; the input tensor is never modified."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = process_logits(logits, batch)
        if batch.all_greedy:
            token_ids = greedy_ids(logits)
            # greedy takes each row's highest logit (NaN counts as highest): no second pass over
            # the logits, costly with a large vocabulary, to find the unusable rows
            highest = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        else:
            highest = logits.amax(dim=-1)
            token_ids = _random_ids(logits, batch)
            if not batch.all_random:
                token_ids = torch.where(batch.greedy, greedy_ids(logits), token_ids)
        usable = torch.isfinite(highest)
        if batch.max_num_logprobs is None:
            return SamplerOutput(token_ids, usable, None, None, None)
        logprobs = logits.log_softmax(dim=-1)
        top_logprobs, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)
        sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids, usable, sampled, top_ids, top_logprobs)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The first highest logit of each row, as argmax gives it. On CPU tokenmill's vectorized kernel
    where it is built; else max's indices, faster than PyTorch's CPU argmax (scalar code for
    bf16)."""
    if (
        logits.device.type == "cpu"
        and logits.dim() == 2
        and logits.dtype in (torch.float32, torch.bfloat16)
        and kernels.loaded()
    ):
        return kernels.ops().greedy_ids(logits)
    return logits.max(dim=-1).indices


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Apply min_tokens masking, logit bias and penalties: what greedy picks and logprobs see. As
    float32, but for a batch that only takes argmaxes (`SamplingBatch.argmax_only`)."""
    if batch.argmax_only:
        return logits
    needs_work = batch.needs_processing
    logits = logits.to(torch.float32, copy=needs_work)  # one copy, then edit it in place
    if batch.allowed_rows is not None:
        _ban_disallowed(logits, batch.allowed_rows, batch.allowed_bits)
    if batch.min_tokens_index is not None:
        logits[batch.min_tokens_index] = float("-inf")
    if batch.bias_index is not None:
        logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        penalty = torch.where(seen, batch.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.frequency_penalty is not None:
        logits -= batch.frequency_penalty.unsqueeze(1) * batch.output_counts
    if batch.presence_penalty is not None:
        logits -= batch.presence_penalty.unsqueeze(1) * (batch.output_counts > 0)
    return logits


_BITS = torch.arange(32, dtype=torch.int32)


def _ban_disallowed(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """Set to -inf, in place, each constrained row's logits of tokens its bitmask leaves out: on
    CPU tokenmill's kernel where it is built, else by expanding the bits to the vocabulary."""
    if logits.device.type == "cpu" and logits.is_contiguous() and kernels.loaded():
        kernels.ops().ban_disallowed_(logits, rows, bits)
        return
    vocab = logits.shape[1]
    allowed = ((bits.unsqueeze(-1) >> _BITS.to(bits.device)) & 1).view(bits.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(allowed[:, :vocab] == 0, float("-inf"))


def sampling_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Divide by temperature and set to -inf what top-k, top-p and min-p exclude.

    top-p is taken over the top-k-renormalized distribution (as HF and vLLM); min-p compares each
    probability with the row's maximum, which the other filters keep, so it does not depend on
    their order. It is applied in logit space: p_i >= min_p * p_max <=> x_i >= x_max + log(min_p).
    """
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        floor = logits.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


# Tokens that top-k and top-p consider first, the highest of each row: sorting a whole vocabulary
# for every row costs far more than a top-k of these few. A row whose top-p cut is not decided
# within them (a flat distribution) takes the full sort; more candidates make that rarer but cost
# more.
FILTER_CANDIDATES = 1024


def _top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Both filters, each row's on its highest FILTER_CANDIDATES logits where they decide it
    (exactly: a top-k within them, or a top-p cut within their mass), else on one ascending sort of
    the whole row; rows without an effective filter keep their logits."""
    rows, vocab = logits.shape
    no_rows = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    limited = top_k < vocab if top_k is not None else no_rows
    nucleus = top_p < 1 if top_p is not None else no_rows
    count = max([FILTER_CANDIDATES] + ([int(top_k[limited].max())] if bool(limited.any()) else []))
    if count >= vocab:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    values, order = logits.topk(count, dim=-1)  # descending
    if top_k is not None:
        values = values.masked_fill(
            torch.arange(count, device=logits.device) >= top_k.unsqueeze(1), float("-inf")
        )
    covered = limited
    if top_p is not None:
        # mass above each candidate, over the top-k set where a row has one, else the whole row
        total = torch.where(limited, values.logsumexp(dim=-1), logits.logsumexp(dim=-1)).unsqueeze(
            1
        )
        mass = (values - total).exp()
        above = mass.cumsum(dim=-1) - mass
        values = values.masked_fill(above >= top_p.unsqueeze(1), float("-inf"))
        # the cut within the candidates
        covered = limited | (nucleus & (above[:, -1] + mass[:, -1] >= top_p))
    out = torch.where(
        covered.unsqueeze(1),
        torch.full_like(logits, float("-inf")).scatter_(1, order, values),
        logits,
    )
    rest = (limited | nucleus) & ~covered
    if bool(rest.any()):
        out = torch.where(rest.unsqueeze(1), _sorted_top_k_top_p(logits, top_k, top_p), out)
    return out


def _sorted_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Both filters on one ascending sort of each whole row, then scattered back to vocabulary
    order."""
    ordered, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_largest = ordered.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        ordered = ordered.masked_fill(ordered < kth_largest, float("-inf"))
    if top_p is not None:
        # Drop a token when the mass at or below it is within 1 - top_p: what remains is the
        # smallest top set whose mass reaches top_p. The most likely token always stays.
        mass_up_to = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = mass_up_to <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(ordered).scatter_(1, order, ordered)


def _random_ids(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sample token i with probability p_i (the temperature-scaled, filtered softmax): the first
    token whose cumulative mass exceeds u x the row's total, u ~ U[0, 1), one draw per row.

    One uniform per row, where an exponential race (argmax p_i / E_i) would draw one exponential
    per vocabulary entry. On CPU tokenmill's kernel (`sample_ids`) does it in three passes over each
    row, and where no filter applies also spares the division, the softmax and the cumsum their
    vocabulary-sized tensors.
    A seeded row draws its u from its own generator, so its token depends only on its own logits and
    generator state. Tokens of zero probability are never picked: the mass strictly exceeds u x
    total only past a positive one.
    """
    u = (
        torch.rand(logits.shape[0], device=logits.device)
        if batch.any_unseeded_random
        else torch.empty(logits.shape[0], device=logits.device)
    )
    for row, generator in zip(batch.seeded_rows, batch.generators):
        u[row] = torch.rand(1, generator=generator, device=logits.device)
    if logits.device.type == "cpu" and logits.dim() == 2 and kernels.loaded():
        if batch.top_k is None and batch.top_p is None and batch.min_p is None:
            # the kernel divides
            x, inverse_temperature = logits, batch.temperature.reciprocal()
        else:
            x, inverse_temperature = sampling_logits(logits, batch), torch.ones_like(u)
        return kernels.ops().sample_ids(x, inverse_temperature, u)
    cdf = sampling_logits(logits, batch).softmax(dim=-1).cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # u x total may round up to the total itself: then the row's last token of positive mass
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(ids, last).squeeze(1)
