"""The `tokenmill` commands on a tiny model: tokenize, generate, perplexity, --help."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import transformers

from tokenmill.cli.main import COMMANDS, main
from tokenmill.llm import LLM
from tokenmill.sample import SamplingParams
from tokenmill.tokenizer import Tokenizer

TEXT = "Paris is the capital of France; Berlin is the capital of Germany. Café 東京 🙂"


@pytest.mark.parametrize("command", sorted(set(COMMANDS)))
def test_help(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: tokenmill" in capsys.readouterr().out


def test_tokenize_prints_ids_on_one_line(tiny_model_dir, tmp_path, capsys) -> None:
    expected = Tokenizer.from_hf_dir(tiny_model_dir).encode(TEXT)
    assert main(["tokenize", "--model", str(tiny_model_dir), TEXT]) == 0
    assert capsys.readouterr().out == " ".join(map(str, expected)) + "\n"
    text_file = tmp_path / "in.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    assert main(["tokenize", "--model", str(tiny_model_dir), "--file", str(text_file)]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in expected]


def test_tokenize_needs_exactly_one_text(tiny_model_dir, capsys) -> None:
    assert main(["tokenize", "--model", str(tiny_model_dir)]) == 1
    assert "either as an argument or with --file" in capsys.readouterr().err


def test_generate_prints_the_greedy_continuation(tiny_model_dir, capsys) -> None:
    expected = (
        LLM(str(tiny_model_dir))
        .generate(
            ["Once upon a time"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    capsys.readouterr()
    assert (
        main(["generate", "--model", str(tiny_model_dir), "--max-tokens", "12", "Once upon a time"])
        == 0
    )
    assert capsys.readouterr().out == expected + "\n"


def test_generate_rejects_bad_options(tiny_model_dir, capsys) -> None:
    assert main(["generate", "--model", str(tiny_model_dir), "--max-tokens", "0", "hi"]) == 1
    assert "max_tokens" in capsys.readouterr().err


def test_generate_follows_a_choice_a_regex_or_a_json_schema(
    tiny_model_dir, tmp_path, capsys
) -> None:
    base = ["generate", "--model", str(tiny_model_dir), "--max-tokens", "40", "Hello"]
    assert main([*base, "--choice", "red", "--choice", "blue"]) == 0
    assert capsys.readouterr().out in ("red\n", "blue\n")
    assert main([*base, "--regex", "[0-9]{2}-[a-c]"]) == 0
    assert re.fullmatch(r"[0-9]{2}-[a-c]\n", capsys.readouterr().out)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    assert main([*base, "--json-schema", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["a"] in range(10)
    assert main([*base, "--regex", "[a-"]) == 1
    assert "structured_outputs.regex" in capsys.readouterr().err


@pytest.mark.parametrize("decode", [False, True])
def test_perplexity_matches_a_reference_computation(
    tiny_model_dir, tmp_path, capsys, decode: bool
) -> None:
    text = " ".join(f"{TEXT} {i}" for i in range(40))
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    ctx = 64
    assert (
        main(
            ["perplexity", "--model", str(tiny_model_dir), "--file", str(path), "--ctx", str(ctx)]
            + ["--dtype", "fp32"]  # as the float32 reference below
            + ["--decode"] * decode
        )
        == 0
    )
    printed = capsys.readouterr().out
    ours = float(printed.split("PPL = ")[1].split()[0])

    # llama-perplexity's recipe, computed independently with transformers
    ids = Tokenizer.from_hf_dir(tiny_model_dir).encode(text, parse_special=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32
    ).eval()
    nll, count = 0.0, 0
    for c in range(len(ids) // ctx):
        chunk = torch.tensor([ids[c * ctx : (c + 1) * ctx]])
        with torch.no_grad():
            logprobs = hf(chunk).logits[0].log_softmax(-1)
        for pos in range(ctx // 2, ctx - 1):
            nll -= float(logprobs[pos, chunk[0, pos + 1]])
            count += 1
    assert ours == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_serve_data_parallel_without_ray_says_what_to_install(
    tiny_model_dir, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["serve", str(tiny_model_dir), "--data-parallel-size", "2"]) == 1
    assert "pip install 'tokenmill[ray]'" in capsys.readouterr().err


def test_serve_pd_disaggregation_needs_two_replicas(tiny_model_dir, capsys) -> None:
    assert main(["serve", str(tiny_model_dir), "--pd-disaggregation"]) == 1
    assert "--data-parallel-size 2 or more" in capsys.readouterr().err


def test_serve_refuses_a_tenant_limit_without_the_fair_policy(tiny_model_dir, capsys) -> None:
    args = ["serve", str(tiny_model_dir), "--max-running-per-tenant", "2", "--port", "0"]
    assert main(args) == 1
    assert "--scheduling-policy fair" in capsys.readouterr().err


def test_serve_names_one_model_per_served_model_name(tiny_model_dir, capsys) -> None:
    argv = ["serve", str(tiny_model_dir), str(tiny_model_dir), "--served-model-name", "x"]
    assert main(argv) == 1
    assert "--served-model-name names one MODEL" in capsys.readouterr().err


def test_serve_refuses_a_model_beyond_the_memory_budget(tiny_model_dir, capsys) -> None:
    argv = ["serve", str(tiny_model_dir), "--memory-budget", "1MiB", "--kv-cache-memory", "0.01"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "does not fit" in err and "the memory budget is 1.0 MiB" in err


def test_the_start_path_imports_no_torch_dynamo() -> None:
    # TorchDynamo takes a large share of a start's time to import, so the commands, the engine
    # and the server import it only where graphs are compiled or loaded (a fresh interpreter:
    # this one has imported it for other tests)
    script = (
        "import sys, tokenmill, tokenmill.cli.main, tokenmill.engine.llm_engine, "
        "tokenmill.server.app; tokenmill.cli.main.build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_a_command_imports_no_other_commands_module() -> None:
    # `serve` parses its arguments without importing `bench` and its HTTP client (a fresh
    # interpreter: this one has imported every command for other tests)
    script = (
        "import sys, tokenmill.cli.main as m; m.build_parser('serve').parse_args(['serve']); "
        "print(sorted(n for n in sys.modules if n in ('aiohttp', 'tokenmill.cli.bench')))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
    everything = subprocess.run(
        [sys.executable, "-c", script.replace("build_parser('serve')", "build_parser()")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert everything.stdout.strip() == "['aiohttp', 'tokenmill.cli.bench']"


def test_an_eager_request_imports_no_torch_dynamo(tiny_model_dir) -> None:
    # Nor does an eager step: importing TorchDynamo there would hold up a server's first request
    # by over a second (the rotary tables' op imported it on its first call)
    script = (
        "import sys; from tokenmill import LLM, SamplingParams; "
        f"llm = LLM({str(tiny_model_dir)!r}, compile=False); "
        "out = llm.generate(['hello world'], SamplingParams(max_tokens=4, temperature=0), "
        "use_tqdm=False); assert out[0].outputs[0].token_ids; "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.strip().splitlines()[-1] == "[]"
