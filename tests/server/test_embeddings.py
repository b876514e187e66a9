"""/v1/embeddings over HTTP: all-MiniLM-L6-v2 against sentence-transformers, a tiny random BERT
against transformers' BertModel, and the errors in OpenAI's shape."""

from __future__ import annotations

import base64
import random

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.server.conftest import API_KEY, RunningServer
from tests.tiny_models import BERT_WORDS, build_tiny_bert
from tokenmill.engine.embedding import EmbeddingEngine
from tokenmill.server.app import ServerConfig

MINILM = "all-minilm-l6-v2"
TINY_BERT = "tiny-bert"


def _texts(count: int, max_words: int, seed: int) -> list[str]:
    """`count` texts of 1 to `max_words` common words, with some punctuation."""
    rng = random.Random(seed)
    lengths = [1 + (max_words - 1) * i // (count - 1) for i in range(count)]
    rng.shuffle(lengths)
    texts = []
    for n in lengths:
        words = [rng.choice(BERT_WORDS) for _ in range(n)]
        texts.append(" ".join(w + ("." if k % 11 == 10 else "") for k, w in enumerate(words)))
    return texts


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _http(server: RunningServer) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
    )


# ---------------------------------------------------------------- all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def minilm_server(minilm_dir, one_torch_thread):
    running = RunningServer(EmbeddingEngine(minilm_dir), ServerConfig(MINILM, api_key=API_KEY))
    yield running
    running.stop()


def test_minilm_equals_sentence_transformers(minilm_server, minilm_dir) -> None:
    from sentence_transformers import SentenceTransformer

    texts = _texts(64, 200, seed=1)
    client = _client(minilm_server)
    floats = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    encoded = client.embeddings.create(model=MINILM, input=texts, encoding_format="base64")
    expected = torch.from_numpy(SentenceTransformer(str(minilm_dir), device="cpu").encode(texts))
    assert [d.index for d in floats.data] == list(range(64))
    got = torch.tensor([d.embedding for d in floats.data])
    assert got.shape == (64, 384)
    cosine = torch.nn.functional.cosine_similarity(got, expected)
    assert cosine.min() >= 0.9999, cosine
    # base64: the same float32 vectors, little-endian
    decoded = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in encoded.data]
    assert torch.equal(torch.from_numpy(np.stack(decoded)), got)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 64 * 2
    assert floats.model == MINILM and floats.object == "list"


def test_minilm_generation_routes_refuse(minilm_server) -> None:
    with _http(minilm_server) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400
        assert "embeddings only" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400


# ---------------------------------------------------------------- a tiny random BERT


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def bert_server(tiny_bert_dir, one_torch_thread):
    running = RunningServer(
        EmbeddingEngine(tiny_bert_dir), ServerConfig(TINY_BERT, api_key=API_KEY)
    )
    yield running
    running.stop()


def _bert_reference(folder, texts: list[str]) -> tuple[torch.Tensor, list[int]]:
    """transformers' BertModel, mean-pooled over each text's tokens (each text alone)."""
    import transformers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = transformers.BertModel.from_pretrained(folder).eval()
    rows, counts = [], []
    with torch.no_grad():
        for text in texts:
            ids = tok.encode(text).ids
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            rows.append(hidden.mean(dim=0))
            counts.append(len(ids))
    return torch.stack(rows), counts


def test_tiny_bert_equals_transformers_and_is_batch_invariant(bert_server, tiny_bert_dir) -> None:
    texts = _texts(16, 50, seed=2)
    client = _client(bert_server)
    batch = client.embeddings.create(model=TINY_BERT, input=texts, encoding_format="float")
    got = torch.tensor([d.embedding for d in batch.data])
    expected, counts = _bert_reference(tiny_bert_dir, texts)
    assert (got - expected).abs().max() <= 1e-5
    assert batch.usage.prompt_tokens == sum(counts)
    for i in (0, 5, 15):
        alone = client.embeddings.create(model=TINY_BERT, input=texts[i], encoding_format="float")
        assert (torch.tensor(alone.data[0].embedding) - got[i]).abs().max() <= 1e-6


