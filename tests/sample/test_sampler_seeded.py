"""A seeded request yields the same tokens alone or in any row of any batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.sample import Sampler, SamplingBatch, SamplingParams
from tokenmill.sample.sampler import request_generator

V = 64
STEPS = 6
S = SamplingParams


@dataclass
class Request:
    """A stand-in for the engine's per-request state; `stream` names its fixed per-step logits."""

    stream: int
    params: SamplingParams
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.generator = request_generator(self.params)

    def logits(self, step: int) -> torch.Tensor:
        return (
            torch.randn(V, generator=torch.Generator().manual_seed(1000 * self.stream + step)) * 2
        )


def run(requests: list[Request], global_seed: int) -> list[list[int]]:
    """Decode STEPS tokens for every request together; the global RNG is seeded differently per
    run."""
    sampler = Sampler()
    with torch.random.fork_rng():
        torch.manual_seed(global_seed)
        for step in range(STEPS):
            batch = SamplingBatch.build(
                [r.params for r in requests],
                [[1, 2, 3]] * len(requests),
                [r.output for r in requests],
                [r.generator for r in requests],
                V,
                [frozenset({0})] * len(requests),
            )
            logits = torch.stack([r.logits(step) for r in requests])
            for r, token in zip(requests, sampler(logits, batch).token_ids.tolist()):
                r.output.append(token)
    return [r.output for r in requests]


FILTERED = S(seed=1234, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1)
PLAIN = S(seed=99, temperature=1.0)


def others() -> list[Request]:
    return [
        Request(10, S(seed=5)),
        Request(11, S()),
        Request(12, S(temperature=0)),
        Request(13, S(top_k=3, min_p=0.2)),
        Request(14, S(seed=6, top_p=0.5)),
        Request(15, S(temperature=2.0)),
        Request(16, S(presence_penalty=1.0, logprobs=2)),
    ]


def test_filtered_seeded_request_is_batch_and_row_independent() -> None:
    alone = run([Request(7, FILTERED)], global_seed=0)[0]
    batch = others()
    batch.insert(3, Request(7, FILTERED))
    assert run(batch, global_seed=1)[3] == alone
    twins = [
        Request(20, S(temperature=0)),
        Request(7, FILTERED),
        Request(21, S()),
        Request(7, FILTERED),
    ]
    got = run(twins, global_seed=2)
    assert got[1] == got[3] == alone


def test_plain_seeded_request_is_unaffected_by_other_rows_filters() -> None:
    """Other rows' top-k/top-p send the whole batch through the sort path; this row must not
    notice."""
    alone = run([Request(8, PLAIN)], global_seed=0)[0]
    batch = others()
    batch.insert(3, Request(8, PLAIN))
    assert run(batch, global_seed=3)[3] == alone
    assert run([Request(8, PLAIN), Request(31, S(top_k=2, seed=1))], global_seed=5)[0] == alone


def test_different_seeds_give_different_sequences() -> None:
    first = run([Request(7, S(seed=1))], global_seed=0)[0]
    second = run([Request(7, S(seed=2))], global_seed=0)[0]
    assert first != second
    assert run([Request(7, S(seed=1))], global_seed=9)[0] == first
