"""The batched sampler against straightforward per-row numpy references, on fixed random logits."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tokenmill.model import kernels
from tokenmill.sample import Sampler, SamplingBatch, SamplingParams
from tokenmill.sample import sampler as sampler_module
from tokenmill.sample.sampler import process_logits, sampling_logits

V = 50
STOPS = frozenset({0, 7})
GEN = np.random.default_rng(0)
PROMPTS = [list(GEN.integers(0, V, size=n)) for n in (5, 1, 12, 3, 8, 6)]
OUTPUTS = [list(GEN.integers(0, V, size=n)) for n in (4, 0, 9, 2, 1, 6)]
LOGITS = torch.from_numpy(GEN.normal(0, 3, size=(6, V))).float()


@pytest.fixture(params=["kernel", "tensor ops"])
def random_path(request, monkeypatch) -> str:
    """Random rows sampled by tokenmill's CPU kernel (`sample_ids`), or by tensor ops where it is
    not loaded."""
    if request.param == "kernel":
        assert kernels.load(), "the CPU kernels did not build"
    else:
        monkeypatch.setattr(sampler_module.kernels, "loaded", lambda: False)
    return request.param


def build(params: list[SamplingParams], generators: list | None = None) -> SamplingBatch:
    rows = len(params)
    return SamplingBatch.build(
        params,
        [list(map(int, p)) for p in PROMPTS[:rows]],
        [list(map(int, o)) for o in OUTPUTS[:rows]],
        generators or [None] * rows,
        V,
        [STOPS] * rows,
    )


def ref_processed(
    x: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """min_tokens, then logit bias, then repetition, then frequency and presence penalties."""
    x = x.astype(np.float64)
    if len(output) < p.min_tokens:
        for t in STOPS:
            x[t] = -np.inf
    for t, bias in (p.logit_bias or {}).items():
        x[t] += bias
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, count in Counter(output).items():
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_distribution(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, then keep the top_k, then the smallest top set with mass >= top_p, then
    min_p."""
    probs = softmax(x / p.temperature)
    order = np.argsort(-probs)
    if p.top_k > 0:
        probs[order[p.top_k :]] = 0
        probs /= probs.sum()
    if p.top_p < 1:
        mass, kept = 0.0, np.zeros(len(x), dtype=bool)
        for t in order:
            kept[t] = True
            mass += probs[t]
            if mass >= p.top_p:
                break
        probs = np.where(kept, probs, 0)
        probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0)
        probs /= probs.sum()
    return probs


def check_processed(params: list[SamplingParams]) -> None:
    batch = build(params)
    got = process_logits(LOGITS, batch).numpy()
    for i, p in enumerate(params):
        want = ref_processed(LOGITS[i].numpy(), p, PROMPTS[i], OUTPUTS[i])
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=1e-5, atol=1e-5)


def check_distribution(params: list[SamplingParams]) -> None:
    batch = build(params)
    got = sampling_logits(process_logits(LOGITS, batch), batch).softmax(dim=-1).numpy()
    for i, p in enumerate(params):
        want = ref_distribution(ref_processed(LOGITS[i].numpy(), p, PROMPTS[i], OUTPUTS[i]), p)
        decided = (want == 0) | (want > 1e-30)  # float32 underflows to 0 below that
        np.testing.assert_array_equal(
            (got[i] > 0)[decided], (want > 0)[decided], err_msg=f"support of row {i}"
        )
        np.testing.assert_allclose(got[i], want, atol=1e-6)


S = SamplingParams
FEATURES = {
    "repetition_penalty": [
        S(repetition_penalty=1.3),
        S(),
        S(repetition_penalty=0.7),
        S(repetition_penalty=2.0),
        S(),
        S(repetition_penalty=1.1),
    ],
    "presence_penalty": [
        S(),
        S(presence_penalty=1.5),
        S(presence_penalty=-0.5),
        S(presence_penalty=2.0),
        S(),
        S(presence_penalty=0.3),
    ],
    "frequency_penalty": [
        S(frequency_penalty=0.5),
        S(),
        S(frequency_penalty=-1.0),
        S(),
        S(frequency_penalty=2.0),
        S(frequency_penalty=0.25),
    ],
    "logit_bias": [
        S(logit_bias={3: 5.0, 49: -100.0}),
        S(),
        S(logit_bias={0: 100.0}),
        S(logit_bias={}),
        S(logit_bias={3: -2.5}),
        S(),
    ],
    "min_tokens": [
        S(min_tokens=5),
        S(min_tokens=1),
        S(min_tokens=9),
        S(min_tokens=2),
        S(),
        S(min_tokens=100),
    ],
    "all_penalties_with_bias_and_min_tokens": [
        S(
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={4: 3.0},
            min_tokens=8,
        ),
        S(),
        S(repetition_penalty=0.9, frequency_penalty=-0.3),
        S(presence_penalty=1.0, logit_bias={7: 50.0}),
        S(min_tokens=1),
        S(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=1.0),
    ],
}


