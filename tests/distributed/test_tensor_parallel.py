"""Tensor parallelism on the CPU: worker processes (gloo) give the tokens one
process gives, for Llama (float, GPTQ with its head quantized, a bitsandbytes NF4
checkpoint, NF4 quantized while loading, a GGUF kept quantized), Mixtral (float,
4-bit experts, GGUF) and DeepSeek (MLA), under prefix caching, chunked prefill and
preemption; bad sizes are refused by name; a killed worker fails the engine at once
and leaves no process behind."""

from __future__ import annotations

import operator
import os
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from parity import assert_engine_matches_transformers, prompts_of_lengths  # noqa: E402
from test_llama import save_tiny_llama  # noqa: E402

from vframe import LLM, SamplingParams  # noqa: E402
from vframe.errors import ConfigError, ExecutorDeadError, InvalidRequestError, PluginError  # noqa: E402

# 8 heads over 4 KV heads split by 2 and by 4; a vocabulary of 97 leaves padding rows
# on the last rank of either.
TINY_TP = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=97)


def worker_pids(parent: int | None = None) -> list[int]:
    """Live processes started as ``python -m vframe.executor.multiproc`` (children
    of ``parent`` when given)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if b"vframe.executor.multiproc" not in cmdline or " Z " in stat[stat.rindex(")"):][:4]:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent is None or ppid == parent:
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    return path, save_tiny_llama(path, **TINY_TP)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks: 7 s
def test_llama_split_over_ranks_matches_transformers(tiny_llama, tp: int) -> None:
    path, hf_model = tiny_llama
    prompts = prompts_of_lengths(97, [5, 23, 37, 12], shared_prefix=4)
    before = worker_pids(os.getpid())
    llm = assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=14, tensor_parallel_size=tp)
    assert len(set(worker_pids(os.getpid())) - set(before)) == tp
    llm.shutdown()
    assert worker_pids(os.getpid()) == before


def test_mixtral_experts_split_over_two_ranks_match_transformers(tmp_path: Path) -> None:
    from test_mixtral import PROMPT_LENGTHS, VOCAB, tiny_hf_mixtral

    hf_model = tiny_hf_mixtral()
    hf_model.save_pretrained(str(tmp_path))
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)
    assert_engine_matches_transformers(tmp_path, hf_model, prompts, num_blocks=14, tensor_parallel_size=2).shutdown()


def test_a_gptq_llama_with_a_quantized_head_split_over_two_ranks_matches_transformers(tmp_path: Path) -> None:
    """4-bit layers cut by rank (groups of 16 whole on each), the 4-bit head whole on every rank."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from packers import PROJECTIONS, gptq_quantize, write_quantized_llama

    quant = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True, "lm_head": True}
    hf_model = write_quantized_llama(
        tmp_path, quant, lambda w, generator: gptq_quantize(w, bits=4, group_size=16, sym=True, desc_act=False,
                                                            generator=generator),
        modules=(*PROJECTIONS, "lm_head"), intermediate_size=128,
    )
    prompts = prompts_of_lengths(96, [5, 23, 37, 12], shared_prefix=4)
    llm = assert_engine_matches_transformers(tmp_path, hf_model, prompts, num_blocks=14, tensor_parallel_size=2)
    llm.shutdown()


def test_a_mixtral_with_quantized_experts_split_over_two_ranks_matches_transformers(tmp_path: Path) -> None:
    """Each expert's 4-bit gate / up cut by output rows and down by input columns (groups of 16
    whole on each rank), the experts' partial sums reduced once per layer."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from test_mixtral import PROMPT_LENGTHS, VOCAB, tiny_hf_mixtral
    from test_quantized_moe import w4a16, write_quantized

    hf_model = write_quantized(tiny_hf_mixtral(), tmp_path, *w4a16(16))
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)
    assert_engine_matches_transformers(tmp_path, hf_model, prompts, num_blocks=14, tensor_parallel_size=2).shutdown()


def test_a_float_llama_quantized_to_nf4_while_loading_on_two_ranks_matches_transformers(tmp_path: Path) -> None:
    """``quantization="bitsandbytes"`` on a float checkpoint: each rank quantizes its own part (q / k / v
    and gate / up rows, o / down inputs), as vLLM's in-flight bitsandbytes; the reference holds those NF4
    weights."""
    import torch

    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from test_bitsandbytes import in_flight

    hf_model = save_tiny_llama(tmp_path, **TINY_TP, intermediate_size=128)  # every rank's rows: blocks of 64
    with torch.no_grad():
        for layer in hf_model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for proj in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
                proj.weight.copy_(torch.cat([in_flight(part) for part in proj.weight.chunk(2, dim=0)]))
            for proj in (attention.o_proj, mlp.down_proj):
                proj.weight.copy_(torch.cat([in_flight(part) for part in proj.weight.chunk(2, dim=1)], dim=1))
    prompts = prompts_of_lengths(97, [5, 23, 37, 12], shared_prefix=4)
    llm = assert_engine_matches_transformers(tmp_path, hf_model, prompts, num_blocks=14, tensor_parallel_size=2,
                                             quantization="bitsandbytes")
    llm.shutdown()


@pytest.mark.slow  # 7 s; make test keeps each rank's placement (tests/quant/test_bitsandbytes.py)
def test_a_bitsandbytes_nf4_llama_split_over_two_ranks_matches_transformers(tmp_path: Path) -> None:
    """A pre-quantized bitsandbytes checkpoint (NF4, double quantization): each rank takes its rows of
    every q / k / v and gate / up module and its inputs of o / down (whole blocks of 64) from the
    checkpoint's codes and block scales; the reference holds the weights the checkpoint means."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from packers import write_quantized_llama
    from test_bitsandbytes import bnb_quantize_4bit, quant_config

    # o_proj's 4 x 32 and down_proj's 128 inputs: 64 a rank
    hf_model = write_quantized_llama(tmp_path, quant_config("nf4", True), lambda w, _: bnb_quantize_4bit(w),
                                     head_dim=32, intermediate_size=128)
    prompts = prompts_of_lengths(96, [5, 23, 37, 12], shared_prefix=4)
    llm = assert_engine_matches_transformers(tmp_path, hf_model, prompts, num_blocks=14, tensor_parallel_size=2)
    llm.shutdown()


