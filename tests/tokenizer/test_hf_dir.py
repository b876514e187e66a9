"""`Tokenizer.from_hf_dir` on folders written by transformers' `save_pretrained`, checked against
transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tokenmill.tokenizer import Tokenizer, TokenizerError

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, world.",
    "café naïve façade 日本語 🦙 emoji",
    "def f(x):\n    return x * 2\n",
] * 20
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = [
    "Hello world!",
    "  the lazy  fox\n",
    "日本語 🦙 café",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🦙"}]


def byte_level_bpe() -> Backend:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def save(folder: Path, backend: Backend, **config) -> Path:
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config).save_pretrained(folder)
    return folder


def assert_same_as_transformers(folder: Path) -> Tokenizer:
    ours = Tokenizer.from_hf_dir(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), (
            text
        )
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip
            )
    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours.vocab_size == len(theirs)
    return ours


def test_chatml_folder(tmp_path: Path) -> None:
    folder = save(
        tmp_path, byte_level_bpe(), bos_token="<s>", eos_token="<|im_end|>", chat_template=CHATML
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    ours = assert_same_as_transformers(folder)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (0, 3, False)
    assert ours.stop_token_ids == {1, 3}
    assert ours.encode("<|im_start|>", parse_special=False) != [2]


def test_bos_from_config_flag(tmp_path: Path) -> None:
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": CHATML,
        "add_bos_token": True,
    }
    folder = save(tmp_path, byte_level_bpe(), **config)
    assert assert_same_as_transformers(folder).encode("Hello")[0] == 0


def test_bos_from_post_processor(tmp_path: Path) -> None:
    backend = byte_level_bpe()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    folder = save(tmp_path, backend, bos_token="<s>", eos_token="</s>", chat_template=CHATML)
    assert assert_same_as_transformers(folder).add_bos


def test_chat_template_sources(tmp_path: Path) -> None:
    """Named templates in tokenizer_config.json (the "default" one is used); chat_template.jinja
    wins over them."""
    folder = save(tmp_path, byte_level_bpe(), bos_token="<s>", eos_token="</s>")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": CHATML},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert assert_same_as_transformers(folder).chat_template == CHATML
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{{ messages[0]['content'] | tojson }}"
    )
    ours = assert_same_as_transformers(folder)
    assert ours.apply_chat_template([{"role": "user", "content": "é<>"}]) == '<s>"é<>"'


def test_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
