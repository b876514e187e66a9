"""Speculative decoding by prompt lookup: greedy outputs equal plain decoding's, batched and
alone, on the tiny and the real model, with and without output constraints; sampling keeps the
target's distribution, constrained or not (and a wrong acceptance rule is caught by the same
test); no KV block leaks through aborts and preemptions."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import jsonschema
import pytest
import torch
from scipy.stats import chi2_contingency

import tokenmill.engine.llm_engine as llm_engine
from tests.engine_runs import final_outputs
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.speculative import SpeculativeConfig, propose_ngram
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams, StructuredOutputs

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
REPETITIVE = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Paris is the capital of France; Berlin is the capital of",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Numbers: 0 1 2",
    "Once upon a time there was a small engine. Once upon a time",
    "Café, naïve, 東京, 🙂. Café, naïve,",
    "a b a b a b a b",
    "The capital of France is",
]


def test_propose_ngram_copies_what_followed_the_latest_longest_match() -> None:
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, n_min=1, n_max=3) == [3, 4, 1]
    assert propose_ngram([1, 2, 9, 5, 2, 7, 5, 2], k=2, n_min=1, n_max=3) == [7, 5]
    assert propose_ngram([5, 1, 2, 8, 1, 2], k=5, n_min=2, n_max=2) == [8, 1, 2]
    assert propose_ngram([1, 2, 3], k=3, n_min=1, n_max=3) == []
    assert propose_ngram([7, 7], k=0, n_min=1, n_max=3) == []


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("{not json", "not JSON"),
        ('{"method": "eagle"}', "unknown speculative method"),
        ('{"method": "draft_model"}', "goes with a"),
        ('{"method": "ngram", "model": "x"}', "goes with a"),
        ('{"model": "x", "draft_vocab_size": 0}', "draft_vocab_size must be at least 1"),
        ('{"method": "ngram", "lookahead": 3}', "unknown speculative config key"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"num_speculative_tokens": 0}', "at least 1"),
    ],
)
def test_bad_configs_say_what_is_wrong(config: str, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        SpeculativeConfig.parse(config)


def _run(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in final_outputs(engine, [(p, params) for p in prompts])]


def _engines(model, **options) -> tuple[LLMEngine, LLMEngine]:
    common = dict(num_kv_blocks=512, max_model_len=512, compile=False, **options)
    return LLMEngine(model, **common), LLMEngine(model, speculative_config=NGRAM, **common)


def test_greedy_equals_plain_decoding_on_the_tiny_model(tiny_loaded) -> None:
    plain, spec = _engines(tiny_loaded, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _run(plain, REPETITIVE, params)
    assert _run(spec, REPETITIVE, params) == expected
    for prompt, tokens in zip(REPETITIVE, expected):
        assert _run(spec, [prompt], params) == [tokens]
    assert spec.stats.spec_num_accepted_tokens > 0, "the tiny model repeats itself: drafts hit"
    assert spec.stats.spec_num_accepted_tokens < spec.stats.spec_num_draft_tokens


class RepeatDrafter:
    """Drafts the last token again, k times, every step."""

    def __init__(self, k: int = 1) -> None:
        self.num_speculative_tokens = k

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        return token_ids[-1:] * min(self.num_speculative_tokens, limit)


def test_a_sequence_whose_drafts_miss_pauses_its_drafting(tiny_loaded, monkeypatch) -> None:
    """Verifications that accept nothing pause a sequence's drafting 1, 2, 4, ... steps (up to
    SPECULATION_MAX_PAUSE): 60 tokens take 7 verifications (pauses of 1, 2, 4, 8, 16 and 16
    steps between them), where without pauses 58 steps verify."""
    plain, spec = _engines(tiny_loaded, max_num_seqs=8)
    monkeypatch.setattr(llm_engine, "accepted_drafts", lambda drafts, sampled: 0)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = REPETITIVE[:1]
    expected = _run(plain, prompts, params)
    spec.speculative = RepeatDrafter()
    assert _run(spec, prompts, params) == expected
    assert spec.stats.spec_num_drafts == 7
    monkeypatch.setattr(llm_engine, "SPECULATION_MAX_PAUSE", 0)
    spec.speculative = RepeatDrafter()
    assert _run(spec, prompts, params) == expected
    # every step after the prompt's, but the last (a token left: no room for a draft)
    assert spec.stats.spec_num_drafts == 7 + 58


def test_greedy_equals_plain_decoding_on_smollm2(smollm2_gguf) -> None:
    # 64 prompts, eight at a time (speculation stands down in larger batches), and alone
    prompts = [f"{p} ({i})" if i >= len(REPETITIVE) else p for i, p in enumerate(REPETITIVE * 8)]
    plain, spec = _engines(smollm2_gguf, max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = _run(plain, prompts, params)
    assert _run(spec, prompts, params) == expected
    for prompt, tokens in list(zip(prompts, expected))[:8]:
        assert _run(spec, [prompt], params) == [tokens]
    assert spec.stats.spec_num_accepted_tokens > 0


LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 3,
            "maxItems": 4,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_greedy_outputs_equal_plain_decodings(smollm2_gguf, method: str) -> None:
    """Drafts of constrained requests are checked against the grammar: each draft row samples
    under the mask its drafts before it leave, so outputs equal plain decoding's and follow the
    constraint, while drafts are still accepted."""
    config = NGRAM if method == "ngram" else {"model": str(smollm2_gguf)}
    common = dict(num_kv_blocks=512, max_model_len=512, max_num_seqs=8, compile=False)
    plain = LLMEngine(smollm2_gguf, **common)
    spec = LLMEngine(smollm2_gguf, speculative_config=config, **common)
    schema = SamplingParams(
        temperature=0, max_tokens=100, structured_outputs=StructuredOutputs(json=LIST_SCHEMA)
    )
    regex = SamplingParams(
        temperature=0,
        max_tokens=40,
        structured_outputs=StructuredOutputs(regex="(ab|cd)( (ab|cd)){7}"),
    )
    prompts = [
        plain.tokenize(messages=[{"role": "user", "content": f"List {topic} as JSON."}])
        for topic in ("three fruits", "the days of the week", "four colours", "some numbers")
    ]
    expected = _run(plain, prompts, schema)
    assert _run(spec, prompts, schema) == expected
    assert _run(spec, prompts[:1], schema) == expected[:1]
    for tokens in expected:
        jsonschema.validate(
            json.loads(plain.tokenizer.decode(tokens, skip_special_tokens=True)), LIST_SCHEMA
        )
    outputs = _run(spec, REPETITIVE[:4], regex)
    assert outputs == _run(plain, REPETITIVE[:4], regex)
    assert all(
        re.fullmatch("(ab|cd)( (ab|cd)){7}", plain.tokenizer.decode(t, skip_special_tokens=True))
        for t in outputs
    )
    assert spec.stats.spec_num_accepted_tokens > 0


SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)


def _samples(engine: LLMEngine, prompt: list[int], samples: int) -> Counter:
    counts: Counter = Counter()
    for start in range(0, samples, 64):
        for out in _run(engine, [prompt] * min(64, samples - start), SAMPLING):
            counts[tuple(out)] += 1
    return counts


class ModeDrafter:
    """Drafts, after each output prefix, the tokens that most often followed it in a pilot run:
    deterministic drafts that the target accepts often, but not always."""

    def __init__(self, pilot: Counter, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.next: dict[tuple, Counter] = {}
        for sample, count in pilot.items():
            for i in range(len(sample)):
                self.next.setdefault(sample[:i], Counter())[sample[i]] += count

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        prefix, drafts = tuple(token_ids[self.prompt_len :]), []
        while len(drafts) < limit and prefix in self.next:
            drafts.append(self.next[prefix].most_common(1)[0][0])
            prefix += (drafts[-1],)
        return drafts


def _chi_square_p(a: Counter, b: Counter) -> float:
    cells = sorted(set(a) | set(b))
    return chi2_contingency([[a[c] for c in cells], [b[c] for c in cells]])[1]


@pytest.fixture()
def speculating_batches(monkeypatch):
    """Speculation in batches of up to 64, so thousands of samples take seconds."""
    monkeypatch.setattr(llm_engine, "SPECULATION_MAX_BATCH", 64)


def test_sampling_keeps_the_target_distribution(tiny_loaded, speculating_batches, monkeypatch):
    """The joint distribution of the first four tokens (top-k 3: at most 81 outcomes), from
    4000 samples each, cannot be told from plain sampling's; accepting every draft can."""
    torch.manual_seed(0)  # the unseeded draws: the test's outcome is fixed
    plain, spec = _engines(tiny_loaded, max_num_seqs=64)
    prompt = plain.tokenizer.encode("The quick brown fox", add_bos=False)
    spec.speculative = ModeDrafter(_samples(plain, prompt, 1000), len(prompt))
    samples = 4000
    plain_counts = _samples(plain, prompt, samples)
    spec_counts = _samples(spec, prompt, samples)
    stats = spec.stats
    assert 0.2 < stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens < 0.9
    assert _chi_square_p(plain_counts, spec_counts) > 0.001

    monkeypatch.setattr(llm_engine, "accepted_drafts", lambda drafts, sampled: len(drafts))
    wrong_counts = _samples(spec, prompt, samples)
    assert _chi_square_p(plain_counts, wrong_counts) < 1e-6


