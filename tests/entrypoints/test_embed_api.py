"""``LLM.embed`` / ``LLM.encode`` / ``LLM.score`` (runner="pooling") on all-MiniLM-L6-v2
and on the embedded SmolLM2 decoder (last-token pooling), and vLLM's offline
embedding example in its vLLM form."""

from __future__ import annotations

import argparse

import pytest
import torch

from vframe.errors import ConfigError, InvalidRequestError
from vframe.pooling_params import PoolingParams

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is"]


# vLLM's examples/offline_inference/basic/embed.py; changed: the import, the model,
# FlexibleArgumentParser (a vLLM utility) -> argparse.ArgumentParser, and
# LLM(**vars(args)) -> without the None values: vframe's flags default to None
# (so that VFRAME_* variables still apply) and LLM() refuses None for most settings.
def _vllm_embed_example(model: str, capsys) -> str:
    from vframe import LLM, EngineArgs

    def parse_args():
        parser = argparse.ArgumentParser()
        parser = EngineArgs.add_cli_args(parser)
        # Set example specific arguments
        parser.set_defaults(model=model, runner="pooling", enforce_eager=True)
        return parser.parse_args([])

    def main(args):
        # Sample prompts.
        prompts = [
            "Hello, my name is",
            "The president of the United States is",
            "The capital of France is",
            "The future of AI is",
        ]

        # Create an LLM.
        # You should pass runner="pooling" for embedding models
        llm = LLM(**{k: v for k, v in vars(args).items() if v is not None})

        # Generate embedding. The output is a list of EmbeddingRequestOutputs.
        outputs = llm.embed(prompts)

        # Print the outputs.
        print("\nGenerated Outputs:\n" + "-" * 60)
        for prompt, output in zip(prompts, outputs):
            embeds = output.outputs.embedding
            embeds_trimmed = (str(embeds[:16])[:-1] + ", ...]") if len(embeds) > 16 else embeds
            print(f"Prompt: {prompt!r} \nEmbeddings: {embeds_trimmed} (size={len(embeds)})")
            print("-" * 60)

    main(parse_args())
    return capsys.readouterr().out


def test_vllm_embed_example_runs(minilm_dir, capsys):
    out = _vllm_embed_example(str(minilm_dir), capsys)
    assert out.count("(size=384)") == 4
    assert "Prompt: 'The future of AI is' \nEmbeddings: [" in out


def test_embed_returns_one_unit_vector_per_prompt_in_order(llm_minilm):
    outputs = llm_minilm.embed(PROMPTS, use_tqdm=False)
    assert [len(o.outputs.embedding) for o in outputs] == [384, 384, 384]
    assert [o.outputs.hidden_size for o in outputs] == [384, 384, 384]
    [single] = llm_minilm.embed(PROMPTS[1], use_tqdm=False)
    assert single.outputs.embedding == pytest.approx(outputs[1].outputs.embedding, abs=1e-6)
    norms = torch.tensor([o.outputs.embedding for o in outputs]).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(3))
    # A token-id prompt embeds as its text does.
    [by_ids] = llm_minilm.embed({"prompt_token_ids": outputs[2].prompt_token_ids}, use_tqdm=False)
    assert by_ids.outputs.embedding == pytest.approx(outputs[2].outputs.embedding, abs=1e-6)


def test_encode_gives_tensors_and_token_embeddings(llm_minilm):
    [pooled] = llm_minilm.encode(PROMPTS[0], use_tqdm=False)
    assert tuple(pooled.outputs.data.shape) == (384,)
    [tokens] = llm_minilm.encode(
        PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False, pooling_task="token_embed"
    )
    assert tuple(tokens.outputs.data.shape) == (len(pooled.prompt_token_ids), 384) == (7, 384)
    # The model's pooling is the mean of these rows, normalised.
    mean = torch.nn.functional.normalize(tokens.outputs.data.mean(0), dim=0)
    torch.testing.assert_close(mean, pooled.outputs.data, atol=1e-6, rtol=0)


def test_normalize_false_keeps_the_length(llm_minilm):
    [raw] = llm_minilm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)
    [unit] = llm_minilm.embed(PROMPTS[0], use_tqdm=False)
    raw_t, unit_t = torch.tensor(raw.outputs.embedding), torch.tensor(unit.outputs.embedding)
    # sentence-transformers: the norm of the mean of its token_embeddings
    assert raw_t.norm().item() == pytest.approx(4.9762, abs=1e-3)
    torch.testing.assert_close(raw_t / raw_t.norm(), unit_t, atol=1e-6, rtol=0)


