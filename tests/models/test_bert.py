"""BERT (all-MiniLM-L6-v2) under the pooling runner, against sentence-transformers,
and the pooler on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vframe.errors import ConfigError
from vframe.layers.pooler import PoolerConfig, pool, resolve_pooler_config

# Different lengths in one batch: 1 word (3 tokens with [CLS] and [SEP]) to more
# than two 16-token KV blocks' worth, with punctuation, digits and casing.
SENTENCES = [
    "Hello",
    "The capital of France is Paris.",
    "vframe runs code written for vLLM with an import change, and real OpenAI clients work against "
    "vframe serve: 27 examples, 222 items of API surface, 3 third-party clients.",
    "A man is playing a guitar.",
    "Embeddings equal sentence-transformers' within 1e-4 in FLOAT32!",
]


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def _embed(llm, prompts) -> torch.Tensor:
    return torch.tensor([out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)])


def test_embeddings_equal_sentence_transformers_in_float32(llm_minilm, sentence_transformer):
    ours = _embed(llm_minilm, SENTENCES)
    reference = sentence_transformer.encode(SENTENCES, convert_to_tensor=True)
    assert ours.shape == (5, 384)
    assert (ours - reference).abs().max().item() < 1e-4
    # Mean pooling then L2 normalisation, as the checkpoint's modules.json says.
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(5))
    # Written out from sentence-transformers 6.2.0 on this checkpoint.
    torch.testing.assert_close(ours[0, :3], torch.tensor([-0.0627718, 0.0549588, 0.0521648]), atol=1e-5, rtol=0)


def test_token_counts_include_cls_and_sep(llm_minilm):
    [out] = llm_minilm.embed("Hello", use_tqdm=False)
    assert out.prompt_token_ids == [101, 7592, 102]  # [CLS] hello [SEP]


def test_batches_split_by_token_budget_give_the_same_embeddings(minilm_dir, llm_minilm):
    from vframe import LLM

    small = LLM(str(minilm_dir), dtype="float32", num_threads=2, max_num_batched_tokens=64, max_num_seqs=2)
    try:
        torch.testing.assert_close(_embed(small, SENTENCES), _embed(llm_minilm, SENTENCES), atol=1e-6, rtol=0)
    finally:
        small.shutdown()


def test_an_encoder_cannot_run_the_generate_runner(minilm_dir):
    from vframe import LLM

    with pytest.raises(ConfigError) as error:
        LLM(str(minilm_dir), runner="generate", dtype="float32")
    assert str(error.value) == (
        "BertModel is an encoder-only (pooling) model and cannot generate; use runner='pooling' "
        "(LLM.embed / LLM.encode / LLM.score, /v1/embeddings)"
    )


# --------------------------------------------------------------------------- #
# the pooler
# --------------------------------------------------------------------------- #

HIDDEN = torch.tensor([[1.0, 0.0], [3.0, 4.0], [5.0, 8.0], [0.0, 2.0], [6.0, 8.0]])  # [T=5, E=2]
QUERY_START_LOC = [0, 3, 5]  # prompt 0: rows 0..2, prompt 1: rows 3..4


@pytest.mark.parametrize(
    ("pooling_type", "expected"),
    [
        ("MEAN", [[3.0, 4.0], [3.0, 5.0]]),
        ("CLS", [[1.0, 0.0], [0.0, 2.0]]),
        ("LAST", [[5.0, 8.0], [6.0, 8.0]]),
    ],
)
def test_pool_reduces_each_prompts_rows(pooling_type, expected):
    pooled = pool(HIDDEN, QUERY_START_LOC, pooling_type, normalize=False)
    torch.testing.assert_close(torch.stack(pooled), torch.tensor(expected))


def test_pool_normalizes_and_all_keeps_every_row():
    [first, second] = pool(HIDDEN, QUERY_START_LOC, "LAST", normalize=True)
    torch.testing.assert_close(second, torch.tensor([0.6, 0.8]))
    rows = pool(HIDDEN, QUERY_START_LOC, "ALL", normalize=False)
    assert [tuple(r.shape) for r in rows] == [(3, 2), (2, 2)]


def test_pooling_comes_from_the_checkpoints_sentence_transformers_modules(tmp_path, minilm_dir):
    class Decoder:  # no default_pooling_type: LAST
        pass

    assert resolve_pooler_config(minilm_dir, Decoder(), None) == PoolerConfig("MEAN", normalize=True)
    assert resolve_pooler_config(tmp_path, Decoder(), None) == PoolerConfig("LAST", normalize=True)
    modules = [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert resolve_pooler_config(tmp_path, Decoder(), None) == PoolerConfig("CLS", normalize=False)
    setting = {"pooling_type": "mean"}
    assert resolve_pooler_config(tmp_path, Decoder(), setting) == PoolerConfig("MEAN", normalize=False)
    with pytest.raises(ConfigError, match=r"pooler_config pooling_type='max' is not supported"):
        resolve_pooler_config(tmp_path, Decoder(), {"pooling_type": "max"})
