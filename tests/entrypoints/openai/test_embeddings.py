"""``POST /v1/embeddings`` through the official ``openai`` client, on
``vframe serve MODEL --runner pooling`` with all-MiniLM-L6-v2."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from openai_server import Server, start_server, stop_server

# sentence-transformers' embedding of "Hello" (its first components; see tests/models/test_bert.py).
HELLO_HEAD = [-0.0627718, 0.0549588, 0.0521648]
TEXTS = ["Hello", "A man is playing a guitar.", "The capital of France is Paris."]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory, minilm_dir) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("vframe-serve-embed"), str(minilm_dir), "--runner", "pooling")
    yield srv
    stop_server(srv.process)


@pytest.fixture
def embed_client(embedding_server: Server) -> Iterator[openai.OpenAI]:
    with embedding_server.client() as c:
        yield c


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_float_and_base64_give_the_same_embeddings(embed_client):
    model = _model(embed_client)
    as_float = embed_client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    # The client asks for base64 when not told, and decodes it to floats itself.
    as_base64 = embed_client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert [len(d.embedding) for d in as_float.data] == [384, 384, 384]
    assert np.array([d.embedding for d in as_base64.data]) == pytest.approx(
        np.array([d.embedding for d in as_float.data]), abs=1e-7
    )
    assert as_float.data[0].embedding[:3] == pytest.approx(HELLO_HEAD, abs=1e-5)
    norms = np.linalg.norm(np.array([d.embedding for d in as_float.data]), axis=1)
    assert norms == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    # [CLS] hello [SEP] + [CLS] a man is playing a guitar . [SEP] + [CLS] the capital of france is paris . [SEP]
    assert (as_float.usage.prompt_tokens, as_float.usage.total_tokens) == (3 + 9 + 9, 3 + 9 + 9)
    assert as_float.model == model and as_float.object == "list"


def test_base64_is_little_endian_float32(embedding_server):
    body = {"input": "Hello", "encoding_format": "base64"}
    response = embedding_server.post("/v1/embeddings", json=body)
    assert response.status_code == 200
    [item] = response.json()["data"]
    vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
    assert vector.shape == (384,)
    assert vector[:3].tolist() == pytest.approx(HELLO_HEAD, abs=1e-5)


def test_token_id_input_embeds_as_its_text(embed_client):
    model = _model(embed_client)
    by_text = embed_client.embeddings.create(model=model, input="Hello", encoding_format="float")
    by_ids = embed_client.embeddings.create(model=model, input=[[101, 7592, 102]], encoding_format="float")
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[0].embedding, abs=1e-6)
    assert by_ids.usage.prompt_tokens == 3


def test_bad_embedding_requests_are_refused(embed_client, embedding_server):
    model = _model(embed_client)
    with pytest.raises(openai.BadRequestError) as error:
        embed_client.embeddings.create(model=model, input="Hello", dimensions=8)
    assert error.value.body["param"] == "dimensions"
    assert "does not support Matryoshka representation" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="the input is empty"):
        embed_client.embeddings.create(model=model, input="")
    with pytest.raises(openai.NotFoundError):
        embed_client.embeddings.create(model="no-such-model", input="Hello")
    too_long = embedding_server.post("/v1/embeddings", json={"input": [[1000] * 600]})
    assert too_long.status_code == 400
    assert "longer than max_model_len=512" in too_long.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="runs with runner='pooling': it embeds"):
        embed_client.completions.create(model=model, prompt="Hello")


def test_a_generate_server_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model=_model(client), input="Hello")
    assert error.value.body["message"] == (
        "The model does not support Embeddings API: 'SmolLM2-135M-Instruct' runs with runner='generate'; "
        "serve an embedding model (vframe serve MODEL --runner pooling)"
    )
