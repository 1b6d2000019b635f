"""Calibrated FP8 KV-cache scales (plugin API 1.19): a checkpoint's per-layer ``k_scale`` /
``v_scale`` (llm-compressor's ``kv_cache_scheme``, ModelOpt's, vLLM's) go to the layer's
attention impl; a float8 cache then stores ``fp8(key / k_scale)`` and attends it times
``k_scale`` (values likewise). Checked against transformers running the same checkpoint with
its keys and values rounded the same way, on a model whose keys and values lie far beyond
float8's range at scale 1.0."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vframe import LLM, SamplingParams
from vframe.errors import ConfigError, ModelLoadError
from vframe.testing.attention import check_attention_backend
from vframe.testing.mla import check_mla_backend

LIMIT = 448.0  # float8 e4m3's largest finite value
GROWTH = 4096.0  # keys and values this many times larger, queries and outputs as much smaller
PROMPTS = [[5, 17, 99, 3, 42, 7, 64, 23, 8], [100, 2, 2, 31, 77, 12]]


# --------------------------------------------------------------------------- #
# The kernels: the conformance kit with scales
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_store_kv_over_its_scale_and_attend_it_times_the_scale(
    backend: str, kv_cache_dtype: str, dtype: torch.dtype
) -> None:
    # The kit checks the cache's bytes (fp8(key / k_scale)) and the outputs against float32
    # attention over the stored values times the scales; a backend that ignores either scale,
    # or stores right but forgets to fold one back, fails it.
    check_attention_backend(backend, dtype=dtype, quick=dtype != torch.float32, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=(0.03125, 4.0))


def _plain_backend() -> type:
    """The torch backend with an impl that does not declare supports_kv_cache_scales (a plugin
    written before plugin API 1.19)."""
    from vframe.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl

    class PlainImpl(TorchAttentionImpl):
        supports_kv_cache_scales = False

    class PlainBackend(TorchAttentionBackend):
        name = "plain"

        @staticmethod
        def get_impl_cls() -> type[TorchAttentionImpl]:
            return PlainImpl

    return PlainBackend


def test_the_kit_refuses_scales_for_a_backend_that_does_not_apply_them() -> None:
    PlainBackend = _plain_backend()
    with pytest.raises(AssertionError, match="^attention backend 'plain': its impl .*PlainImpl does not declare "
                                             "supports_kv_cache_scales"):
        check_attention_backend(PlainBackend, kv_cache_dtype="fp8", kv_cache_scales=(2.0, 2.0))
    with pytest.raises(ValueError, match="kv_cache_scales is for a float8 cache"):
        check_attention_backend("torch", kv_cache_scales=(2.0, 2.0))


# --------------------------------------------------------------------------- #
# A checkpoint with scales, against transformers
# --------------------------------------------------------------------------- #


def _grown_llama(path: Path) -> dict[int, tuple[float, float]]:
    """A tiny random Llama whose keys and values are GROWTH times larger than its own, its
    queries and outputs as much smaller (the same function: scores q.k and o(v) unchanged),
    saved with the k / v scales llm-compressor would calibrate (max |x| / 448 per layer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    amax: dict[int, list[float]] = {}
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight *= GROWTH
            attn.q_proj.weight /= GROWTH
            attn.v_proj.weight *= GROWTH
            attn.o_proj.weight /= GROWTH

        def record(i: int, which: int):
            def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
                entry = amax.setdefault(i, [0.0, 0.0])
                entry[which] = max(entry[which], float(out.abs().max()))
            return hook

        hooks = [h for i, layer in enumerate(model.model.layers)
                 for h in (layer.self_attn.k_proj.register_forward_hook(record(i, 0)),
                           layer.self_attn.v_proj.register_forward_hook(record(i, 1)))]
        for prompt in PROMPTS:  # calibration: the prompts themselves, as a oneshot run would
            model(torch.tensor([prompt]))
        for h in hooks:
            h.remove()
    model.save_pretrained(path)
    # keys grow with rope's rotation too: a margin, as calibration data never covers everything
    scales = {i: (2 * k / LIMIT, 2 * v / LIMIT) for i, (k, v) in amax.items()}
    tensors = load_file(path / "model.safetensors")
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return scales


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[float, float]]]:
    path = tmp_path_factory.mktemp("grown-llama")
    return str(path), _grown_llama(path)