@pytest.mark.parametrize("feature", FEATURES)
def test_processed_logits_match_reference(feature: str) -> None:
    check_processed(FEATURES[feature])


FILTERS = {
    "top_k": [S(top_k=1), S(), S(top_k=5), S(top_k=-1), S(top_k=49), S(top_k=1000)],
    "top_p": [S(top_p=0.9), S(top_p=0.5), S(), S(top_p=0.05), S(top_p=0.99), S(top_p=1.0)],
    "min_p": [S(min_p=0.1), S(), S(min_p=0.5), S(min_p=1.0), S(min_p=0.01), S()],
    "temperature": [
        S(temperature=0.5),
        S(),
        S(temperature=2.0),
        S(temperature=0.1),
        S(),
        S(temperature=1.5),
    ],
    "combined": [
        S(temperature=0.7, top_k=10, top_p=0.8, min_p=0.05),
        S(top_k=3, top_p=0.5),
        S(temperature=1.3, top_p=0.9, min_p=0.2),
        S(),
        S(top_k=20, min_p=0.1, repetition_penalty=1.2),
        S(temperature=0.9, top_p=0.95, presence_penalty=1.0, logit_bias={5: 4.0}),
    ],
}


@pytest.mark.parametrize("feature", FILTERS)
# whole rows sorted; top candidates first (50 logits)
@pytest.mark.parametrize("candidates", [1024, 12, 2])
def test_sampling_distribution_matches_reference(
    feature: str, candidates: int, monkeypatch
) -> None:
    monkeypatch.setattr(sampler_module, "FILTER_CANDIDATES", candidates)
    check_distribution(FILTERS[feature])


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    params = [
        S(temperature=0),
        S(),
        S(temperature=0, repetition_penalty=1.5, min_tokens=3),
        S(top_k=2),
        S(temperature=0, logit_bias={9: 30.0}),
        S(temperature=0, presence_penalty=2.0),
    ]
    batch = build(params)
    out = Sampler()(LOGITS, batch)
    for i in (0, 2, 4, 5):
        want = ref_processed(LOGITS[i].numpy(), params[i], PROMPTS[i], OUTPUTS[i])
        assert out.token_ids[i] == int(np.argmax(want))
    assert out.token_ids[4] == 9
    assert (
        Sampler()(LOGITS, build([S(temperature=0)] * 6)).token_ids.tolist()
        == LOGITS.argmax(-1).tolist()
    )


def test_argmax_only_batches_keep_the_logits_dtype() -> None:
    half = LOGITS.to(torch.bfloat16)
    argmax = build([S(temperature=0)] * 6)
    assert argmax.argmax_only and process_logits(half, argmax) is half
    out = Sampler()(half, argmax)
    assert out.token_ids.tolist() == half.float().argmax(-1).tolist() and bool(out.usable.all())
    for params in (
        [S(temperature=0, logprobs=2)] * 6,
        [S(temperature=0, presence_penalty=1.0)] * 6,
        [S(temperature=0)] * 5 + [S()],
    ):
        batch = build(params)
        assert not batch.argmax_only and process_logits(half, batch).dtype == torch.float32


def test_min_tokens_keeps_stop_ids_from_being_picked() -> None:
    logits = LOGITS.clone()
    logits[:, 7] = 100.0  # a stop id every row would otherwise pick
    params = [
        S(temperature=0, min_tokens=5),
        S(temperature=0, min_tokens=1),
        S(min_tokens=10),
        S(temperature=0, min_tokens=2),
        S(temperature=0),
        S(min_tokens=7),
    ]
    # Output lengths are 4, 0, 9, 2, 1, 6: rows 0, 1, 2 and 5 are still short of min_tokens.
    assert [t == 7 for t in Sampler()(logits, build(params)).token_ids.tolist()] == [
        False,
        False,
        False,
        True,
        True,
        False,
    ]


def test_temperature_to_zero_approaches_argmax() -> None:
    params = [S(temperature=1e-4)] * 6
    batch = build(params)
    probs = sampling_logits(LOGITS, batch).softmax(dim=-1)
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(LOGITS.argmax(-1), V).float())
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    for _ in range(5):
        out = Sampler()(LOGITS, build(params, gens))
        assert out.token_ids.tolist() == LOGITS.argmax(-1).tolist()


def test_input_logits_are_not_modified() -> None:
    logits = LOGITS.clone()
    Sampler()(logits, build(FILTERS["combined"]))
    Sampler()(logits, build(FEATURES["all_penalties_with_bias_and_min_tokens"]))
    assert torch.equal(logits, LOGITS)


