"""Structured outputs in the engine: outputs follow their constraint, streamed or not, greedy or
sampled; free requests beside them are untouched; bad constraints are refused up front."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import llguidance
import pytest

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.structured_output import GrammarCompiler
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams, StructuredOutputs

# Every string and number bounded: sampled at temperature 1, an unbounded one may outlast max_tokens
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            },
            "level": {"enum": ["low", "mid", "high"]},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["tags", "level", "score"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "note": {"type": ["string", "null"], "maxLength": 20},
        },
        "required": ["a", "note"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> LLMEngine:
    return LLMEngine(smollm2_gguf, compile=False, num_kv_blocks=512)


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenize(messages=[{"role": "user", "content": text}])


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_give_valid_json(engine, temperature: float) -> None:
    prompt = _prompt(engine, "Describe a person as JSON.")
    requests = {
        f"s{i}": (
            prompt,
            SamplingParams(
                max_tokens=120,
                temperature=temperature,
                seed=i,
                structured_outputs=StructuredOutputs(json=schema),
            ),
        )
        for i, schema in enumerate(SCHEMAS)
    }
    done = _run(engine, requests)
    for i, schema in enumerate(SCHEMAS):
        out = done[f"s{i}"].outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_gbnf_grammar_hold(engine) -> None:
    prompt = _prompt(engine, "Answer briefly.")
    specs = {
        "regex": StructuredOutputs(regex=r"[A-Z][a-z]{2,8}, [0-9]{4}"),
        "choice": StructuredOutputs(choice=["red", "green", "blue"]),
        # bounded: an unbounded repetition may outlast max_tokens with a small model
        "gbnf": StructuredOutputs(
            grammar='root ::= "(" word (" " word)? ")"\nword ::= [a-z] [a-z]? [a-z]? [a-z]? [a-z]?'
        ),
        "lark": StructuredOutputs(grammar='start: "<" /[0-9]{1,4}/ ">"'),
    }
    done = _run(
        engine,
        {
            k: (prompt, SamplingParams(max_tokens=40, structured_outputs=v))
            for k, v in specs.items()
        },
    )
    texts = {k: done[k].outputs[0].text for k in specs}
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{4}", texts["regex"]), texts
    assert texts["choice"] in ("red", "green", "blue")
    assert re.fullmatch(r"\([a-z]{1,5}( [a-z]{1,5})?\)", texts["gbnf"]), texts
    assert re.fullmatch(r"<[0-9]{1,4}>", texts["lark"]), texts


def test_free_requests_are_untouched_by_constrained_neighbours(engine) -> None:
    """32 requests at once, 16 free and 16 under 16 different schemas: the free ones' greedy
    outputs are those of the free ones run alone."""
    prompts = [_prompt(engine, f"Tell me about the number {i}.") for i in range(16)]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = _run(engine, {f"f{i}": (p, free) for i, p in enumerate(prompts)})
    mixed = {f"f{i}": (p, free) for i, p in enumerate(prompts)}
    for i, prompt in enumerate(prompts):
        field = {"type": "integer", "minimum": -i, "maximum": 10 * i + 9}
        schema = {
            "type": "object",
            "properties": {f"number_{i}": field, "about": SCHEMAS[i % 2]},  # no $defs
            "required": [f"number_{i}", "about"],
            "additionalProperties": False,
        }
        spec = StructuredOutputs(json=schema)
        mixed[f"c{i}"] = (prompt, SamplingParams(max_tokens=40, structured_outputs=spec))
    together = _run(engine, mixed)
    for i in range(16):
        assert together[f"f{i}"].outputs[0].token_ids == alone[f"f{i}"].outputs[0].token_ids


def test_each_of_n_sequences_keeps_its_own_matcher(engine) -> None:
    params = SamplingParams(
        n=3,
        max_tokens=80,
        temperature=1.0,
        seed=7,
        structured_outputs=StructuredOutputs(json=SCHEMAS[1]),
    )
    done = _run(engine, {"n": (_prompt(engine, "Some JSON please."), params)})
    outputs = done["n"].outputs
    assert len(outputs) == 3
    for out in outputs:
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])


@pytest.mark.parametrize(
    "spec, problem",
    [
        (StructuredOutputs(json={"type": "objectx"}), "structured_outputs.json"),
        (StructuredOutputs(json="{not json"), "structured_outputs.json"),
        (StructuredOutputs(regex="[a-"), "structured_outputs.regex"),
        (StructuredOutputs(grammar="root ::= ("), "structured_outputs.grammar"),
        (StructuredOutputs(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutputs(choice=[]), "non-empty"),
    ],
)
def test_bad_constraints_are_refused_and_the_engine_keeps_serving(
    engine, spec: StructuredOutputs, problem: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(problem)):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    done = _run(engine, {"ok": ([1, 2, 3], SamplingParams(max_tokens=4))})
    assert done["ok"].outputs[0].finish_reason == "length"


def test_empty_schema_and_json_object_give_json(engine) -> None:
    prompt = _prompt(engine, "Reply in JSON.")
    specs = {"any": StructuredOutputs(json={}), "object": StructuredOutputs(json_object=True)}
    requests = {
        k: (prompt, SamplingParams(max_tokens=200, structured_outputs=v)) for k, v in specs.items()
    }
    done = _run(engine, requests)
    for key in specs:
        out = done[key].outputs[0]
        if out.finish_reason == "stop":
            json.loads(out.text)
        else:  # cut at max_tokens: a prefix of JSON, never anything else
            assert out.text.lstrip()[:1] in '{["-0123456789tfn'
    assert done["object"].outputs[0].text.lstrip().startswith("{")


def test_a_matcher_in_error_fails_its_request_with_the_reason(engine) -> None:
    spec = StructuredOutputs(choice=["yes", "no"])
    prompt = _prompt(engine, "Yes or no?")
    engine.add_request("broken", prompt, SamplingParams(max_tokens=8, structured_outputs=spec))
    engine.add_request("fine", prompt, SamplingParams(max_tokens=8, structured_outputs=spec))
    matcher = engine._requests["broken"].sequences[0].matcher
    matcher.consume_token(engine.tokenizer.encode("zzz", add_bos=False)[0])  # not in the grammar
    assert matcher.is_error()
    done = _run(engine, {})
    assert done["broken"].outputs[0].finish_reason == "error"
    assert "the output constraint cannot go on" in done["broken"].error
    assert done["broken"].error_is_input and not done["fine"].error_is_input
    assert done["fine"].outputs[0].text in ("yes", "no")


@pytest.fixture(scope="module")
def thinking_engine(tmp_path_factory) -> LLMEngine:
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-thinking"), added_tokens=["<think>", "</think>"]
    )
    return LLMEngine(path, num_kv_blocks=128, max_model_len=256)


@pytest.mark.parametrize("opened", [True, False], ids=["prompt-opened", "output-opens"])
def test_the_constraint_starts_after_the_reasoning(thinking_engine, opened: bool) -> None:
    engine, tokenizer = thinking_engine, thinking_engine.tokenizer
    think, end = tokenizer.added_token_id("<think>"), tokenizer.added_token_id("</think>")
    spec = StructuredOutputs(
        choice=["yes", "no"], reasoning_markers=("<think>", "</think>"), reasoning_opened=opened
    )
    # </think> likely after some reasoning; unopened, <think> likely as the first token
    bias = {end: 5.0} if opened else {think: 8.0, end: 5.0}
    prompt = tokenizer.encode("Paris is the capital of", add_bos=False)
    requests = {
        f"r{seed}": (
            prompt,
            SamplingParams(seed=seed, max_tokens=48, logit_bias=bias, structured_outputs=spec),
        )
        for seed in range(8)
    }
    reasoned = 0
    for out in _run(engine, requests).values():
        ids = out.outputs[0].token_ids
        assert end in ids, "the reasoning always ends, biased as it is"
        if not opened:
            assert ids[0] == think
        at = ids.index(end)
        assert think not in ids[1:at] and end not in ids[at + 1 :]
        reasoned += at > (0 if opened else 1)
        answer = tokenizer.decode(ids[at + 1 :], skip_special_tokens=True)
        assert answer in ("yes", "no"), "the constraint holds from the end of the reasoning"
    assert reasoned >= 4, "the reasoning itself runs free of the constraint"


def test_without_reasoning_the_constraint_holds_from_the_start(thinking_engine) -> None:
    tokenizer = thinking_engine.tokenizer
    spec = StructuredOutputs(choice=["yes", "no"], reasoning_markers=("<think>", "</think>"))
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)
    prompt = tokenizer.encode("Paris is the capital of", add_bos=False)
    (out,) = _run(thinking_engine, {"r": (prompt, params)}).values()
    assert out.outputs[0].text in ("yes", "no")


def _accepts(engine: LLMEngine, spec: StructuredOutputs, text: str) -> bool:
    matcher = engine.input_processor.grammars.matcher(spec)
    ids = engine.tokenizer.encode(text, add_bos=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_a_structural_tag_constrains_what_follows_its_trigger(engine) -> None:
    tag = {
        "structures": [
            {
                "begin": "<function=add>",
                "schema": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
                "end": "</function>",
            }
        ],
        "triggers": ["<function="],
    }
    spec = StructuredOutputs(structural_tag=tag)
    assert _accepts(engine, spec, "Sure, let me add them.")
    assert _accepts(engine, spec, 'Adding: <function=add>{"a":1,"b":2}</function> done')
    assert not _accepts(engine, spec, "Adding: <function=mul>")
    assert not _accepts(engine, spec, 'Adding: <function=add>{"a":"x"}')
    with pytest.raises(InvalidRequestError, match="no trigger"):
        engine.input_processor.grammars.matcher(
            StructuredOutputs(structural_tag={**tag, "triggers": ["<tool>"]})
        )


def test_llguidance_tokenizer_is_built_by_the_first_constrained_request(
    engine, monkeypatch
) -> None:
    """Building llguidance's tokenizer holds the GIL throughout, long for a large vocabulary:
    done at start, it stalled the first requests of every server, constrained or not. A compiler
    builds it when a constrained request first needs it, once."""
    built = []
    real = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: built.append(1) or real(*a, **k))
    before = set(threading.enumerate())
    compiler = GrammarCompiler(engine.tokenizer, engine.loaded.config.vocab_size)
    for thread in set(threading.enumerate()) - before:  # whatever the compiler started at once
        thread.join(timeout=60)
    assert built == []
    compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    compiler.matcher(StructuredOutputs(regex="[0-9]+"))
    assert built == [1]
