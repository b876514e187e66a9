"""The BERT encoder against transformers' BertModel: pooling modes, Normalize, `bert.` names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from tests.tiny_models import build_tiny_bert
from tokenmill.errors import ModelFileError
from tokenmill.model.encoder import is_encoder_dir, load_encoder

TEXTS = ["the quick brown fox", "a", "paris is the capital of france. one two three"]


def _reference(folder, pooling: str, normalize: bool) -> torch.Tensor:
    import transformers

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = transformers.BertModel.from_pretrained(folder).eval()
    rows = []
    with torch.no_grad():
        for text in TEXTS:
            hidden = model(torch.tensor([tok.encode(text).ids])).last_hidden_state[0]
            pooled = {"mean": hidden.mean(0), "cls": hidden[0], "lasttoken": hidden[-1]}
            rows.append(pooled[pooling])
    pooled = torch.stack(rows)
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@pytest.mark.parametrize(("pooling", "normalize"), [("cls", True), ("lasttoken", False)])
def test_pooling_modes_equal_transformers(tmp_path, pooling, normalize) -> None:
    folder = build_tiny_bert(tmp_path, pooling=pooling, normalize=normalize)
    assert is_encoder_dir(folder)
    encoder = load_encoder(folder)
    assert (encoder.config.pooling, encoder.config.normalize) == (pooling, normalize)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    got = encoder.embed([tok.encode(t).ids for t in TEXTS])
    assert (got - _reference(folder, pooling, normalize)).abs().max() <= 1e-5


def test_bert_prefixed_names_load_alike(tmp_path) -> None:
    folder = build_tiny_bert(tmp_path)
    plain = load_encoder(folder)
    weights = load_file(folder / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in weights.items()}, folder / "model.safetensors")
    prefixed = load_encoder(folder)
    ids = [[2, 10, 11, 3]]
    assert torch.equal(plain.embed(ids), prefixed.embed(ids))


def test_missing_tensor_is_named(tmp_path) -> None:
    folder = build_tiny_bert(tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["encoder.layer.1.output.dense.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelFileError, match=r"missing tensors: \['layers.1.mlp_out.weight'\]"):
        load_encoder(folder)