def _reference(path: str, scales: dict[int, tuple[float, float]] | None) -> torch.nn.Module:
    """transformers' Llama whose attention sees its keys and values as a float8 cache with
    ``scales`` holds them (None: the plain model)."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def fp8_kv(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        k_scale, v_scale = scales[module.layer_idx]

        def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
            return (x.float() / scale).clamp(-LIMIT, LIMIT).to(torch.float8_e4m3fn).float() * scale

        return sdpa_attention_forward(module, query, rounded(key, k_scale), rounded(value, v_scale),
                                      attention_mask, **kwargs)

    AttentionInterface.register("vframe_fp8_kv_reference", fp8_kv)
    AttentionMaskInterface.register("vframe_fp8_kv_reference", sdpa_mask)  # masks as sdpa's
    kind = "sdpa" if scales is None else "vframe_fp8_kv_reference"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=kind).eval()


def _prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])


def _reference_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def _decode_against_reference(llm: LLM, reference: torch.nn.Module, n: int = 12) -> None:
    """Greedy decoding (each token's logits from the cached keys and values), teacher-forced
    against transformers along vframe's own tokens: each token's logprob as the reference
    gives it, and each the reference's best (a tiny random model has near-ties: equal within
    the tolerance counts as best). Looser than a prefill: a last-bit difference in one layer
    can round a later key to its float8 neighbour."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)):
        tokens = list(out.outputs[0].token_ids)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)  # [n, V]
        chosen = expected.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert float((got - chosen).abs().max()) < 5e-3, (got, chosen)
        assert bool((chosen >= expected.max(-1).values - 5e-3).all()), tokens


@pytest.mark.parametrize("backend", ["torch", "cpu_paged", "triton"])
def test_a_checkpoint_s_kv_scales_give_transformers_answers_through_a_float8_cache(
    grown: tuple[str, dict], backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "triton":
        request.getfixturevalue("interpreted")  # its kernels under Triton's interpreter
    path, scales = grown
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", attention_backend=backend,
              max_model_len=128, num_threads=2, enable_prefix_caching=False)
    impls = [layer.self_attn.attn for layer in llm.llm_engine.model_runner.model.model.layers]
    assert [(impl.k_scale, impl.v_scale) for impl in impls] == [pytest.approx(scales[i], rel=1e-6) for i in (0, 1)]
    reference = _reference(path, scales)
    for prompt in PROMPTS:
        deltas = (_prompt_logprobs(llm, prompt) - _reference_logprobs(reference, prompt)).abs()
        # the same float8 values on both sides, float32 sums in another order: measured max 2.4e-6
        # (torch), 1.4e-6 (cpu_paged and triton); 3.8 nats with the scales dropped (the next test)
        assert float(deltas.max()) < 1e-4, deltas
    # decode: cached keys read back through each backend's own path (cpu_paged: the decode plan's C++)
    _decode_against_reference(llm, reference)


def test_without_its_scales_the_same_cache_saturates(grown: tuple[str, dict], tmp_path: Path) -> None:
    """The test above can fail: the same checkpoint with its scales dropped runs at scale 1.0,
    where its keys and values (up to ~GROWTH) saturate at 448."""
    path, scales = grown
    unscaled = _with_scales(path, tmp_path, {})
    llm = LLM(model=unscaled, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=128,
              num_threads=2)
    reference = _reference(path, scales)
    deltas = (_prompt_logprobs(llm, PROMPTS[0]) - _reference_logprobs(reference, PROMPTS[0])).abs()
    assert float(deltas.max()) > 0.5  # measured: 3.8


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_with_a_cache_in_the_model_s_dtype_the_scales_go_unused(
    grown: tuple[str, dict], backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "triton":
        request.getfixturevalue("interpreted")  # its kernels under Triton's interpreter
    path, _ = grown
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="auto", max_model_len=128,
              num_threads=2, attention_backend=backend)
    plain = _reference(path, None)
    for prompt in PROMPTS:
        assert float((_prompt_logprobs(llm, prompt) - _reference_logprobs(plain, prompt)).abs().max()) < 1e-4