def test_score_is_the_cosine_similarity_of_embeddings(llm_minilm):
    outputs = llm_minilm.score("hello", ["hi", "the moon"], use_tqdm=False)
    # Written out from sentence-transformers' cos_sim on the same model.
    assert [o.outputs.score for o in outputs] == pytest.approx([0.80715, 0.25163], abs=1e-4)
    pairs = llm_minilm.score(["hello", "the moon"], ["hi", "the moon"], use_tqdm=False)
    assert [p.outputs.score for p in pairs] == pytest.approx([0.80715, 1.0], abs=1e-4)
    with pytest.raises(InvalidRequestError, match=r"got 2 data_1 and 3 data_2 prompts"):
        llm_minilm.score(["a", "b"], ["c", "d", "e"])


def test_decoder_last_token_pooling_equals_transformers(hf_smollm):
    from vframe import LLM

    llm = LLM(runner="pooling", dtype="float32", max_model_len=1024, num_threads=2)
    try:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outputs):
            with torch.no_grad():
                last = hf_smollm.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
            expected = torch.nn.functional.normalize(last, dim=0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-4, rtol=0)
        with pytest.raises(InvalidRequestError) as error:
            llm.generate("Hi", use_tqdm=False)
        assert str(error.value) == (
            "model 'SmolLM2-135M-Instruct' runs with runner='pooling': it embeds (LLM.embed, LLM.encode, "
            "LLM.score, /v1/embeddings) and does not generate; build the engine with runner='generate' "
            "(a decoder model) to generate"
        )
    finally:
        llm.shutdown()


def test_embed_on_the_generate_runner_names_the_fix(llm_fp32):
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.embed("Hi")
    assert str(error.value) == (
        "model 'SmolLM2-135M-Instruct' runs with runner='generate', which does not embed; build the engine "
        "with runner='pooling' (or task='embed') to use LLM.embed / LLM.encode / LLM.score"
    )


def test_bad_pooling_requests_are_refused(llm_minilm, minilm_dir):
    with pytest.raises(InvalidRequestError, match=r"^dimensions=8: model '.*' does not support Matryoshka"):
        llm_minilm.embed("Hi", PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match=r"pooling task 'classify' is not supported"):
        llm_minilm.encode("Hi", pooling_task="classify")
    with pytest.raises(InvalidRequestError, match=r"the prompt \(600 tokens\) is longer than max_model_len=512"):
        llm_minilm.embed({"prompt_token_ids": [1000] * 600})
    [cut] = llm_minilm.embed({"prompt_token_ids": [1000] * 600}, truncate_prompt_tokens=512, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 512
    with pytest.raises(ConfigError, match=r"^task='classify' is not supported"):
        from vframe import LLM

        LLM(str(minilm_dir), task="classify")


def test_vllm_module_paths_of_pooling_classes():
    import vframe.core.pooling_outputs as home
    from vframe.core.pooling_params import PoolingParams as params_home
    from vframe.outputs import EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput

    assert (EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput) == (
        home.EmbeddingRequestOutput, home.PoolingRequestOutput, home.ScoringRequestOutput
    )
    assert PoolingParams is params_home


class _Decoder:  # uses_kv_cache defaults to True
    pass


class _Encoder:
    uses_kv_cache = False


@pytest.mark.parametrize(
    ("runner", "task", "model", "expected"),
    [
        ("auto", None, _Decoder(), "generate"),
        ("auto", None, _Encoder(), "pooling"),
        ("pooling", None, _Decoder(), "pooling"),
        ("auto", "embed", _Decoder(), "pooling"),
        ("auto", "embedding", _Encoder(), "pooling"),
        ("auto", "encode", _Decoder(), "pooling"),
        ("auto", "generate", _Decoder(), "generate"),
        ("pooling", "embed", _Decoder(), "pooling"),
    ],
)
def test_runner_and_vllms_task_keyword_resolve_as_in_vllm(runner, task, model, expected):
    from vframe.core.worker.pooling_runner import resolve_runner

    assert resolve_runner(runner, task, model, "Arch") == expected


def test_contradicting_runner_and_task_are_refused():
    from vframe.core.worker.pooling_runner import resolve_runner

    with pytest.raises(ConfigError) as error:
        resolve_runner("generate", "embed", _Decoder(), "LlamaForCausalLM")
    assert str(error.value) == "task='embed' means runner='pooling', but runner='generate'; pass one of them"
