"""Code written for vLLM's offline API runs on vframe with an import change:
vLLM's module paths, ``EngineArgs``, and ``LLM(...)``'s keywords with vLLM's
meaning, a documented no-op, or an exact refusal (docs/compatibility.md)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vframe import LLM, SamplingParams
from vframe.core.config import FLAT_FIELDS, EngineConfig
from vframe.errors import ConfigError, InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = "The capital of France is"


# --------------------------------------------------------------------------- #
# module paths
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("vllm_path", "name", "home"),
    [
        ("vframe.sampling_params", "SamplingParams", "vframe.core.sampling_params"),
        ("vframe.sampling_params", "StructuredOutputsParams", "vframe.core.sampling_params"),
        ("vframe.sampling_params", "GuidedDecodingParams", "vframe.core.sampling_params"),
        ("vframe.sampling_params", "BeamSearchParams", "vframe.core.sampling_params"),
        ("vframe.sampling_params", "RequestOutputKind", "vframe.core.sampling_params"),
        ("vframe.outputs", "RequestOutput", "vframe.core.outputs"),
        ("vframe.outputs", "CompletionOutput", "vframe.core.outputs"),
        ("vframe.logprobs", "Logprob", "vframe.core.outputs"),
        ("vframe.inputs", "TokensPrompt", "vframe.core.inputs"),
        ("vframe.inputs", "TextPrompt", "vframe.core.inputs"),
        ("vframe.lora.request", "LoRARequest", "vframe.lora.request"),
        ("vframe.engine.arg_utils", "EngineArgs", "vframe.engine.arg_utils"),
        ("vframe.engine.llm_engine", "LLMEngine", "vframe.core.engine"),
        ("vframe", "EngineArgs", "vframe.engine.arg_utils"),
        ("vframe", "TokensPrompt", "vframe.core.inputs"),
    ],
)
def test_vllm_module_paths_name_the_same_objects(vllm_path, name, home):
    assert getattr(importlib.import_module(vllm_path), name) is getattr(importlib.import_module(home), name)


def test_importing_vframe_and_engine_args_loads_no_torch():
    code = "import sys, vframe; from vframe import EngineArgs, TextPrompt; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_request_output_kind_is_vllms_enum_and_equals_vframes_strings():
    from vframe.sampling_params import RequestOutputKind

    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    assert params.output_kind == "delta" and type(params.output_kind) is str
    assert SamplingParams(output_kind="final").output_kind == RequestOutputKind.FINAL_ONLY
    assert [k.value for k in RequestOutputKind] == ["cumulative", "delta", "final"]


# --------------------------------------------------------------------------- #
# EngineArgs
# --------------------------------------------------------------------------- #


def test_engine_args_has_one_field_per_setting_with_the_same_default():
    from vframe.engine.arg_utils import EngineArgs

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert set(fields) == set(FLAT_FIELDS) | {"config_file"}
    defaults = EngineConfig().flat()
    assert {name: getattr(EngineArgs(), name) for name in FLAT_FIELDS} == defaults
    assert EngineArgs("m.gguf").model == "m.gguf"  # model is first, as in vLLM


def test_engine_args_fields_left_at_default_leave_the_setting_to_the_environment(monkeypatch):
    from vframe.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VFRAME_BLOCK_SIZE", "32")
    monkeypatch.setenv("VFRAME_MAX_NUM_SEQS", "4")
    config = EngineArgs(max_num_seqs=8, dtype="half").create_engine_config()
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.model.dtype) == (32, 8, "float16")


def test_engine_args_from_cli_args_reads_the_serve_flags():
    from vframe.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-seqs", "3", "--enforce-eager", "--kv-cache-dtype", "auto"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.scheduler.max_num_seqs, config.device.enforce_eager) == (3, True)


def test_llm_engine_from_engine_args_generates_what_llm_does(llm_fp32):
    from vframe.engine.arg_utils import EngineArgs
    from vframe.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(dtype="float32", max_model_len=1024, num_threads=2))
    try:
        assert engine.config == llm_fp32.config
        engine.add_request("r", PROMPT, GREEDY)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
        [expected] = llm_fp32.generate(PROMPT, GREEDY, use_tqdm=False)
        assert [out.outputs[0].token_ids for out in outputs] == [expected.outputs[0].token_ids]
        assert len(expected.outputs[0].token_ids) == 5
    finally:
        engine.shutdown()


# --------------------------------------------------------------------------- #
# vLLM's argparse pattern: EngineArgs.add_cli_args + LLM(**vars(args))
# --------------------------------------------------------------------------- #

# vLLM's examples/offline_inference/basic/generate.py, with only the imports changed
# (vllm -> vframe) and the default model set to the embedded one's file.
from vframe import EngineArgs  # noqa: E402
from vframe.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def create_parser(model: str):
    parser = FlexibleArgumentParser()
    # Add engine args
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=model)
    # Add sampling params
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    sampling_group.add_argument("--top-p", type=float)
    sampling_group.add_argument("--top-k", type=int)
    return parser


def main(args: dict):
    # Pop arguments not used by LLM
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    top_p = args.pop("top_p")
    top_k = args.pop("top_k")

    # Create an LLM
    llm = LLM(**args)

    # Create a sampling params object
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    if top_p is not None:
        sampling_params.top_p = top_p
    if top_k is not None:
        sampling_params.top_k = top_k

    # Generate texts from the prompts. The output is a list of RequestOutput
    # objects that contain the prompt, generated text, and other information.
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\nGenerated Outputs:\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


def test_vllms_generate_example_runs_with_its_argparse_flags(smollm, llm_fp32, capsys):
    parser = create_parser(str(smollm.gguf_file))
    args: dict = vars(parser.parse_args(
        ["--max_model_len", "1K", "--dtype", "float32", "--enforce-eager", "--max-tokens", "6", "--temperature", "0"]
    ))
    main(args)
    printed = capsys.readouterr().out
    expected = llm_fp32.generate(
        ["Hello, my name is", "The capital of France is"], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    for out in expected:
        assert f"Prompt:    {out.prompt!r}\nOutput:    {out.outputs[0].text!r}\n" in printed
    assert printed.count("Output:    ") == 4
    assert expected[1].outputs[0].text == " Paris.\n\nThe answer"


def test_none_means_the_default_for_every_setting(monkeypatch):
    assert EngineConfig.from_sources(env={}, **{name: None for name in FLAT_FIELDS}) == EngineConfig()
    # None is "not given": the environment still sets it, as for a flag left out
    config = EngineConfig.from_sources(env={"VFRAME_MAX_NUM_SEQS": "4"}, max_num_seqs=None, dtype=None)
    assert (config.scheduler.max_num_seqs, config.model.dtype) == (4, "auto")


def test_add_cli_args_takes_vllms_flag_spellings_and_values():
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["-tp", "1", "-q", "gguf", "--max-model-len=32k", "--hf_overrides", '{"rope_theta": 1e6}',
         "--compilation-config", '{"level": 0}', "--enable-prefix-caching", "--no-enable-chunked-prefill"]
    )
    config = EngineConfig.from_sources(env={}, **vars(args))
    assert (config.parallel.tensor_parallel_size, config.quantization.quantization) == (1, "gguf")
    assert (config.model.max_model_len, config.model.hf_overrides) == (32000, {"rope_theta": 1e6})
    assert config.device.compilation_config == {"level": 0}
    assert (config.cache.enable_prefix_caching, config.scheduler.enable_chunked_prefill) == (True, False)
    assert parser.parse_args(["--max-model-len", "2K"]).max_model_len == 2048
    # vLLM's older example: LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--max-num-seqs", "3"]))
    assert EngineConfig.from_sources(env={}, **dataclasses.asdict(engine_args)).scheduler.max_num_seqs == 3


def test_flexible_argument_parser_is_where_vllm_has_it():
    import vframe.utils
    import vframe.utils.argparse_utils

    assert vframe.utils.FlexibleArgumentParser is vframe.utils.argparse_utils.FlexibleArgumentParser
    with pytest.raises(SystemExit):
        EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--max-model-len", "1.5K"])


# --------------------------------------------------------------------------- #
# LLM(...) keywords
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("kwargs", "section", "field", "stored"),
    [
        ({"dtype": "half"}, "model", "dtype", "float16"),
        ({"dtype": "float"}, "model", "dtype", "float32"),
        ({"dtype": torch.float16}, "model", "dtype", "float16"),
        ({"dtype": torch.bfloat16}, "model", "dtype", "bfloat16"),
        ({"enforce_eager": True}, "device", "enforce_eager", True),
        ({"compilation_config": 0}, "device", "compilation_config", 0),
        ({"compilation_config": {}}, "device", "compilation_config", {}),
        ({"compilation_config": {"level": 0}}, "device", "compilation_config", {"level": 0}),
        (
            {"compilation_config": {"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8}},
            "device", "compilation_config", {"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8},
        ),
        ({"disable_log_stats": True}, "observability", "disable_log_stats", True),
        ({"disable_custom_all_reduce": True}, "parallel", "disable_custom_all_reduce", True),
        ({"tokenizer_mode": "slow"}, "model", "tokenizer_mode", "slow"),
        ({"tokenizer_mode": "hf"}, "model", "tokenizer_mode", "hf"),
        ({"config_format": "hf"}, "model", "config_format", "hf"),
        ({"load_format": "gguf"}, "model", "load_format", "gguf"),
        ({"revision": None, "code_revision": None, "tokenizer_revision": None}, "model", "revision", None),
        ({"hf_overrides": {"rope_theta": 1e6}}, "model", "hf_overrides", {"rope_theta": 1e6}),
        ({"mm_processor_kwargs": None}, "model", "mm_processor_kwargs", None),
        ({"allowed_local_media_path": "/srv/media"}, "model", "allowed_local_media_path", "/srv/media"),
        ({"generation_config": "vllm"}, "model", "generation_config", "vllm"),
        ({"enable_prompt_embeds": False}, "model", "enable_prompt_embeds", False),
        ({"kv_cache_dtype": "auto"}, "cache", "kv_cache_dtype", "auto"),
        ({"kv_cache_dtype": "fp8"}, "cache", "kv_cache_dtype", "fp8"),
        ({"cpu_offload_gb": 0}, "cache", "cpu_offload_gb", 0.0),
        ({"swap_space": 2}, "cache", "swap_space", 2.0),
        ({"max_logprobs": 5}, "model", "max_logprobs", 5),
        ({"seed": None}, "model", "seed", 0),
    ],
)
def test_vllm_keywords_are_accepted(kwargs, section, field, stored):
    config = EngineConfig.from_sources(env={}, **kwargs)
    assert getattr(getattr(config, section), field) == stored


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"kv_cache_dtype": "fp8_inc"},
            "kv_cache_dtype='fp8_inc' is not supported; use one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2' "
            "('auto' caches the model's dtype, the fp8 ones float8 K/V)",
        ),
        (
            {"revision": "main"},
            "revision='main' is not supported: vframe reads local files only and never downloads from the "
            "Hugging Face Hub; check out that revision locally and pass its directory",
        ),
        (
            {"tokenizer_revision": "v1"},
            "tokenizer_revision='v1' is not supported: vframe reads local files only and never downloads "
            "from the Hugging Face Hub; check out that revision locally and pass its directory",
        ),
        (
            {"code_revision": "abc"},
            "code_revision='abc' is not supported: vframe reads local files only and never downloads "
            "from the Hugging Face Hub; check out that revision locally and pass its directory",
        ),
        (
            {"tokenizer_mode": "mistral"},
            "tokenizer_mode='mistral' is not supported: vframe loads Hugging Face tokenizers only; "
            "use 'auto', 'slow' or 'hf'",
        ),
        (
            {"config_format": "mistral"},
            "config_format='mistral' is not supported: vframe reads config.json; use 'auto' or 'hf'",
        ),
        (
            {"load_format": "pt"},
            "load_format='pt' is not supported: vframe reads safetensors and GGUF files; "
            "use 'auto', 'safetensors' or 'gguf'",
        ),
        (
            {"compilation_config": 3},
            "compilation_config=3 is not supported: vframe compiles no model with torch.compile; "
            "use None, {}, 0 or {'level': 0}",
        ),
        (
            {"compilation_config": {"level": 3}},
            "compilation_config={'level': 3} is not supported: vframe compiles no model with torch.compile; "
            "use level / mode 0",
        ),
        (
            {"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
            "compilation_config cudagraph_mode='PIECEWISE' is not supported: vframe captures whole decode "
            "steps (FULL_DECODE_ONLY) or nothing (NONE)",
        ),
        (
            {"compilation_config": {"custom_ops": ["none"]}},
            "compilation_config keys ['custom_ops'] are not supported; vframe knows level, mode, cudagraph_mode, "
            "cudagraph_capture_sizes, max_cudagraph_capture_size",
        ),
        (
            {"compilation_config": {"cudagraph_capture_sizes": [1, 0]}},
            "compilation_config cudagraph_capture_sizes=[1, 0]: use a list of positive ints",
        ),
        (
            {"mm_processor_kwargs": {"num_crops": 4}},
            "mm_processor_kwargs={'num_crops': 4} is not supported: vframe serves text-only models, which "
            "have no multimodal processor",
        ),
        (
            {"enable_prompt_embeds": True},
            "enable_prompt_embeds=True is not supported: prompts are text or token ids",
        ),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported: weights stay on the device; use 0"),
        (
            {"dtype": "bf16"},
            "invalid value for 'dtype': 'bf16' (expected 'auto', 'float32', 'bfloat16' or 'float16')",
        ),
        ({"hf_token": "x"}, None),  # not one of vframe's settings: the unknown-setting error
    ],
)
def test_vllm_keywords_that_would_change_results_are_refused_exactly(kwargs, message):
    with pytest.raises(ConfigError) as error:
        EngineConfig.from_sources(env={}, **kwargs)
    if message is None:
        assert str(error.value).startswith("unknown setting 'hf_token' (from arguments); known settings: ")
    else:
        assert str(error.value) == message


def test_dtype_half_is_refused_on_cpu_with_the_float16_message():
    messages = []
    for dtype in ("half", "float16"):
        with pytest.raises(ConfigError) as error:
            LLM(dtype=dtype, device="cpu")
        messages.append(str(error.value))
    assert messages == ["dtype='float16' is not supported on CPU; use 'bfloat16' or 'float32'"] * 2


def test_load_format_must_match_the_model_files():
    from vframe.models.loader import resolve_model

    source = resolve_model(None).source
    with pytest.raises(ConfigError) as error:
        LLM(load_format="safetensors", dtype="float32")
    assert str(error.value) == f"load_format='safetensors' but {source} holds gguf weights; use load_format='auto'"


def test_hf_overrides_replace_fields_of_the_model_config(llm_fp32):
    llm = LLM(dtype="float32", num_threads=2, hf_overrides={"max_position_embeddings": 256, "rms_norm_eps": 0.5})
    try:
        assert llm.llm_engine.max_model_len == 256
        [out] = llm.generate(PROMPT, GREEDY, use_tqdm=False)
        [base] = llm_fp32.generate(PROMPT, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids != base.outputs[0].token_ids  # the model itself got the new eps
    finally:
        llm.shutdown()


def test_hf_overrides_merge_into_object_fields_and_are_checked(tmp_path):
    from vframe.errors import ModelLoadError
    from vframe.models.config import ModelConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"rope_scaling": {"type": "linear", "factor": 2.0}, "num_attention_heads": 4}))
    config = ModelConfig.from_file(path, {"rope_scaling": {"factor": 4.0}})
    assert config.rope_scaling == {"type": "linear", "factor": 4.0}
    with pytest.raises(ModelLoadError) as error:
        ModelConfig.from_file(path, {"num_key_value_heads": 3})
    assert str(error.value) == (
        f"{path} with hf_overrides: invalid value for 'num_key_value_heads': 3 "
        "(expected a divisor of num_attention_heads=4)"
    )


def test_seed_also_seeds_python_random_and_numpy():
    from vframe.core.worker.model_runner import TorchModelRunner

    random.seed(1)
    np.random.seed(1)
    TorchModelRunner(EngineConfig.from_sources(env={}, seed=1234, device="cpu"))
    assert random.random() == random.Random(1234).random()
    assert np.random.rand() == np.random.RandomState(1234).rand()
    assert torch.rand(1).item() == torch.rand(1, generator=torch.Generator().manual_seed(1234)).item()


# --------------------------------------------------------------------------- #
# generation_config and prompts
# --------------------------------------------------------------------------- #


def test_generation_config_directory_gives_the_default_sampling_params(tmp_path, llm_fp32):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 7, "max_new_tokens": 3, "do_sample": True, "eos_token_id": 2})
    )
    llm = LLM(dtype="float32", max_model_len=1024, num_threads=2, generation_config=str(tmp_path))
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.top_p) == (0.0, 3, 1.0)
        [out] = llm.generate(PROMPT, use_tqdm=False)  # no sampling_params: the defaults
        [expected] = llm_fp32.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.shutdown()


def test_the_embedded_model_has_no_generation_config_so_auto_gives_vllms_defaults(llm_fp32):
    assert llm_fp32.config.model.generation_config == "auto"
    assert llm_fp32.get_default_sampling_params() == SamplingParams()


def test_generation_config_directory_without_the_file_is_refused(tmp_path):
    with pytest.raises(ConfigError) as error:
        LLM(dtype="float32", generation_config=str(tmp_path))
    assert str(error.value) == (
        f"generation_config={str(tmp_path)!r}: {tmp_path / 'generation_config.json'} does not exist; give a "
        "directory holding generation_config.json, 'auto' (the model's) or 'vllm' (SamplingParams defaults)"
    )


def test_tokens_and_text_prompts_generate_alike(llm_fp32, tokenizer):
    from vframe.inputs import TextPrompt, TokensPrompt

    ids = tokenizer(PROMPT).input_ids
    a, b = llm_fp32.generate([TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids)], GREEDY, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == ids


def test_multimodal_prompt_keys_are_refused_not_ignored(llm_fp32):
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.generate({"prompt": PROMPT, "multi_modal_data": {"image": None}}, GREEDY, use_tqdm=False)
    assert str(error.value) == (
        "prompt keys ['multi_modal_data'] are not supported: vframe serves text-only models; a prompt dict "
        "takes ['cache_salt', 'prompt', 'prompt_token_ids'] (vframe.inputs.TextPrompt / TokensPrompt)"
    )


def test_legacy_prompt_token_ids_keyword_generates_as_token_prompts(llm_fp32, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    expected = llm_fp32.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    (one,) = llm_fp32.generate(sampling_params=GREEDY, prompt_token_ids=ids, use_tqdm=False)
    two = llm_fp32.generate(sampling_params=GREEDY, prompt_token_ids=[ids, ids[:3]], use_tqdm=False)
    assert one.outputs[0].token_ids == expected and one.prompt_token_ids == ids
    assert [o.prompt_token_ids for o in two] == [ids, ids[:3]] and two[0].outputs[0].token_ids == expected


def test_generate_refuses_both_or_neither_prompt_forms(llm_fp32):
    with pytest.raises(InvalidRequestError, match=r"^pass prompts or prompt_token_ids to generate\(\), not both$"):
        llm_fp32.generate(PROMPT, GREEDY, prompt_token_ids=[1, 2])
    neither = r"^generate\(\) needs prompts \(or vLLM's legacy prompt_token_ids=\)$"
    with pytest.raises(InvalidRequestError, match=neither):
        llm_fp32.generate(sampling_params=GREEDY)


def test_beam_search_concurrency_limit_gives_the_same_beams(llm_fp32):
    from vframe.sampling_params import BeamSearchParams

    prompts = [PROMPT, "def add(a, b):", "1, 2, 3,"]
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    together = llm_fp32.beam_search(prompts, params)
    one_at_a_time = llm_fp32.beam_search(prompts, params, concurrency_limit=1)
    beams = [[b.tokens for b in o.sequences] for o in one_at_a_time]
    assert beams == [[b.tokens for b in o.sequences] for o in together]
    assert len(one_at_a_time) == 3 and all(len(o.sequences) == 2 for o in one_at_a_time)
    with pytest.raises(InvalidRequestError, match=r"^concurrency_limit must be a positive integer or None, got 0$"):
        llm_fp32.beam_search(prompts, params, concurrency_limit=0)


# --------------------------------------------------------------------------- #
# the server's request models and flags (no server started)
# --------------------------------------------------------------------------- #


def test_serve_accepts_vllms_flags():
    from vframe.entrypoints.cli import _build_parser, engine_kwargs

    args = _build_parser().parse_args(
        ["serve", "--enforce-eager", "--disable-log-stats", "--kv-cache-dtype", "auto", "--max-logprobs", "5",
         "--enable-prompt-tokens-details", "--generation-config", "vllm", "--tokenizer-mode", "slow"]
    )
    config = EngineConfig.from_sources(env={}, **engine_kwargs(args))
    assert args.enable_prompt_tokens_details is True
    assert (config.device.enforce_eager, config.observability.disable_log_stats, config.model.max_logprobs) == (
        True, True, 5,
    )
    assert (config.model.generation_config, config.model.tokenizer_mode) == ("vllm", "slow")


def test_serve_takes_vllms_flag_spellings_and_values():
    from vframe.entrypoints.cli import _build_parser, engine_kwargs

    args = _build_parser().parse_args(
        ["serve", "-tp", "1", "--max-model-len", "2K", "--hf-overrides", '{"rope_theta": 1e6}',
         "--compilation-config", '{"level": 0}']
    )
    assert engine_kwargs(args) == {
        "tensor_parallel_size": 1, "max_model_len": 2048, "hf_overrides": {"rope_theta": 1e6},
        "compilation_config": {"level": 0},
    }


def test_requests_take_the_unset_sampling_fields_from_generation_config():
    from vframe.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    defaults = {"temperature": 0.2, "top_k": 7, "max_tokens": 3}
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest.model_validate(
        {"messages": messages, "temperature": 0.9, "prompt_cache_key": "k", "reasoning_effort": "low"}
    )
    params = chat.to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.9, 7, 1.0, 3)
    # An explicit max_tokens wins; completions default max_tokens to 16 as OpenAI does.
    assert ChatCompletionRequest.model_validate({"messages": messages, "max_tokens": 5}).to_sampling_params(
        defaults
    ).max_tokens == 5
    completion = CompletionRequest.model_validate({"prompt": "hi"}).to_sampling_params(defaults)
    assert (completion.temperature, completion.max_tokens) == (0.2, 16)
    assert CompletionRequest.model_validate({"prompt": "hi"}).to_sampling_params().temperature == 1.0


def test_extra_args_are_kept_for_plugins_and_unknown_fields_are_type_errors():
    params = SamplingParams(extra_args={"my_plugin": 3})
    assert params.clone().extra_args == {"my_plugin": 3}
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(extra_args=[1])
    assert str(error.value) == "SamplingParams.extra_args=[1] is invalid: must be a dict or None"
    with pytest.raises(TypeError, match="unexpected keyword argument 'flat_logprobs'"):
        SamplingParams(flat_logprobs=True)


# --------------------------------------------------------------------------- #
# vLLM's helpers: get_tokenizer, cleanup_dist_env_and_memory
# --------------------------------------------------------------------------- #


def test_get_tokenizer_loads_what_the_engine_loads(llm_fp32, smollm):
    from vframe.tokenizers import get_tokenizer

    engine_ids = llm_fp32.get_tokenizer()(PROMPT).input_ids
    assert get_tokenizer()(PROMPT).input_ids == engine_ids
    assert get_tokenizer(smollm.gguf_file, tokenizer_mode="slow")(PROMPT).input_ids == engine_ids
    assert get_tokenizer(str(smollm.model_dir), trust_remote_code=True)(PROMPT).input_ids == engine_ids


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode='mistral' is not supported; use 'auto', 'slow' or 'hf'"),
        ({"revision": "main"}, "revision='main' is not supported: vframe reads local files only"),
        ({"use_fast": False}, "get_tokenizer() does not take use_fast"),
    ],
)
def test_get_tokenizer_refuses_what_it_cannot_honour(kwargs, message):
    from vframe.tokenizers import get_tokenizer

    with pytest.raises(ConfigError) as error:
        get_tokenizer(None, **kwargs)
    assert str(error.value) == message


def test_cleanup_dist_env_and_memory_collects_what_is_left_of_deleted_objects():
    import gc
    import weakref

    from vframe.distributed import cleanup_dist_env_and_memory

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the garbage collector frees it
    left = weakref.ref(a)
    gc.disable()  # only the cleanup may collect
    try:
        del a, b
        assert left() is not None
        cleanup_dist_env_and_memory()
    finally:
        gc.enable()
    assert left() is None
    cleanup_dist_env_and_memory(shutdown_ray=True)  # no Ray runtime started here: nothing to stop


# --------------------------------------------------------------------------- #
# LLM.chat's keywords, set_tokenizer
# --------------------------------------------------------------------------- #

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
CHAT_PARAMS = SamplingParams(temperature=0.0, max_tokens=3)


def test_chat_with_a_list_of_conversations_answers_each_in_order(llm_fp32):
    batch = llm_fp32.chat(CONVERSATIONS, CHAT_PARAMS, use_tqdm=False)
    one_by_one = [llm_fp32.chat(c, CHAT_PARAMS, use_tqdm=False)[0] for c in CONVERSATIONS]
    assert [o.outputs[0].text for o in batch] == [o.outputs[0].text for o in one_by_one]
    assert batch[0].prompt.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert batch[1].prompt.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")


def test_chat_template_and_generation_prompt_keywords(llm_fp32):
    template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    [out] = llm_fp32.chat(CONVERSATIONS[0], CHAT_PARAMS, use_tqdm=False, chat_template=template)
    assert out.prompt == "user: What is the capital of France?\nassistant:"
    [out] = llm_fp32.chat(CONVERSATIONS[0], CHAT_PARAMS, use_tqdm=False, add_generation_prompt=False)
    assert out.prompt.endswith("What is the capital of France?<|im_end|>\n")
    partial = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital of France is"}]
    [out] = llm_fp32.chat(
        partial, CHAT_PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")  # no <|im_end|>: continued
    assert out.outputs[0].text == " Paris."
    with pytest.raises(InvalidRequestError) as error:
        llm_fp32.chat(partial, CHAT_PARAMS, continue_final_message=True)  # add_generation_prompt defaults to True
    assert str(error.value) == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def test_set_tokenizer_is_used_for_prompts_chats_and_outputs(llm_fp32):
    import copy

    loaded = llm_fp32.get_tokenizer()
    replacement = copy.deepcopy(loaded)
    replacement.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    try:
        llm_fp32.set_tokenizer(replacement)
        assert llm_fp32.get_tokenizer() is replacement
        [out] = llm_fp32.chat(CONVERSATIONS[0], CHAT_PARAMS, use_tqdm=False)
        assert out.prompt == "<user>What is the capital of France?"
        [plain] = llm_fp32.generate(PROMPT, GREEDY, use_tqdm=False)
        assert plain.outputs[0].text == replacement.decode(plain.outputs[0].token_ids)
    finally:
        llm_fp32.set_tokenizer(loaded)
    assert llm_fp32.get_tokenizer() is loaded
    with pytest.raises(InvalidRequestError, match="^set_tokenizer\\(\\) needs a Hugging Face tokenizer"):
        llm_fp32.set_tokenizer("gpt2")


# --------------------------------------------------------------------------- #
# docs/compatibility.md's LLM(...) table, row by row
# --------------------------------------------------------------------------- #

_REFUSAL = re.compile(
    r"^(?:(?P<name>\w+)=(?P<value>.+?) is not (?:yet )?supported\b"
    r"|invalid value for '(?P<name2>\w+)': (?P<value2>.+?) \()"
)


def _llm_keyword_rows() -> list[tuple[list[str], str]]:
    """``(keyword names, status text)`` of each row of the ``LLM(...)`` keywords table."""
    text = (Path(__file__).parents[1] / "docs" / "compatibility.md").read_text()
    section = text.split("## `LLM(...)` keywords", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        keyword, status = (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:3])
        rows.append(([n for n in re.findall(r"`([^`]+)`", keyword) if n.isidentifier()], status))
    return rows


def _literals(text: str) -> list[object]:
    """The backticked Python literals of ``text`` (``"auto"``, ``None``, ``{}`` ...)."""
    values = []
    for span in re.findall(r"`([^`]+)`", text):
        try:
            values.append(ast.literal_eval(span))
        except (ValueError, SyntaxError):
            pass
    return values


_ROWS = _llm_keyword_rows()


def test_the_llm_keywords_table_has_every_setting_vllm_users_pass():
    names = {name for names, _ in _ROWS for name in names}
    assert len(_ROWS) >= 40
    assert {"model", "dtype", "seed", "enforce_eager", "max_model_len", "hf_token", "speculative_config"} <= names


@pytest.mark.parametrize(("names", "status"), _ROWS, ids=[",".join(n[:2]) for n, _ in _ROWS])
def test_each_llm_keyword_row_of_compatibility_md_holds(names, status):
    """Rows refused as unknown settings are unknown; every other row's keywords are
    settings that take ``None`` and the values the row says work (the backticked
    literals before its first "refused"); each refusal message quoted in the row, with
    the value it names, is raised word for word (those raised at load are not checked here)."""
    if status.startswith("refused (unknown setting)"):
        for name in names:
            with pytest.raises(ConfigError, match=f"^unknown setting '{name}' \\(from arguments\\)"):
                EngineConfig.from_sources(env={}, **{name: True})
        return
    assert set(names) <= set(FLAT_FIELDS), f"{set(names) - set(FLAT_FIELDS)} are not settings"
    default = EngineConfig()
    for name in names:
        assert EngineConfig.from_sources(env={}, **{name: None}) == default
        values = _literals(status.split("refused", 1)[0].split(";", 1)[0])
        field = getattr(EngineConfig.model_fields[FLAT_FIELDS[name]].annotation, "model_fields")[name]
        if status.startswith("no-op") and field.annotation is bool:
            values.append(True)
        for value in values:
            EngineConfig.from_sources(env={}, **{name: value})  # accepted: no ConfigError
    for match in re.finditer(r"`([^`]+)`", status):
        message = match.group(1)
        refusal = _REFUSAL.match(message)
        around = status[max(0, match.start() - 12) : match.end() + 11]
        if refusal is None or "at load" in around:
            continue
        name = refusal.group("name") or refusal.group("name2")
        value = ast.literal_eval(refusal.group("value") or refusal.group("value2"))
        with pytest.raises(ConfigError) as error:
            EngineConfig.from_sources(env={}, **{name: value})
        assert str(error.value) == message


# --------------------------------------------------------------------------- #
# vLLM's tests/entrypoints/llm/test_prompt_validation.py, with the model changed
# --------------------------------------------------------------------------- #


def test_empty_prompt(llm_fp32):
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm_fp32.generate([""])


def test_out_of_vocab_token(llm_fp32):
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm_fp32.generate({"prompt_token_ids": [999999]})