@pytest.mark.parametrize(
    "params",
    [
        S(temperature=0.6),
        S(top_k=3),
        S(top_p=0.8),
        S(temperature=0.7, top_k=6, top_p=0.9, min_p=0.1),
    ],
)
def test_empirical_frequencies_match_reference(params: SamplingParams, random_path: str) -> None:
    """Many rows with the same small-vocab logits: counts fit the filtered distribution
    (chi-square)."""
    vocab, n = 8, 20_000
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7]]).expand(n, vocab)
    batch = SamplingBatch.build(
        [params] * n, [[]] * n, [[]] * n, [None] * n, vocab, [frozenset()] * n
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = Sampler()(logits, batch).token_ids
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    want = ref_distribution(logits[0].numpy(), params)
    assert (counts[want == 0] == 0).all()
    expected = want[want > 0] * n
    chi2 = ((counts[want > 0] - expected) ** 2 / expected).sum()
    assert chi2 < 30, (counts, expected)  # df <= 7; 30 is past the 0.9999 quantile


@pytest.mark.parametrize("u, expected", [(0.0, 2), (1.0, 5)])
def test_draws_at_either_end_of_the_unit_interval_keep_to_tokens_of_positive_mass(
    monkeypatch, u: float, expected: int, random_path: str
) -> None:
    """Tokens 0-1 and 6-7 filtered out by top-k: u = 0 takes the first kept token, and u = 1 (a u
    just below 1 whose product with the row's mass rounds up to the mass itself) the last one."""
    logits = torch.tensor([[-5.0, -4.0, 3.0, 2.5, 2.0, 1.5, -3.0, -6.0]])
    batch = SamplingBatch.build([S(top_k=4)], [[]], [[]], [None], 8, [frozenset()])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, u))
    assert Sampler()(logits, batch).token_ids.tolist() == [expected]


def test_logprobs_come_from_processed_logits_before_temperature() -> None:
    params = [
        S(logprobs=3, temperature=0.5, repetition_penalty=1.3),
        S(),
        S(logprobs=0, top_k=4),
        S(logprobs=5, temperature=0, logit_bias={2: 10.0}),
        S(logprobs=1, top_p=0.7, frequency_penalty=1.0),
        S(logprobs=2, temperature=2.0),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    out = Sampler()(LOGITS, build(params, gens))
    assert out.top_ids.shape == out.top_logprobs.shape == (6, 5)
    for i, p in enumerate(params):
        x = ref_processed(LOGITS[i].numpy(), p, PROMPTS[i], OUTPUTS[i])
        logprobs = x - x.max() - np.log(np.exp(x - x.max()).sum())
        assert out.logprobs[i].item() == pytest.approx(logprobs[out.token_ids[i]], abs=1e-5)
        assert out.top_ids[i].tolist() == np.argsort(-logprobs)[:5].tolist()
        np.testing.assert_allclose(
            out.top_logprobs[i].numpy(), np.sort(logprobs)[::-1][:5], atol=1e-5
        )


def test_logprobs_absent_or_empty_when_not_asked() -> None:
    out = Sampler()(LOGITS, build([S()] * 6))
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    out = Sampler()(LOGITS, build([S(logprobs=0)] * 6))
    assert out.logprobs.shape == (6,) and out.top_ids.shape == (6, 0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])  # the greedy path and the random one
def test_rows_without_a_finite_highest_logit_are_unusable(temperature: float) -> None:
    """NaN, +inf or nothing but -inf: unusable; a row with some -inf (a masked token) is fine."""
    logits = LOGITS.clone()
    logits[0, 3] = float("nan")
    logits[1, 9] = float("inf")
    logits[2] = float("-inf")
    logits[3, :10] = float("-inf")
    out = Sampler()(logits, build([S(temperature=temperature)] * 6))
    assert out.usable.tolist() == [False, False, False, True, True, True]
    assert out.token_ids[3].item() >= 10  # never a masked token


@pytest.mark.parametrize("kernel", [True, False])
def test_allowed_tokens_ban_the_rest_of_their_rows_only(kernel: bool, monkeypatch) -> None:
    if not kernel:
        monkeypatch.setattr(sampler_module.kernels, "loaded", lambda: False)
    elif not kernels.loaded():
        # where they should build and did not, test_kernels_build_and_load fails
        pytest.skip("tokenmill's C++ kernels do not build on this CPU; the tensor path is tested")
    vocab, words = 100, 4  # the last word's bits past the vocabulary are ignored
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=generator)
    bits[1, 1] = 0
    bits[1, 2] = -1
    params = [SamplingParams(temperature=0.0)] * 3
    batch = SamplingBatch.build(params, [[1]] * 3, [[]] * 3, [None] * 3, vocab, [frozenset()] * 3)
    batch.allowed_rows = torch.tensor([0, 2])
    batch.allowed_bits = bits
    logits = torch.randn(3, vocab, generator=generator)
    out = process_logits(logits, batch)
    allowed = [[(int(bits[i, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for i in (0, 1)]
    for i, row in ((0, 0), (1, 2)):
        for t in range(vocab):
            expected = logits[row, t] if allowed[i][t] else float("-inf")
            assert out[row, t] == expected
    assert torch.equal(out[1], logits[1])  # a free row
    assert batch.needs_processing and not batch.argmax_only
