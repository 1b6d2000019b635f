"""The decode plan (vframe/backends/cpu_paged/plan.py): a Llama-style model's layers run
in C++ for decode steps give the tokens and logprobs the layers give, bit for bit; steps
that are not all decodes, and models whose layers it cannot run, keep the layers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_qwen import save_tiny_qwen

from vframe import LLM, SamplingParams
from vframe.layers import cpu_ops
from vframe.quant.kernels.builtin import pairs_available

PAIRS = pairs_available() is None  # the pairs kernels run here (the 4-bit bfloat16 default)

PROMPTS = [
    "The capital of France is",
    "List three prime numbers and explain why each of them is prime, in one short sentence each, "
    "then say which of them is the largest and why:",
    "def fibonacci(n):",
]


def _steps(llm: LLM, params: SamplingParams, prompts: list = PROMPTS) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


def _count_runs(plan, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each step the model asked the plan about was taken (True) or left to the layers."""
    taken: list[bool] = []
    run = plan.run

    def counted(*args):
        out = run(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(plan, "run", counted)
    return taken


def _plan_against_layers(llm: LLM, monkeypatch: pytest.MonkeyPatch, prompts: list = PROMPTS, max_tokens: int = 10):
    """Greedy tokens and logprobs with the plan, then with the layers; how many steps the plan took."""
    model = llm.llm_engine.model_runner.model.model
    plan = model.decode_plan
    assert plan is not None
    taken = _count_runs(plan, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    with_plan = _steps(llm, params, prompts)
    model.decode_plan = None
    try:
        with_layers = _steps(llm, params, prompts)
    finally:
        model.decode_plan = plan
    return with_plan, with_layers, taken


@pytest.mark.parametrize(
    ("kind", "settings", "max_tokens"),
    [
        ("dense float32", {}, sys.maxsize),
        ("GGUF woq_cpu", {"quantization": "gguf"}, 32),
        ("GGUF woq_cpu_a8", {"quantization": "gguf", "quant_kernel": "woq_cpu_a8"}, 32),
        ("float8 KV cache", {"kv_cache_dtype": "fp8"}, sys.maxsize),
    ],
)
def test_the_plan_takes_the_decode_steps_and_computes_what_the_layers_do(
    kind: str, settings: dict, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 24-token budget splits the prompts into chunks beside decodes: those steps stay
    with the layers, the decode steps run in the plan; tokens and logprobs are identical
    to the last bit either way."""
    # No prefix caching: the second run would attend over the first's cached blocks, in other chunks.
    llm = LLM(dtype="float32", max_model_len=256, num_threads=1, max_num_batched_tokens=24,
              enable_prefix_caching=False, attention_backend="cpu_paged", **settings)
    assert llm.llm_engine.model_runner.model.model.decode_plan.max_tokens == max_tokens
    with_plan, with_layers, taken = _plan_against_layers(llm, monkeypatch)
    assert with_plan == with_layers, kind
    assert sum(taken) >= 8 and not all(taken), taken  # 3 requests x 10 tokens: most steps decode only


@pytest.mark.parametrize(
    ("kind", "settings", "max_tokens"),
    [
        ("dense", {}, sys.maxsize),
        # bfloat16's 4-bit default: int4_pairs (AVX512-BF16), its operator below its PREFILL_ROWS (1,024)
        # rows, else torch's operator below int4_cpu.PREFILL_ROWS (128)
        ("GGUF default", {"quantization": "gguf"}, 1023 if PAIRS else 127),
        ("GGUF int4_cpu", {"quantization": "gguf", "quant_kernel": "int4_cpu"}, 127),
        ("GGUF woq_cpu", {"quantization": "gguf", "quant_kernel": "woq_cpu"}, 16),  # in place up to 16 rows
    ],
)
def test_bfloat16_plans_take_what_their_linears_take(
    kind: str, settings: dict, max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """18 requests decode together, then 3 alone: a plan whose linears have no row limit
    takes every decode step, woq_cpu's (16 rows in bfloat16) only the 3-token ones; the
    same tokens and logprobs with the plan as with the layers."""
    llm = LLM(dtype="bfloat16", max_model_len=128, num_threads=2, enable_prefix_caching=False,
              attention_backend="cpu_paged", **settings)
    assert llm.llm_engine.model_runner.model.model.decode_plan.max_tokens == max_tokens
    prompts = [f"Count from {i} to {i + 5}:" for i in range(15)] + PROMPTS
    lengths = [{"prompt_token_ids": llm.get_tokenizer().encode(p)} for p in prompts]
    # 15 short requests finish after 3 tokens, three go on alone
    params = [SamplingParams(temperature=0.0, max_tokens=3 if i < 15 else 8, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    model = llm.llm_engine.model_runner.model.model
    if kind == "dense" and cpu_ops.bf16_gemm_available():  # the plan's MLPs call bf16_gemm_silu, as the layers do
        plan_layers = model.plan_layers(llm.llm_engine.model_runner.model.rotary_emb)
        assert all(layer.silu_pairs is layer.linears[2].weight for layer in plan_layers)
    plan = model.decode_plan
    taken = _count_runs(plan, monkeypatch)

    def run() -> list:
        outs = llm.generate(lengths, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                 o.outputs[0].token_ids)])
                for o in outs]

    with_plan = run()
    model.decode_plan = None
    assert run() == with_plan, kind
    # the prefill is no decode step; then 2 steps of 18 tokens, at least 5 of 3
    assert taken[0] is False and len(taken) >= 8, taken
    assert taken[1:3] == [max_tokens >= 18] * 2 and all(taken[3:]), (kind, taken)


def test_qkv_biases_and_sliding_windows_run_in_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2: a bias on the q/k/v product, a window of 8 tokens on the second layer only;
    prompts longer than the window."""
    save_tiny_qwen(tmp_path, "Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, num_threads=1, enable_prefix_caching=False,
              attention_backend="cpu_paged", max_num_batched_tokens=16)
    model = llm.llm_engine.model_runner.model.model
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [None, 8]
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    prompts = [{"prompt_token_ids": [(7 * i + j) % 112 for j in range(n)]} for i, n in enumerate([5, 23, 37])]
    with_plan, with_layers, taken = _plan_against_layers(llm, monkeypatch, prompts, max_tokens=12)
    assert with_plan == with_layers
    assert sum(taken) >= 8, taken


def test_models_and_settings_the_plan_cannot_run_keep_their_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def plan_of(model: str | None = None, **settings) -> object:
        args = () if model is None else (model,)
        llm = LLM(*args, dtype="float32", max_model_len=64, num_threads=1, **settings)
        return llm.llm_engine.model_runner.model.model.decode_plan

    # Qwen3 normalizes q and k before the rotation: its layers are not the plan's
    save_tiny_qwen(tmp_path / "qwen3", "Qwen3", head_dim=16)
    assert plan_of(str(tmp_path / "qwen3")) is None
    assert plan_of(attention_backend="torch") is None  # the plan's attention is cpu_paged's
    assert plan_of(enable_lora=True, max_loras=1) is None  # LoRA wraps the linears after loading
    monkeypatch.setenv("VFRAME_DECODE_PLAN", "0")
    assert plan_of() is None
    monkeypatch.setenv("VFRAME_DECODE_PLAN", "1")
    monkeypatch.setenv("VFRAME_BIND_LAYERS", "0")  # nothing bound: nothing to plan
    assert plan_of() is None


def test_a_forward_hook_on_a_layer_sends_decode_steps_to_the_layers(llm_fp32, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers call a hook a user registers (to read activations, say); the plan cannot, so
    while one is registered on any module it stands in for, every step runs the layers."""
    model = llm_fp32.llm_engine.model_runner.model.model
    taken = _count_runs(model.decode_plan, monkeypatch)
    seen: list[int] = []
    handle = model.layers[3].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm_fp32.generate(["The capital of France is"], params, use_tqdm=False)
    finally:
        handle.remove()
    assert len(seen) == 4 and seen[1:] == [1, 1, 1] and not any(taken), (seen, taken)  # prefill, 3 decodes
    taken.clear()
    llm_fp32.generate(["The capital of France is"], params, use_tqdm=False)
    assert taken == [False, True, True, True]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixtral_experts_run_in_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """A mixture-of-experts MLP (Mixtral's block: router, softmax top-2, the experts through
    cpu_ops.cpp's moe_experts) runs in the plan: the same
    tokens and logprobs as the layers, bit for bit."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, max_position_embeddings=256)
    hf_model = MixtralForCausalLM(config).eval()
    with torch.no_grad():
        for layer in hf_model.model.layers:  # decisive routing, experts that weigh in the residual
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.15)
            layer.mlp.experts.down_proj.normal_(0.0, 0.15)
    hf_model.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), dtype=dtype, max_model_len=128, num_threads=1, enable_prefix_caching=False,
              attention_backend="cpu_paged", max_num_batched_tokens=16, skip_tokenizer_init=True)
    model = llm.llm_engine.model_runner.model.model
    assert model.decode_plan is not None
    assert model.layers[0].mlp.experts._bound is not None
    prompts = [{"prompt_token_ids": [(7 * i + j) % 128 for j in range(n)]} for i, n in enumerate([5, 23, 37])]
    with_plan, with_layers, taken = _plan_against_layers(llm, monkeypatch, prompts, max_tokens=12)
    assert with_plan == with_layers
    assert sum(taken) >= 8, taken
