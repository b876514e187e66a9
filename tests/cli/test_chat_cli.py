"""`tokenmill chat` on the tiny model, driven through stdin as a user would type."""

from __future__ import annotations

import io
import json
import re
import shutil
import signal

import pytest

from tokenmill.cli.main import main
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.sample import SamplingParams

SYSTEM = {"role": "system", "content": "You are a tiny test model."}
FIRST = "Tell me about Paris and Berlin, the capitals of France and Germany."
SECOND = "And the quick brown fox?"
GREEDY = ["--temperature", "0", "--max-tokens", "12"]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def chat(model_dir, monkeypatch, capsys, lines: list[str], *options: str) -> tuple[int, str, str]:
    """Run `tokenmill chat` with `lines` as what the user types; returns exit code, stdout,
    stderr."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code = main(["chat", "--model", str(model_dir), *options])
    out, err = capsys.readouterr()
    return code, out, err


def record_prompts(monkeypatch) -> list[list[int]]:
    """Prompt ids of every request sent to an engine from now on."""
    seen: list[list[int]] = []
    add_request = LLMEngine.add_request

    def record(self, request_id, prompt, params=None, **kwargs):
        seen.append(list(prompt))
        return add_request(self, request_id, prompt, params, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", record)
    return seen


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir))


def greedy_reply(llm: LLM, messages: list[dict[str, str]], max_tokens: int = 12) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def encode(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_bos=False)


def test_replies_match_the_offline_engine_across_turns(
    tiny_model_dir, offline, tmp_path, monkeypatch, capsys
) -> None:
    first = [SYSTEM, user(FIRST)]
    reply1 = greedy_reply(offline, first)
    second = first + [assistant(reply1), user(SECOND)]
    reply2 = greedy_reply(offline, second)
    assert reply1 and reply2
    prompts = record_prompts(monkeypatch)
    saved = tmp_path / "history.json"

    code, out, _ = chat(
        tiny_model_dir,
        monkeypatch,
        capsys,
        [FIRST, SECOND, "/stats", f"/save {saved}", "/clear", FIRST, "/bye"],
        "--system",
        SYSTEM["content"],
        *GREEDY,
    )

    assert code == 0
    assert "/help for commands" in out.splitlines()[0]
    assert f">>> {reply1}\n\n>>> {reply2}\n\n>>> prompt:" in out
    assert f"conversation cleared\n>>> {reply1}\n\n>>> " in out
    # the second prompt carries the first reply; /clear starts over from the system prompt
    assert prompts == [encode(offline, first), encode(offline, second), encode(offline, first)]
    assert json.loads(saved.read_text(encoding="utf-8")) == second + [assistant(reply2)]
    stats = re.search(r"prompt: +(\d+) tokens \((\d+) cached\)", out)
    # the first turn's KV blocks were reused
    assert int(stats[1]) == len(prompts[1]) and int(stats[2]) > 0
    assert re.search(r"context: +\d+ of \d+ tokens", out)


def test_ctrl_c_stops_the_reply_and_keeps_the_partial_text(
    tiny_model_dir, offline, tmp_path, monkeypatch, capsys
) -> None:
    full = greedy_reply(offline, [user(FIRST)])
    steps = 0
    step = LLMEngine.step

    def step_then_ctrl_c(self):
        nonlocal steps
        steps += 1
        if steps == 4:
            signal.raise_signal(signal.SIGINT)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", step_then_ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    saved = tmp_path / "history.json"

    code, out, err = chat(
        tiny_model_dir, monkeypatch, capsys, [FIRST, SECOND, f"/save {saved}"], *GREEDY
    )

    assert code == 0  # end of input
    assert "(stopped)" in err
    assert signal.getsignal(signal.SIGINT) is handler
    history = json.loads(saved.read_text(encoding="utf-8"))
    partial = history[1]["content"]
    assert partial and len(partial) < len(full) and full.startswith(partial)
    assert f">>> {partial}\n\n>>> " in out
    # the chat went on
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]


def test_old_turns_are_dropped_when_the_context_is_full(
    tiny_model_dir, offline, tmp_path, monkeypatch, capsys
) -> None:
    reply1 = greedy_reply(offline, [SYSTEM, user(FIRST)])
    assert len(encode(offline, [SYSTEM, user(FIRST), assistant(reply1), user(SECOND)])) > 128 - 12
    prompts = record_prompts(monkeypatch)
    saved = tmp_path / "history.json"

    code, out, err = chat(
        tiny_model_dir,
        monkeypatch,
        capsys,
        [FIRST, SECOND, "word " * 200, f"/save {saved}"],
        "--system",
        SYSTEM["content"],
        "--ctx",
        "128",
        *GREEDY,
    )

    assert code == 0
    assert "dropped the 1 oldest turn to fit the context of 128 tokens" in err
    assert prompts[1] == encode(offline, [SYSTEM, user(SECOND)])
    assert "error: this message needs" in err and len(prompts) == 2  # too long even alone: not sent
    history = json.loads(saved.read_text(encoding="utf-8"))
    assert history[:2] == [SYSTEM, user(SECOND)] and len(history) == 3


def test_multi_line_input_and_commands(tiny_model_dir, tmp_path, monkeypatch, capsys) -> None:
    saved = tmp_path / "history.json"
    code, out, err = chat(
        tiny_model_dir,
        monkeypatch,
        capsys,
        [
            '"""',
            "block a",
            "block b",
            '"""',
            "line one \\",
            "line two",
            "/system Be brief.",
            "/system",
            "/set temperature 0.5",
            "/set temperature hot",
            "/set max_tokens 99999",
            "/set colour blue",
            "/nope",
            "/help",
            f"/save {saved}",
            "/bye",
            "never read",
        ],
        "--max-tokens",
        "2",
    )

    assert code == 0
    history = json.loads(saved.read_text(encoding="utf-8"))
    assert history[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in history if m["role"] == "user"] == [
        "block a\nblock b",
        "line one \nline two",
    ]
    assert ">>> Be brief.\n" in out and "temperature = 0.5" in out and "/save FILE" in out
    assert "error: temperature needs a number, got 'hot'" in err
    assert "error: max_tokens must be below the context" in err
    assert "error: /set takes one of" in err and "error: unknown command /nope" in err


def test_a_model_without_chat_template_is_refused(tiny_model_dir, tmp_path, capsys) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "no-template")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["chat", "--model", str(model)]) == 1
    assert "has no chat template" in capsys.readouterr().err


def test_a_failed_reply_is_reported_and_the_chat_goes_on(
    tiny_model_dir, monkeypatch, capsys
) -> None:
    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr("tokenmill.engine.model_runner.ModelRunner._forward", broken_forward)
    code, out, err = chat(tiny_model_dir, monkeypatch, capsys, [FIRST, "/stats"], *GREEDY)
    assert code == 0
    assert "error: internal error while running the model: RuntimeError('device lost')" in err
    assert "prompt:" in out