def test_token_id_inputs_and_truncation(bert_server, tiny_bert_dir) -> None:
    texts = _texts(3, 20, seed=3)
    client = _client(bert_server)
    by_text = client.embeddings.create(model=TINY_BERT, input=texts, encoding_format="float")
    ids = [httpx_ids(bert_server, t) for t in texts]
    by_ids = client.embeddings.create(model=TINY_BERT, input=ids, encoding_format="float")
    one = client.embeddings.create(model=TINY_BERT, input=ids[1], encoding_format="float")
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in by_text.data]
    assert one.data[0].embedding == by_text.data[1].embedding
    with _http(bert_server) as http:
        long_text = " ".join(["fox"] * 100)
        body = {"input": long_text, "truncate_prompt_tokens": 10}
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10
        r = http.post("/v1/embeddings", json={"input": long_text, "truncate_prompt_tokens": -1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64
        r = http.post("/v1/embeddings", json={"input": "fox", "dimensions": 32, "user": "u1"})
        assert r.status_code == 200


def httpx_ids(server: RunningServer, text: str) -> list[int]:
    with _http(server) as http:
        return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "fox", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "fox", "dimensions": 16}, 400, "dimensions"),
        ({"input": " ".join(["fox"] * 100)}, 400, "input"),
        ({"input": [[1] * 65]}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": [10_000]}, 400, "input"),
        ({"input": "fox", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
        ({"input": "fox", "model": "gpt-4"}, 404, "model"),
    ],
)
def test_errors_in_openai_shape(bert_server, body, status, param) -> None:
    with _http(bert_server) as http:
        r = http.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"].startswith(param)


def test_openai_client_raises_on_unknown_model(bert_server) -> None:
    with pytest.raises(openai.NotFoundError):
        _client(bert_server).embeddings.create(model="nope", input="fox")


# ---------------------------------------------------------------- a generative (decoder) model


def _decoder_reference(folder, ids: list[list[int]], pooling: str) -> torch.Tensor:
    """transformers' final hidden states of each sequence alone, pooled and L2-normalized."""
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for seq in ids:
            hidden = model(torch.tensor([seq])).last_hidden_state[0]
            rows.append(hidden[-1] if pooling == "last" else hidden.mean(dim=0))
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


@pytest.fixture(scope="module")
def mean_pooling_server(tiny_model_dir, one_torch_thread):
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.model.loader import load_model

    engine = LLMEngine(
        load_model(tiny_model_dir, progress=False),
        num_kv_blocks=64,
        max_model_len=128,
        embedding_pooling="mean",
        kv_cache_dtype="float32",  # as transformers computes: no float16 rounding of K and V
    )
    running = RunningServer(engine, ServerConfig("tiny", api_key=API_KEY))
    yield running
    running.stop()


def _decoder_ids(server: RunningServer, count: int) -> list[list[int]]:
    return [httpx_ids(server, t) for t in _texts(count, 40, seed=4)]


def test_decoder_last_token_pooling(server, tiny_model_dir) -> None:
    ids = _decoder_ids(server, 6)
    client = _client(server)
    got = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    vectors = torch.tensor([d.embedding for d in got.data])
    # this server's KV cache is float16 (the default for an fp32 model): close, not equal
    expected = _decoder_reference(tiny_model_dir, ids, "last")
    assert torch.nn.functional.cosine_similarity(vectors, expected).min() >= 0.9999
    alone = client.embeddings.create(model="tiny", input=ids[2], encoding_format="float")
    assert alone.data[0].embedding == got.data[2].embedding
    assert got.usage.prompt_tokens == sum(len(t) for t in ids)


def test_decoder_mean_pooling(mean_pooling_server, tiny_model_dir) -> None:
    ids = _decoder_ids(mean_pooling_server, 4)
    got = _client(mean_pooling_server).embeddings.create(
        model="tiny", input=ids, encoding_format="float"
    )
    vectors = torch.tensor([d.embedding for d in got.data])
    assert (vectors - _decoder_reference(tiny_model_dir, ids, "mean")).abs().max() <= 1e-4
