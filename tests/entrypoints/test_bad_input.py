"""Bad input gets a clear error naming the problem; the engine keeps serving."""

import pytest

from vframe import LLM, SamplingParams
from vframe.core.engine import LLMEngine
from vframe.errors import ConfigError, InvalidRequestError, ModelLoadError, PluginError


def drain(engine: LLMEngine) -> dict[str, str]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    return done


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "^the decoder prompt cannot be empty: give at least one token$"),
        ({"prompt_token_ids": []}, None, "^the decoder prompt cannot be empty"),
        ("word " * 1100, None, r"the prompt \(1101 tokens\) is too long: max_model_len is 1024"),
        ({"prompt_token_ids": [1, 99999]}, None,
         r"^token id 99999 is out of vocabulary: prompt token ids out of range \[0, 49152\): \[99999\]$"),
        (3.5, None, "prompt must be a string, a list of token ids or a dict, got float"),
    ],
)
def test_bad_prompt_is_rejected_and_others_complete(llm_fp32, prompt, params, message):
    engine = llm_fp32.llm_engine
    engine.add_request("ok-1", "The capital of France is", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("ok-2", "Water boils at", SamplingParams(temperature=0, max_tokens=4))
    assert set(drain(engine)) == {"ok-1", "ok-2"}
    assert engine.kv_cache_manager.usage == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, r"SamplingParams.temperature=-1.0 is invalid: must be >= 0"),
        ({"top_p": 0.0}, r"SamplingParams.top_p=0.0 is invalid: must be in \(0, 1\]"),
        ({"top_k": -5}, "SamplingParams.top_k=-5 is invalid"),
        ({"min_p": 1.5}, r"SamplingParams.min_p=1.5 is invalid: must be in \[0, 1\]"),
        ({"max_tokens": 0}, "SamplingParams.max_tokens=0 is invalid: must be an integer >= 1"),
        ({"n": 0}, "SamplingParams.n=0 is invalid"),
        ({"min_tokens": 9, "max_tokens": 4}, r"min_tokens=9 is invalid: must be <= max_tokens \(4\)"),
        ({"logprobs": -1}, "SamplingParams.logprobs=-1 is invalid"),
        ({"stop": [""]}, "SamplingParams.stop="),
        ({"stop_token_ids": [-3]}, "SamplingParams.stop_token_ids="),
    ],
)
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id(llm_fp32):
    engine = llm_fp32.llm_engine
    engine.add_request("dup", "Hello", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="request_id 'dup' is already in use"):
        engine.add_request("dup", "Hello again", SamplingParams(max_tokens=2))
    assert set(drain(engine)) == {"dup"}


def test_generate_after_an_error_still_works(llm_fp32):
    with pytest.raises(InvalidRequestError):
        llm_fp32.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm_fp32.llm_engine.has_unfinished_requests()
    out = llm_fp32.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not a file or directory; vframe does not download models"):
        LLM(model=str(tmp_path / "missing.gguf"))


def test_corrupt_model_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(model=str(bad))


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["FancyNetForCausalLM"], "model_type": "fancy"}')
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(PluginError, match="FancyNetForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_unknown_attention_backend_lists_known_ones():
    with pytest.raises(PluginError, match="unknown attention backend 'flashy'.*torch"):
        LLM(attention_backend="flashy")


def test_pipeline_parallel_not_yet_supported():
    with pytest.raises(ConfigError, match=r"^pipeline_parallel_size=2: pipeline parallelism is not built yet"):
        LLM(pipeline_parallel_size=2)


def test_request_larger_than_the_kv_cache(tmp_path):
    llm = LLM(dtype="float32", kv_cache_memory_bytes=2 * 2 * 30 * 16 * 3 * 64 * 4, num_threads=2)
    with pytest.raises(InvalidRequestError, match="needs up to 40 tokens of KV cache but the cache holds 32"):
        llm.generate({"prompt_token_ids": list(range(100, 130))}, SamplingParams(max_tokens=10), use_tqdm=False)