def test_a_gguf_llama_kept_quantized_over_two_ranks_matches_its_dense_conversion(tmp_path: Path, gguf_cache) -> None:
    """``quantization="gguf"``: each rank takes its rows (q / k / v, gate / up: Q4_K with a Q6_K v) or its
    inputs (o: Q4_0, down: Q6_K, 128 and 256 a rank, whole blocks) of the file's blocks; the Q8_0 head
    and the float16 embedding stay whole on every rank."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
    from test_gguf import Q4_K_M, write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, [Q4_K_M | {"attn_output": "Q4_0"}] * 2, output_type="Q8_0")
    prompts = [{"prompt_token_ids": ids} for ids in ([0, 5, 17, 33, 2], [0, 40, 41, 42, 43, 44, 45, 46])]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    kw = dict(model=str(path), max_model_len=128, dtype="float32", attention_backend="torch")

    dense = LLM(**kw, num_threads=1)
    expected = [o.outputs[0] for o in dense.generate(prompts, params, use_tqdm=False)]
    dense.shutdown()
    llm = LLM(**kw, quantization="gguf", tensor_parallel_size=2)
    ours = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    for a, b in zip(ours, expected, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)] == pytest.approx(
            [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)], abs=1e-4
        )


@pytest.mark.slow  # 5 s; make test keeps the GGUF Llama over two ranks
def test_a_gguf_mixtral_kept_quantized_over_two_ranks_matches_transformers(tmp_path: Path, gguf_cache) -> None:
    """Each expert's GGUF layers split as the dense ones (w1 / w3 rows, w2 inputs: 64 a rank, whole Q8_0
    blocks)."""
    from test_gguf_models import write_gguf
    from test_mixtral import PROMPT_LENGTHS, VOCAB, tiny_hf_mixtral

    hf_model = tiny_hf_mixtral(intermediate_size=128)
    write_gguf(tmp_path / "tiny-mixtral.gguf", hf_model, "llama")
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)
    llm = assert_engine_matches_transformers(tmp_path / "tiny-mixtral.gguf", hf_model, prompts, num_blocks=14,
                                             quantization="gguf", tensor_parallel_size=2)
    llm.shutdown()


def test_deepseek_v3_mla_split_over_two_ranks_matches_transformers(tmp_path: Path) -> None:
    from test_deepseek import NUM_BLOCKS, V3_CONFIG, VOCAB, save_tiny
    from transformers import DeepseekV3ForCausalLM

    hf_model = save_tiny(DeepseekV3ForCausalLM, V3_CONFIG, tmp_path)
    prompts = prompts_of_lengths(VOCAB, [5, 23, 37, 12], shared_prefix=4)
    llm = assert_engine_matches_transformers(
        tmp_path, hf_model, prompts, num_blocks=NUM_BLOCKS, tensor_parallel_size=2
    )
    llm.shutdown()


# --------------------------------------------------------------------------- #
# The seed example: SmolLM2 over 3 ranks (its 9 heads and 3 KV heads split by 3)
# --------------------------------------------------------------------------- #

PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def smollm_tp3():
    llm = LLM(tensor_parallel_size=3, dtype="float32", seed=0, enable_prefix_caching=True)
    yield llm
    llm.shutdown()


@pytest.mark.slow  # about 13 s; the tiny Llama split over 2 ranks matches transformers in make test
def test_seed_example_over_three_ranks_equals_one_rank(smollm_tp3, llm_fp32) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1234)
    for params in (greedy, seeded):
        ours = [o.outputs[0].token_ids for o in smollm_tp3.generate(PROMPTS, params, use_tqdm=False)]
        one_rank = [o.outputs[0].token_ids for o in llm_fp32.generate(PROMPTS, params, use_tqdm=False)]
        assert ours == one_rank
    long_prompt = "Answer in one word. Question: which city is the capital of France? Answer:"
    first, again = (smollm_tp3.generate(long_prompt, greedy, use_tqdm=False)[0] for _ in range(2))
    assert again.num_cached_tokens == 16  # its first block came from the prefix cache, on every rank
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.outputs[0].text == llm_fp32.generate(long_prompt, greedy, use_tqdm=False)[0].outputs[0].text


def test_grammars_and_logits_processors_are_rebuilt_on_every_rank(smollm_tp3) -> None:
    from vframe.sampling_params import StructuredOutputsParams

    choice = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = smollm_tp3.generate("Is Paris in France? Answer yes or no:", choice, use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no")

    def local(token_ids, logits):  # a closure: it cannot be pickled for the workers
        return logits

    with pytest.raises(InvalidRequestError, match=r"^SamplingParams.logits_processors cannot be sent to the "
                       r"tensor-parallel workers \(Can't pickle local object"):
        smollm_tp3.generate("Hello", SamplingParams(logits_processors=[local]), use_tqdm=False)

    # A processor that reaches the workers and fails there fails its request alone, on every rank alike.
    bad = SamplingParams(temperature=0, max_tokens=4, logits_processors=[operator.itemgetter(0)])
    good = SamplingParams(temperature=0, max_tokens=4)
    outs = smollm_tp3.generate(["Hello", "The capital of France is"], [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "itemgetter expected 1 argument, got 2" in str(outs[0].outputs[0].error)
    assert outs[1].outputs[0].finish_reason == "length"
    assert outs[1].outputs[0].text == " Paris.\n\n"  # as SmolLM2 on one rank says it


def test_heads_that_do_not_split_are_refused_by_name() -> None:
    before = worker_pids(os.getpid())  # other tests' engines may be alive
    with pytest.raises(ConfigError) as error:
        LLM(tensor_parallel_size=2, dtype="float32")
    assert str(error.value) == (
        "num_attention_heads=9 does not split evenly over tensor_parallel_size=2; "
        "use a tensor_parallel_size that divides it"
    )
    assert worker_pids(os.getpid()) == before


def test_models_and_runners_that_do_not_split_are_refused_by_name(minilm_dir, tiny_llama) -> None:
    with pytest.raises(ConfigError) as error:
        LLM(str(minilm_dir), tensor_parallel_size=2)
    assert str(error.value) == (
        "BertModel (vframe.models.bert.BertModel) does not split over tensor-parallel ranks (it does not "
        "declare supports_tensor_parallel); use tensor_parallel_size=1 (got 2)"
    )
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match=r"^runner='pooling' runs the model in the engine's process; with "
                       r"tensor_parallel_size=2 it runs in workers. Use tensor_parallel_size=1 for pooling$"):
        LLM(str(path), runner="pooling", tensor_parallel_size=2, skip_tokenizer_init=True)


def test_executor_names_are_checked(tiny_llama) -> None:
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match=r"^distributed_executor_backend='uni' runs one rank in this process, not "
                       r"tensor_parallel_size=2; use 'mp' \(one process per rank on this machine\) or 'ray'$"):
        LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="uni", skip_tokenizer_init=True)
    with pytest.raises(PluginError, match="unknown executor 'mpi'"):
        LLM(str(path), tensor_parallel_size=2, distributed_executor_backend="mpi", skip_tokenizer_init=True)
    with pytest.raises(ConfigError, match=r"^pipeline_parallel_size=2: pipeline parallelism is not built yet"):
        LLM(str(path), pipeline_parallel_size=2, skip_tokenizer_init=True)


# --------------------------------------------------------------------------- #
# A worker that dies
# --------------------------------------------------------------------------- #


def test_a_killed_worker_fails_the_engine_at_once_and_leaves_nothing(tiny_llama) -> None:
    path, _ = tiny_llama
    before = worker_pids(os.getpid())  # other tests' engines may be alive
    llm = LLM(str(path), tensor_parallel_size=2, skip_tokenizer_init=True, dtype="float32")
    assert len(set(worker_pids(os.getpid())) - set(before)) == 2
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    params = SamplingParams(max_tokens=4, detokenize=False)
    assert len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 4

    rank1 = llm.llm_engine.executor.pids[1]
    os.kill(rank1, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ExecutorDeadError) as error:
        llm.generate(prompt, params, use_tqdm=False)
    assert time.monotonic() - start < 10
    assert str(error.value) == (
        f"tensor-parallel worker rank 1 (pid {rank1}) was killed by signal SIGKILL; "
        "the engine stopped every worker and cannot run more steps"
    )
    assert worker_pids(os.getpid()) == before
    with pytest.raises(ExecutorDeadError):  # and stays dead, saying why
        llm.generate(prompt, params, use_tqdm=False)
