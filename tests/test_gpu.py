"""On an NVIDIA GPU (`make test-gpu`): the engine on CUDA against transformers on CUDA,
on a tiny random Llama saved with transformers (no download, no tokenizer)."""

import pytest
import torch

from vframe import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model.to("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_on_cuda_matches_transformers(tiny_llama, dtype):
    path, ref = tiny_llama
    llm = LLM(model=str(path), device="cuda", dtype=dtype, skip_tokenizer_init=True, block_size=16)
    assert llm.llm_engine.model_runner.device.type == "cuda"
    prompts = [[5, 17, 42, 99, 3], list(range(10, 70)), [7] * 33]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    ref = ref.to(getattr(torch, dtype))
    agree = 0
    for prompt, out in zip(prompts, outs):
        expected = ref.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(prompt):].tolist()
        agree += out.outputs[0].token_ids == expected
    # float32 must agree exactly; bfloat16 rounding may flip a near-tie in one prompt.
    assert agree == len(prompts) if dtype == "float32" else agree >= len(prompts) - 1


def test_seeded_sampling_on_cuda(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(model=str(path), device="cuda", skip_tokenizer_init=True)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=3, max_tokens=8, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 8


SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 5, 8,"]


@pytest.mark.parametrize(
    "backend, block_size, dtype",
    [
        ("torch", 16, "float32"),
        ("torch", 16, "bfloat16"),
        ("triton", 16, "float32"),
        ("triton", 16, "bfloat16"),
        ("flex", 16, "bfloat16"),
        ("flash_attn", 256, "bfloat16"),
        ("flash_attn", 256, "float16"),
    ],
)
def test_smollm2_on_cuda_matches_transformers(backend: str, block_size: int, dtype: str) -> None:
    """The embedded SmolLM2 on CUDA with each attention backend, greedy, against
    transformers on CUDA in the same dtype (the parity rule of vframe.testing.models)."""
    from vframe.plugins import get_registry
    from vframe.testing.models import assert_matches_transformers

    registry = get_registry("attention_backend")
    if backend not in registry.names():
        pytest.skip(f"attention backend {backend!r} is not registered")
    if reasons := registry.load(backend).check_available():
        pytest.skip(f"attention backend {backend!r}: " + "; ".join(reasons))
    assert_matches_transformers(
        None, SMOLLM2_PROMPTS, max_tokens=32, dtype=dtype, device="cuda", attention_backend=backend,
        block_size=block_size,
    )  # fmt: skip


@pytest.mark.parametrize("backend, block_size, dtype", [("triton", 16, "float32"), ("flash_attn", 256, "bfloat16")])
def test_cuda_graphs_replay_decode_steps_as_eager_steps_run_them(tiny_llama, backend, block_size, dtype):
    """Decode steps replay captured graphs (padded batches of 11 requests that finish at
    different lengths) and give the tokens of eager steps, which (in float32) give transformers'."""
    from vframe.plugins import get_registry

    if reasons := get_registry("attention_backend").load(backend).check_available():
        pytest.skip(f"attention backend {backend!r}: " + "; ".join(reasons))
    path, ref = tiny_llama
    prompts = [[(13 * i + j) % 500 + 1 for j in range(3 + 7 * i)] for i in range(11)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(11)]

    def greedy(**kwargs):
        llm = LLM(model=str(path), device="cuda", dtype=dtype, skip_tokenizer_init=True, attention_backend=backend,
                  block_size=block_size, max_num_seqs=16, **kwargs)
        outs = llm.generate(requests, params, use_tqdm=False)
        return llm.llm_engine.model_runner, [o.outputs[0].token_ids for o in outs]

    runner, graphed = greedy()
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4, 8, 16]
    eager_runner, eager = greedy(enforce_eager=True)
    assert eager_runner.decode_graphs is None
    assert graphed == eager
    if dtype != "float32":
        return
    ref = ref.to(torch.float32)
    for prompt, p, tokens in zip(prompts, params, graphed):
        expected = ref.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=p.max_tokens, min_new_tokens=p.max_tokens,
            do_sample=False,
        )[0, len(prompt):].tolist()
        assert tokens == expected


def test_backends_without_graph_support_run_eagerly(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(model=str(path), device="cuda", skip_tokenizer_init=True, attention_backend="torch")
    assert llm.llm_engine.model_runner.decode_graphs is None