def test_constrained_sampling_keeps_the_target_distribution(tiny_loaded, speculating_batches):
    """As above under a constraint: every draft row samples under its own mask. Masking only
    the first row of each sequence's step lets the other rows sample refused tokens (the
    outputs then break the constraint, and their distribution differs)."""
    torch.manual_seed(0)
    plain, spec = _engines(tiny_loaded, max_num_seqs=64)
    pattern = "[a-e]{4,12}"
    params = SamplingParams(
        temperature=1.0,
        top_k=3,
        max_tokens=4,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(regex=pattern),
    )
    prompt = plain.tokenizer.encode("The quick brown fox", add_bos=False)

    def samples(engine: LLMEngine, count: int) -> Counter:
        counts: Counter = Counter()
        for start in range(0, count, 64):
            for out in _run(engine, [prompt] * min(64, count - start), params):
                counts[tuple(out)] += 1
        return counts

    spec.speculative = ModeDrafter(samples(plain, 1000), len(prompt))
    plain_counts, spec_counts = samples(plain, 4000), samples(spec, 4000)
    assert spec.stats.spec_num_accepted_tokens > 0
    assert _chi_square_p(plain_counts, spec_counts) > 0.001
    for outcome in spec_counts:
        assert re.fullmatch(
            "[a-e]*", plain.tokenizer.decode(list(outcome), skip_special_tokens=True)
        )


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory) -> str:
    """Another tiny model with the same tokenizer: its drafts are sometimes right."""
    from tests.tiny_models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=1))