def test_the_decode_plan_applies_the_scales_as_the_layers_do(
    grown: tuple[str, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cpu_paged's decode steps run in the C++ decode plan, which divides K / V by the layer's
    scales before storing them and folds the scales into the attention: the same operators
    with the same arguments as the layers, so the same bits."""
    path, _ = grown
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8",
              attention_backend="cpu_paged", max_model_len=128, num_threads=2, enable_prefix_caching=False)
    model = llm.llm_engine.model_runner.model.model
    plan = model.decode_plan
    assert plan is not None
    taken, run = [], plan.run
    monkeypatch.setattr(plan, "run", lambda *args: taken.append(run(*args)) or taken[-1])
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)

    def steps() -> list[tuple[list[int], list[float]]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                  o.outputs[0].token_ids)])
                for o in outs]

    with_plan = steps()
    assert sum(t is not None for t in taken) == 9  # every decode step of the batch
    model.decode_plan = None
    try:
        assert steps() == with_plan
    finally:
        model.decode_plan = plan


# --------------------------------------------------------------------------- #
# Names, values and refusals
# --------------------------------------------------------------------------- #


def _with_scales(src: str, dst: Path, scales: dict[str, torch.Tensor]) -> str:
    """A copy of checkpoint ``src`` in ``dst`` whose KV-cache scales are ``scales`` (none: ``{}``)."""
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {k: v for k, v in load_file(Path(src) / "model.safetensors").items() if not k.endswith("_scale")}
    save_file({**tensors, **scales}, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        # ModelOpt writes them under the projections; kv_scale sets both (older FP8 checkpoints)
        ({"model.layers.0.self_attn.k_proj.k_scale": 0.5, "model.layers.0.self_attn.v_proj.v_scale": 0.25},
         (0.5, 0.25)),
        ({"model.layers.0.self_attn.kv_scale": 2.0}, (2.0, 2.0)),
        ({"model.layers.0.self_attn.attn.k_scale": 3.0}, (3.0, 1.0)),
    ],
)
def test_the_names_tools_write_reach_the_layer(grown: tuple[str, dict], tmp_path: Path, names: dict,
                                               expected: tuple[float, float]) -> None:
    path = _with_scales(grown[0], tmp_path, {k: torch.tensor([v]) for k, v in names.items()})
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", attention_backend="torch",
              max_model_len=64)
    layers = llm.llm_engine.model_runner.model.model.layers
    assert (layers[0].self_attn.attn.k_scale, layers[0].self_attn.attn.v_scale) == expected
    assert (layers[1].self_attn.attn.k_scale, layers[1].self_attn.attn.v_scale) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (torch.tensor([0.5, 0.25]), "holds 2 FP8 KV-cache scales (shape (2,)); vframe reads one per layer"),
        (torch.tensor(-1.0), "is a KV-cache scale of -1.0; a scale must be positive and finite"),
        (torch.tensor(float("nan")), "is a KV-cache scale of nan; a scale must be positive and finite"),
    ],
)
def test_scales_vframe_cannot_apply_are_refused_at_load(grown: tuple[str, dict], tmp_path: Path,
                                                        scale: torch.Tensor, message: str) -> None:
    path = _with_scales(grown[0], tmp_path, {"model.layers.1.self_attn.k_scale": scale})
    expected = f"checkpoint tensor 'model.layers.1.self_attn.k_scale' {message}"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=64)


@pytest.fixture
def plain_backend() -> Iterator[None]:
    """A throwaway plugin registering ``_plain_backend()`` as ``plain``."""
    from vframe.plugins import hookimpl, register_plugin, unregister_plugin

    class Plugin:
        @hookimpl
        def vframe_register_attention_backends(self, register):  # noqa: ANN001, ANN202
            register("plain", _plain_backend())

    register_plugin(Plugin(), "plain-attn")
    yield
    unregister_plugin("plain-attn")


def test_an_engine_refuses_scales_its_backend_does_not_apply(grown: tuple[str, dict], plain_backend: None) -> None:
    common = dict(model=grown[0], skip_tokenizer_init=True, dtype="float32", attention_backend="plain",
                  max_model_len=64)
    with pytest.raises(ConfigError) as info:
        LLM(kv_cache_dtype="fp8", **common)
    assert re.fullmatch(
        r"the checkpoint carries calibrated FP8 KV-cache scales \(k_scale / v_scale, e.g. [0-9.]+ / [0-9.]+\) and "
        r"attention backend 'plain' \(.*PlainImpl\) does not apply them to its kv_cache_dtype='fp8' cache; use "
        r"kv_cache_dtype='auto' \(the scales then go unused\), or a backend that applies them \(torch, cpu_paged, triton\)",
        str(info.value),
    ), str(info.value)
    LLM(kv_cache_dtype="auto", **common)  # unused there: it loads


def test_a_scale_with_no_attention_layer_is_refused(grown: tuple[str, dict], tmp_path: Path) -> None:
    path = _with_scales(grown[0], tmp_path, {"model.norm.k_scale": torch.tensor(1.0)})
    with pytest.raises(ModelLoadError, match=r"^checkpoint tensor 'model.norm.k_scale' is a KV-cache scale with no "
                                             r"attention layer on its path in LlamaForCausalLM$"):
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=64)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_torch_mla_stores_the_latent_over_k_scale(kv_cache_dtype: str) -> None:
    check_mla_backend("torch", dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, kv_cache_scale=0.05)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory: pytest.TempPathFactory) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
        max_position_embeddings=128, q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=1,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deepseek")
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    return str(path)


def test_deepseek_s_latent_cache_takes_its_k_scale(tiny_deepseek: str, tmp_path: Path) -> None:
    """MLA caches one latent (key and value at once): k_scale scales all of it, as in vLLM.
    A power of two only moves float8's exponent, so 1/64 gives the bytes of scale 1.0 times
    64 and the same answers; 1/1000 puts the latent (up to ~2) past 448, where it saturates."""
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    common = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128)
    exact = _prompt_logprobs(LLM(model=tiny_deepseek, kv_cache_dtype="auto", **common), prompt)
    unscaled = _prompt_logprobs(LLM(model=tiny_deepseek, kv_cache_dtype="fp8", **common), prompt)

    def scaled(k_scale: float, where: Path) -> torch.Tensor:
        where.mkdir()
        path = _with_scales(tiny_deepseek, where, {f"model.layers.{i}.self_attn.k_scale": torch.tensor(k_scale)
                                                   for i in (0, 1)})
        llm = LLM(model=path, kv_cache_dtype="fp8", **common)
        assert [layer.self_attn.attn.k_scale for layer in llm.llm_engine.model_runner.model.model.layers] == [
            pytest.approx(k_scale)] * 2
        return _prompt_logprobs(llm, prompt)

    # measured: 6.6e-5 from scale 1.0 (float32 sums in another order), which is 0.019 from the float32 cache
    assert float((scaled(1 / 64, tmp_path / "a") - unscaled).abs().max()) < 1e-3
    assert float((unscaled - exact).abs().mean()) > 0.005
    saturated = scaled(1e-3, tmp_path / "b")
    assert float((saturated - exact).abs().mean()) > 5 * float((unscaled - exact).abs().mean())


def test_a_latent_v_scale_other_than_its_k_scale_is_refused(tiny_deepseek: str, tmp_path: Path) -> None:
    path = _with_scales(tiny_deepseek, tmp_path, {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                                                  "model.layers.0.self_attn.v_scale": torch.tensor(0.25)})
    with pytest.raises(ConfigError) as info:
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=64)
    assert str(info.value) == (
        "the checkpoint gives a multi-head latent attention layer v_scale=0.25 beside k_scale=0.5; its float8 cache "
        "holds one latent, scaled by k_scale (as vLLM's), so a different v_scale cannot be applied; use "
        "kv_cache_dtype='auto' (the scales then go unused)"
    )
    LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="auto", max_model_len=64)  # unused there