@pytest.mark.parametrize("draft", ["itself", "another"])
@pytest.mark.parametrize("min_confidence", [0.0, 0.2])
def test_a_draft_model_gives_plain_decodings_greedy_outputs(
    tiny_model_dir, tiny_draft_dir, draft: str, min_confidence: float, monkeypatch
) -> None:
    """The target as its own draft: every draft is accepted, which holds only if the draft
    model's KV follows each sequence exactly; another model: drafts are rejected. The tiny
    drafts' confidence is mostly 0.1-0.5: with a minimum of 0.2 sequences of a step stop
    drafting at different drafts."""
    monkeypatch.setattr(llm_engine, "DRAFT_MIN_CONFIDENCE", min_confidence)
    path = str(tiny_model_dir) if draft == "itself" else tiny_draft_dir
    # the target loaded as the draft is (in the default dtype), for the same numerics
    plain = LLMEngine(str(tiny_model_dir), num_kv_blocks=512, max_model_len=512, max_num_seqs=8)
    spec = LLMEngine(
        str(tiny_model_dir),
        num_kv_blocks=512,
        max_model_len=512,
        max_num_seqs=8,
        speculative_config={"model": path, "num_speculative_tokens": 3},
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _run(plain, REPETITIVE, params)
    assert _run(spec, REPETITIVE, params) == expected
    assert _run(spec, REPETITIVE[:1], params) == expected[:1]
    stats = spec.stats
    if draft == "itself":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    else:
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


@pytest.mark.parametrize("method", ["ngram", "draft model"])
def test_after_one_accepted_draft_only_prompt_lookup_drafts_fewer(
    tiny_model_dir, tiny_draft_dir, method: str, monkeypatch
) -> None:
    """Every verification accepts one draft: prompt lookup then proposes at most two, a draft
    model (sure of its drafts) its K (3) again."""
    monkeypatch.setattr(llm_engine, "accepted_drafts", lambda drafts, sampled: min(1, len(drafts)))
    monkeypatch.setattr(llm_engine, "DRAFT_MIN_CONFIDENCE", 0.0)
    config = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "draft model":
        config = {"model": tiny_draft_dir, "num_speculative_tokens": 3}
    engine = LLMEngine(
        str(tiny_model_dir), num_kv_blocks=512, max_model_len=512, speculative_config=config
    )
    if method == "ngram":
        engine.speculative = RepeatDrafter(3)
    _run(engine, REPETITIVE[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    drafts, verifications = engine.stats.spec_num_draft_tokens, engine.stats.spec_num_drafts
    assert verifications > 10
    if method == "draft model":  # 3 each, but the last, short of room
        assert drafts >= 3 * (verifications - 1) + 1
    else:  # 3 the first time, then 2 each
        assert drafts <= 3 + 2 * (verifications - 1)


@pytest.mark.parametrize("min_confidence", [0.0, 1.0])
def test_a_draft_model_drafts_no_further_after_an_unsure_draft(
    tiny_model_dir, tiny_draft_dir, min_confidence: float, monkeypatch
) -> None:
    """A draft model sure of nothing drafts one token a step; sure of everything, its K (3)."""
    monkeypatch.setattr(llm_engine, "DRAFT_MIN_CONFIDENCE", min_confidence)
    config = {"model": tiny_draft_dir, "num_speculative_tokens": 3}
    engine = LLMEngine(
        str(tiny_model_dir), num_kv_blocks=512, max_model_len=512, speculative_config=config
    )
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _run(engine, REPETITIVE[:2], params)
    drafts, verifications = engine.stats.spec_num_draft_tokens, engine.stats.spec_num_drafts
    assert verifications > 10
    if min_confidence == 1.0:
        assert drafts == verifications
    else:
        assert drafts > 2 * verifications


def test_a_draft_model_with_a_reduced_vocabulary_drafts_from_it_only(
    tiny_model_dir, monkeypatch
) -> None:
    """The target as its own draft, its head cut to the first 48 ids and the special tokens:
    drafts come from those ids, the target's tokens past them are drafts rejected, and the
    outputs stay plain decoding's."""
    monkeypatch.setattr(llm_engine, "DRAFT_MIN_CONFIDENCE", 0.0)
    common = dict(num_kv_blocks=512, max_model_len=512, max_num_seqs=8)
    plain = LLMEngine(str(tiny_model_dir), **common)
    config = {"model": str(tiny_model_dir), "num_speculative_tokens": 3, "draft_vocab_size": 48}
    spec = LLMEngine(str(tiny_model_dir), speculative_config=config, **common)
    tokenizer = spec.tokenizer
    specials = set(tokenizer.stop_token_ids) | set(tokenizer.added_token_ids())
    vocab = list(range(48)) + sorted(i for i in specials if i >= 48)
    assert spec.draft_vocab.tolist() == vocab
    assert spec.drafter.model.lm_head.out_features == len(vocab)
    drafted: list[int] = []
    draft_ids = spec._draft_ids

    def recording(logits):
        ids, confident = draft_ids(logits)
        drafted.extend(ids)
        return ids, confident

    monkeypatch.setattr(spec, "_draft_ids", recording)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _run(plain, REPETITIVE, params)
    assert _run(spec, REPETITIVE, params) == expected
    assert drafted and set(drafted) <= set(vocab)
    outside = sum(t not in set(vocab) for out in expected for t in out)
    assert outside > 0  # some of the target's tokens cannot be drafted ...
    stats = spec.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # ... and are missed


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_loaded, smollm2_gguf) -> None:
    with pytest.raises(InvalidRequestError, match="does not share the target's vocabulary"):
        LLMEngine(tiny_loaded, num_kv_blocks=64, speculative_config={"model": str(smollm2_gguf)})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_blocks_leak_through_aborts_and_preemptions(
    tiny_loaded, tiny_draft_dir, speculating_batches, method: str, monkeypatch
) -> None:
    # a pool too small for every sequence at once: the scheduler preempts and recomputes; the
    # draft model's sequences stop drafting at different drafts
    monkeypatch.setattr(llm_engine, "DRAFT_MIN_CONFIDENCE", 0.2)
    config = NGRAM if method == "ngram" else {"model": tiny_draft_dir}
    engine = LLMEngine(
        tiny_loaded, num_kv_blocks=24, max_model_len=256, compile=False, speculative_config=config
    )
    rng = random.Random(0)
    params = SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, seed=1)
    for i in range(16):
        engine.add_request(str(i), REPETITIVE[i % len(REPETITIVE)] * 2, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps % 7 == 0 and rng.random() < 0.5:
            engine.abort_request(str(rng.randrange(16)))
    assert engine.scheduler.num_preemptions > 0 and engine.stats.spec_num_draft_tokens > 0
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_the_server_and_tokenmill_bench_report_drafts_and_acceptances(
    tiny_loaded, tmp_path, capsys
) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server.conftest import RunningServer
    from tokenmill.cli.main import main
    from tokenmill.server.app import ServerConfig

    engine = LLMEngine(tiny_loaded, num_kv_blocks=128, max_model_len=256, speculative_config=NGRAM)
    server = RunningServer(engine, ServerConfig("tiny"))
    result = tmp_path / "bench.json"
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            body = {"prompt": REPETITIVE[0], "max_tokens": 32, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
            metrics = {
                sample.name: sample.value
                for family in text_string_to_metric_families(http.get("/metrics").text)
                for sample in family.samples
            }
        stats = engine.stats
        before = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens, stats.spec_num_drafts
        bench = ["bench", "--base-url", server.url, "--num-prompts", "4", "--warmup", "0"]
        code = main([*bench, "--output-len", "32", "--ignore-eos", "--result-json", str(result)])
    finally:
        server.stop()
    drafts = metrics["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert drafts == before[0] > 0
    assert accepted == before[1]
    assert metrics["tokenmill:spec_decode_num_drafts_total"] == before[2]
    # the bench reads the counters before and after its run
    out = capsys.readouterr().out
    assert code == 0 and "Speculative Decoding" in out and "Acceptance length" in out, out
    report = json.loads(result.read_text())
    assert report["spec_decode_num_draft_tokens"] == engine.stats.spec_num_draft_tokens - before[0]
    assert report["spec_decode_num_accepted_tokens"] == (
        engine.stats.spec_num_accepted_tokens - before[1]
    )
    assert 0 <= report["spec_decode_acceptance_rate"] <= 100


def test_qwen_coder_05b_drafting_for_15b_gives_its_greedy_outputs(
    qwen_coder_05b_gguf, qwen_coder_15b_gguf
) -> None:
    # 64 prompts, eight at a time (speculation stands down in larger batches), and alone
    target = qwen_coder_15b_gguf
    common = dict(num_kv_blocks=512, max_model_len=1024, max_num_seqs=8, compile=False)
    plain = LLMEngine(target, **common)
    spec = LLMEngine(
        target,
        speculative_config={"model": str(qwen_coder_05b_gguf), "num_speculative_tokens": 6},
        **common,
    )
    questions = [f"{p} ({i})" if i >= len(REPETITIVE) else p for i, p in enumerate(REPETITIVE * 8)]
    # a short system message in place of the template's default one: a fifth fewer prompt tokens
    system = {"role": "system", "content": "You are a coding assistant."}
    prompts = [
        plain.tokenize(messages=[system, {"role": "user", "content": f"{q} Answer briefly."}])
        for q in questions
    ]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = _run(plain, prompts, params)
    assert _run(spec, prompts, params) == expected
    for prompt, tokens in list(zip(prompts, expected))[:8]:
        assert _run(spec, [prompt], params) == [tokens]
    stats = spec.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
