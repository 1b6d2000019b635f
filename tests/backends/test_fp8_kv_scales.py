"""Calibrated FP8 KV-cache scales (plugin API 1.19): a checkpoint's per-layer ``k_scale`` /
``v_scale`` (llm-compressor's ``kv_cache_scheme``, ModelOpt's, vLLM's) go to the layer's
attention impl; a float8 cache then stores ``fp8(key / k_scale)`` and attends it times
``k_scale`` (values likewise). Checked against transformers running the same checkpoint with
its keys and values rounded the same way, on a model whose keys and values lie far beyond
float8's range at scale 1.0."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
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


def _backend_without(flag: str, name: str, impl_name: str) -> type:
    """The torch backend as ``name``, its impl (``impl_name``) with ``flag`` false: a plugin
    written before the plugin API that added it."""
    from vframe.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl

    impl = type(impl_name, (TorchAttentionImpl,), {flag: False})
    return type(f"{impl_name.removesuffix('Impl')}Backend", (TorchAttentionBackend,),
                {"name": name, "get_impl_cls": staticmethod(lambda: impl)})


def _plain_backend() -> type:
    """An impl that does not declare supports_kv_cache_scales (plugin API 1.19)."""
    return _backend_without("supports_kv_cache_scales", "plain", "PlainImpl")


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
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_proj.weight *= GROWTH
            attn.q_proj.weight /= GROWTH
            attn.v_proj.weight *= GROWTH
            attn.o_proj.weight /= GROWTH
    amax = _calibrated_amax(model)
    model.save_pretrained(path)
    # keys grow with rope's rotation too: a margin, as calibration data never covers everything
    scales = {i: (float(2 * k / LIMIT), float(2 * v / LIMIT)) for i, (k, v) in amax.items()}
    tensors = load_file(path / "model.safetensors")
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return scales


def _calibrated_amax(model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's max |key| and max |value| per KV head ([KVH] each, before rope) over PROMPTS,
    as a oneshot calibration on the prompts themselves would find them."""
    amax: dict[int, list[torch.Tensor]] = {}
    heads = model.config.num_key_value_heads

    def record(i: int, which: int):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            entry = amax.setdefault(i, [torch.zeros(heads), torch.zeros(heads)])
            entry[which] = torch.maximum(entry[which], out.detach().reshape(-1, heads, out.shape[-1] // heads)
                                         .abs().amax(dim=(0, 2)))
        return hook

    hooks = [h for i, layer in enumerate(model.model.layers)
             for h in (layer.self_attn.k_proj.register_forward_hook(record(i, 0)),
                       layer.self_attn.v_proj.register_forward_hook(record(i, 1)))]
    with torch.no_grad():
        for prompt in PROMPTS:
            model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    return {i: (k, v) for i, (k, v) in amax.items()}


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[float, float]]]:
    path = tmp_path_factory.mktemp("grown-llama")
    return str(path), _grown_llama(path)


def _reference(path: str, scales: dict[int, tuple[float | torch.Tensor, float | torch.Tensor]] | None
               ) -> torch.nn.Module:
    """transformers' Llama whose attention sees its keys and values as a float8 cache with
    ``scales`` holds them (a layer's, or per KV head ``[KVH]``; None: the plain model)."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def fp8_kv(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        k_scale, v_scale = scales[module.layer_idx]

        def rounded(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:  # x [B, KVH, T, D]
            scale = torch.as_tensor(scale).reshape(1, -1, 1, 1)
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


@pytest.mark.parametrize("model", ["grown", "grown_heads"])  # a scale a layer; a scale a KV head (plugin API 1.22)
@pytest.mark.parametrize("backend", ["torch", "cpu_paged", "triton"])
def test_a_checkpoint_s_kv_scales_give_transformers_answers_through_a_float8_cache(
    model: str, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "triton":
        request.getfixturevalue("interpreted")  # its kernels under Triton's interpreter
    path, scales = request.getfixturevalue(model)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", attention_backend=backend,
              max_model_len=128, num_threads=2, enable_prefix_caching=False)
    impls = [layer.self_attn.attn for layer in llm.llm_engine.model_runner.model.model.layers]
    if model == "grown":
        assert [(impl.k_scale, impl.v_scale) for impl in impls] == [pytest.approx(scales[i], rel=1e-6) for i in (0, 1)]
    else:
        for i, impl in enumerate(impls):
            assert (impl.k_scale, impl.v_scale) == (1.0, 1.0)
            assert torch.equal(impl.k_head_scales, scales[i][0]) and torch.equal(impl.v_head_scales, scales[i][1])
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


@pytest.mark.parametrize("model", ["grown", "grown_heads"])
def test_the_decode_plan_applies_the_scales_as_the_layers_do(
    model: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """cpu_paged's decode steps run in the C++ decode plan, which divides K / V by the layer's
    scales before storing them and folds the scales into the attention (per KV head: the query
    and the output, fold_kv_head_scales' operations): the same operators with the same
    arguments as the layers, so the same bits."""
    path, _ = request.getfixturevalue(model)
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
    ("model", "kind", "scale", "message"),
    [
        ("grown", "k_scale", torch.tensor([0.5, 0.25]), "holds 2 FP8 KV-cache scales (shape (2,)), and its attention "
         "layer has 1 KV head: a calibrated scale is one value per layer, or one per KV head of the model"),
        ("grown", "k_scale", torch.tensor(-1.0), "is a KV-cache scale of -1.0; a scale must be positive and finite"),
        ("grown", "k_scale", torch.tensor(float("nan")),
         "is a KV-cache scale of nan; a scale must be positive and finite"),
        # per KV head (plugin API 1.22): a count other than the model's KV heads, a zero among them
        ("grown_heads", "v_scale", torch.full((3, 1, 1), 0.5), "holds 3 FP8 KV-cache scales (shape (3, 1, 1)), and "
         "its attention layer has 2 KV heads: a calibrated scale is one value per layer, or one per KV head of the "
         "model"),
        ("grown_heads", "v_scale", torch.tensor([[[0.5]], [[0.0]]]),
         "is a KV-cache scale of 0.0; a scale must be positive and finite"),
    ],
)
def test_scales_vframe_cannot_apply_are_refused_at_load(model: str, kind: str, scale: torch.Tensor, message: str,
                                                        tmp_path: Path, request: pytest.FixtureRequest) -> None:
    path = _with_scales(request.getfixturevalue(model)[0], tmp_path, {f"model.layers.1.self_attn.{kind}": scale})
    expected = f"checkpoint tensor 'model.layers.1.self_attn.{kind}' {message}"
    with pytest.raises(ModelLoadError, match=re.escape(expected)):
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=64)


@contextmanager
def _registered(backend: type) -> Iterator[None]:
    """A throwaway plugin registering ``backend`` under its name."""
    from vframe.plugins import hookimpl, register_plugin, unregister_plugin

    class Plugin:
        @hookimpl
        def vframe_register_attention_backends(self, register):  # noqa: ANN001, ANN202
            register(backend.name, backend)

    register_plugin(Plugin(), f"{backend.name}-attn")
    try:
        yield
    finally:
        unregister_plugin(f"{backend.name}-attn")


@pytest.fixture
def plain_backend() -> Iterator[None]:
    with _registered(_plain_backend()):
        yield


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


# --------------------------------------------------------------------------- #
# Per KV head (plugin API 1.22): llm-compressor's kv_cache_scheme strategy attn_head
# --------------------------------------------------------------------------- #

# KV head 0's keys and values GROWTH times larger than the model's own, head 1's 2 ** -10 of that:
# one scale per layer (head 0's) leaves head 1's values among float8's subnormals
HEAD_GROWTH = (GROWTH, GROWTH / 1024)


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_store_each_kv_head_over_its_own_scale(backend: str, kv_cache_dtype: str, dtype: torch.dtype) -> None:
    # the kit's heads get the scales times 1, 1/4, 4 and 1/2 (keys; values the reverse): a backend
    # that applied one head's scale to all of them stores other bytes and fails
    check_attention_backend(backend, dtype=dtype, quick=dtype != torch.float32, kv_cache_dtype=kv_cache_dtype,
                            kv_cache_scales=(0.03125, 4.0), per_head_kv_scales=True)


def _per_tensor_backend() -> type:
    """An impl that applies per-layer scales only (plugin API 1.22)."""
    return _backend_without("supports_per_head_kv_scales", "per-tensor", "PerTensorImpl")


def test_the_kit_refuses_per_head_scales_for_a_backend_that_does_not_apply_them() -> None:
    with pytest.raises(AssertionError, match="^attention backend 'per-tensor': its impl .*PerTensorImpl does not "
                                             "declare supports_per_head_kv_scales"):
        check_attention_backend(_per_tensor_backend(), kv_cache_dtype="fp8", kv_cache_scales=(2.0, 2.0),
                                per_head_kv_scales=True)


def _grown_llama_per_head(path: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny random Llama with two KV heads (two query heads each) whose keys and values grow
    by HEAD_GROWTH per KV head (the query heads reading it and their outputs shrink as much:
    the same function), saved with per-head scales as llm-compressor's attn_head strategy
    writes them (``k_scale`` / ``v_scale`` [KVH, 1, 1]: max |x| / 448 per head, a margin of 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    head_dim = 32
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for h, growth in enumerate(HEAD_GROWTH):
                kv, q = slice(h * head_dim, (h + 1) * head_dim), slice(2 * h * head_dim, 2 * (h + 1) * head_dim)
                attn.k_proj.weight[kv] *= growth
                attn.v_proj.weight[kv] *= growth
                attn.q_proj.weight[q] /= growth
                attn.o_proj.weight[:, q] /= growth
    amax = _calibrated_amax(model)
    model.save_pretrained(path)
    scales = {i: (2 * k / LIMIT, 2 * v / LIMIT) for i, (k, v) in amax.items()}
    tensors = load_file(path / "model.safetensors")
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = k.reshape(-1, 1, 1)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = v.reshape(-1, 1, 1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return scales


@pytest.fixture(scope="module")
def grown_heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    path = tmp_path_factory.mktemp("grown-heads-llama")
    return str(path), _grown_llama_per_head(path)


def test_one_scale_per_layer_loses_the_smaller_head(grown_heads: tuple[str, dict], tmp_path: Path) -> None:
    """The test above can fail: the same model with each layer's largest head scale for both
    heads (what a per-tensor calibration finds) rounds head 1's keys and values, 2 ** -10 the
    size of head 0's, among float8's subnormals."""
    path, scales = grown_heads
    per_layer = {f"model.layers.{i}.self_attn.{name}": s.max().reshape(())
                 for i, (k, v) in scales.items() for name, s in (("k_scale", k), ("v_scale", v))}
    llm = LLM(model=_with_scales(path, tmp_path, per_layer), skip_tokenizer_init=True, dtype="float32",
              kv_cache_dtype="fp8", max_model_len=128, num_threads=2)
    reference = _reference(path, scales)
    deltas = (_prompt_logprobs(llm, PROMPTS[0]) - _reference_logprobs(reference, PROMPTS[0])).abs()
    assert float(deltas.max()) > 0.05, deltas  # measured: 0.083 (per head: below 1e-4, above)


def test_per_head_scales_go_unused_with_a_cache_in_the_model_s_dtype(grown_heads: tuple[str, dict]) -> None:
    path, _ = grown_heads
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="auto", max_model_len=128,
              num_threads=2, attention_backend="cpu_paged")
    plain = _reference(path, None)
    for prompt in PROMPTS:
        assert float((_prompt_logprobs(llm, prompt) - _reference_logprobs(plain, prompt)).abs().max()) < 1e-4


@pytest.fixture
def per_tensor_backend() -> Iterator[None]:
    with _registered(_per_tensor_backend()):
        yield


def test_an_engine_refuses_per_head_scales_its_backend_does_not_apply(
    grown_heads: tuple[str, dict], per_tensor_backend: None
) -> None:
    common = dict(model=grown_heads[0], skip_tokenizer_init=True, dtype="float32", attention_backend="per-tensor",
                  max_model_len=64)
    with pytest.raises(ConfigError) as info:
        LLM(kv_cache_dtype="fp8", **common)
    assert str(info.value) == (
        "the checkpoint carries calibrated FP8 KV-cache scales per KV head (kv_cache_scheme strategy 'attn_head'; 2 "
        "layers) and attention backend 'per-tensor' (PerTensorImpl) does not apply per-head scales to its "
        "kv_cache_dtype='fp8' cache; use kv_cache_dtype='auto' (the scales then go unused), or a backend that applies "
        "them (torch, cpu_paged, triton)"
    )
    LLM(kv_cache_dtype="auto", **common)  # unused there: it loads


@pytest.mark.parametrize(("total_heads", "tp_size"), [(2, 1), (2, 2), (4, 2), (2, 4), (2, 8), (4, 8), (8, 4)])
def test_each_rank_takes_the_scales_of_the_kv_heads_its_q_k_v_projection_holds(
    total_heads: int, tp_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's split of per-head scales over tensor-parallel ranks is the projection's split
    of the heads (consecutive heads a rank; with more ranks than heads, each head replicated on
    consecutive ranks): checked against QKVParallelLinear's own k shard for every rank."""
    import vframe.layers.parallel as parallel
    from vframe.backends.torch_attn import TorchAttentionImpl
    from vframe.layers.linear import QKVParallelLinear
    from vframe.models.loader.weights import set_kv_cache_scale

    head_size, heads = 4, 8
    scales = torch.arange(1, total_heads + 1, dtype=torch.float32).reshape(-1, 1, 1) / 8
    for rank in range(tp_size):
        qkv = QKVParallelLinear(16, head_size, heads, total_heads, bias=False, tp_rank=rank, tp_size=tp_size)
        # the projection's k rows on this rank, as the heads they come from
        start, size, shard_rank, _ = qkv._shard_layout("k")
        k_rows = torch.arange(total_heads * head_size)[shard_rank * size : (shard_rank + 1) * size]
        expected = scales.reshape(-1)[k_rows[::head_size] // head_size]

        model = torch.nn.Module()
        model.attn = torch.nn.Module()
        model.attn.impl = TorchAttentionImpl(heads // tp_size, head_size, 0.5, qkv.num_kv_heads)
        monkeypatch.setattr(parallel, "get_tp_rank", lambda rank=rank: rank)
        monkeypatch.setattr(parallel, "get_tp_size", lambda: tp_size)
        set_kv_cache_scale(model, "attn.k_scale", scales)
        assert torch.equal(model.attn.impl.k_head_scales, expected), (rank, model.attn.impl.k_head_scales, expected)


def test_a_latent_cache_refuses_per_head_scales(tiny_deepseek: str, tmp_path: Path) -> None:
    path = _with_scales(tiny_deepseek, tmp_path, {"model.layers.0.self_attn.k_scale": torch.full((4, 1, 1), 0.5)})
    with pytest.raises(ModelLoadError, match=re.escape(
            "checkpoint tensor 'model.layers.0.self_attn.k_scale' holds 4 FP8 KV-cache scales (shape (4, 1, 1)) for a "
            "multi-head latent attention layer, whose cache holds one latent per token: it takes one scale")):
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=64)


def test_kv_head_scales_gives_either_kind_per_kv_head() -> None:
    from vframe.backends.torch_attn import TorchAttentionImpl

    impl = TorchAttentionImpl(4, 8, 0.5, 2)
    assert not impl.has_kv_cache_scales
    impl.k_scale, impl.v_head_scales = 0.5, torch.tensor([2.0, 0.25])  # a per-layer k, per-head v
    assert impl.has_kv_cache_scales
    k, v = impl.kv_head_scales("cpu")
    assert k.tolist() == [0.5, 0.5] and v.tolist() == [2.0, 0.25] and k.dtype == v.dtype == torch.float32
    query, key, value = torch.ones(1, 4, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8)
    query, key, value, factor = impl.fold_kv_head_scales(query, key, value)
    assert query[0, :, 0].tolist() == [0.5] * 4 and key[0, :, 0].tolist() == [2.0, 2.0]
    assert value[0, :, 0].tolist() == [0.5, 4.0] and factor[:, 0].tolist() == [2.0, 2.0, 0.25, 0.25]


def _attention_quantized(src: str, dst: Path, zero_point: float = 0.0) -> str:
    """``src`` (grown_heads) as llm-compressor's attention quantization saves it: a weightless
    config group targeting LlamaAttention with float8 inputs per head, the kv_cache_scheme it
    implies, and beside each layer's k / v scales a q_scale and zero points (llm-compressor 0.14
    on a CPU leaves q_scale uncalibrated: zeros and denormals here, as it wrote them)."""
    import json

    fp8_head = {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    scales = {}
    for i in (0, 1):
        prefix = f"model.layers.{i}.self_attn"
        scales |= {f"{prefix}.q_scale": torch.tensor([0.0, 1e-44, 0.0, 3e-30]).reshape(4, 1, 1)}
        scales |= {f"{prefix}.{x}_zero_point": torch.zeros(n, 1, 1, dtype=torch.float8_e4m3fn)
                   for x, n in (("q", 4), ("k", 2), ("v", 2))}
    scales["model.layers.1.self_attn.v_zero_point"] = torch.full((2, 1, 1), zero_point).to(torch.float8_e4m3fn)
    kept = {k: v for k, v in load_file(Path(src) / "model.safetensors").items() if k.endswith("_scale")}
    path = _with_scales(src, dst, kept | scales)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {"attention": {"targets": ["LlamaAttention"], "weights": None,
                                        "input_activations": fp8_head, "format": "dense"}},
        "ignore": [], "kv_cache_scheme": fp8_head,
    }
    (dst / "config.json").write_text(json.dumps(config))
    return path


def test_attention_quantization_serves_as_its_per_head_kv_scales(grown_heads: tuple[str, dict], tmp_path: Path) -> None:
    """llm-compressor's attention quantization: the linears float, the k / v scales per head
    applied by a float8 cache (the same answers as the checkpoint with the scales alone), the
    queries' scales and the zero points read and not used."""
    path, scales = grown_heads
    quantized = _attention_quantized(path, tmp_path)
    common = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=128, num_threads=2)
    llm = LLM(model=quantized, **common)
    layer = llm.llm_engine.model_runner.model.model.layers[1].self_attn
    assert type(layer.qkv_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    assert torch.equal(layer.attn.k_head_scales, scales[1][0]) and torch.equal(layer.attn.v_head_scales, scales[1][1])
    plain = LLM(model=path, **common)
    for prompt in PROMPTS:
        assert torch.equal(_prompt_logprobs(llm, prompt), _prompt_logprobs(plain, prompt))


def test_a_nonzero_kv_zero_point_is_refused(grown_heads: tuple[str, dict], tmp_path: Path) -> None:
    path = _attention_quantized(grown_heads[0], tmp_path, zero_point=1.0)
    with pytest.raises(ModelLoadError, match=re.escape(
            "checkpoint tensor 'model.layers.1.self_attn.v_zero_point' is a nonzero zero point: vframe's float8 KV "
            "cache is symmetric (scales only), as vLLM's")):
        LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", max_model_len=64)


# --------------------------------------------------------------------------- #
# calculate_kv_scales: computed at start-up from a batch of random tokens (vLLM's option)
# --------------------------------------------------------------------------- #


def _calculated_scales(path: str, ids: list[int]) -> dict[int, tuple[float, float]]:
    """vLLM's calculate_kv_scales on transformers: in one forward of ``ids``, each layer's scales
    from its keys (after rope) and values, max |K| / 200 and max |V| / 100, then its attention
    over them rounded as a float8 cache holds them (so the next layer's keys are the ones an
    engine computing them sees)."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from vframe.core.worker.kv_scales import K_SCALE_CONSTANT, V_SCALE_CONSTANT

    scales = {}

    def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.float() / scale).clamp(-LIMIT, LIMIT).to(torch.float8_e4m3fn).float() * scale

    def calculate(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        k, v = float(key.abs().max()) / K_SCALE_CONSTANT, float(value.abs().max()) / V_SCALE_CONSTANT
        scales[module.layer_idx] = (k, v)
        return sdpa_attention_forward(module, query, rounded(key, k), rounded(value, v), attention_mask, **kwargs)

    AttentionInterface.register("vframe_calculate_kv_scales", calculate)
    AttentionMaskInterface.register("vframe_calculate_kv_scales", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="vframe_calculate_kv_scales")
    with torch.no_grad():
        model.eval()(torch.tensor([ids]))
    return scales


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_calculated_kv_scales_are_a_random_batch_s_max_over_200_and_100(
    grown_heads: tuple[str, dict], backend: str, tmp_path: Path
) -> None:
    """The checkpoint's scales dropped (at scale 1.0 its keys and values, up to ~GROWTH, would
    saturate): calculate_kv_scales=True sets each layer's from one forward of 128 random tokens
    (seed 0: max_model_len caps the batch), max |K| / 200 and max |V| / 100 as vLLM computes them,
    and the float8 cache then gives transformers' answers over the same rounding; the decode
    plan (cpu_paged) is built again with them."""
    from vframe.core.worker.kv_scales import CALIBRATION_TOKENS, SEED

    path = _with_scales(grown_heads[0], tmp_path, {})
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
              attention_backend=backend, max_model_len=128, num_threads=2, enable_prefix_caching=False)
    batch = torch.randint(0, 128, (min(CALIBRATION_TOKENS, 128),), generator=torch.Generator().manual_seed(SEED))
    expected = _calculated_scales(path, batch.tolist())
    impls = [layer.self_attn.attn for layer in llm.llm_engine.model_runner.model.model.layers]
    assert [(impl.k_scale, impl.v_scale) for impl in impls] == [pytest.approx(expected[i], rel=1e-5) for i in (0, 1)]
    assert all(impl.k_head_scales is None and "forward" not in vars(impl) for impl in impls)
    if backend == "cpu_paged":
        assert llm.llm_engine.model_runner.model.model.decode_plan is not None
    reference = _reference(path, {i: (impls[i].k_scale, impls[i].v_scale) for i in (0, 1)})
    for prompt in PROMPTS:
        deltas = (_prompt_logprobs(llm, prompt) - _reference_logprobs(reference, prompt)).abs()
        assert float(deltas.max()) < 1e-4, deltas
    _decode_against_reference(llm, reference)


def test_calculated_kv_scales_replace_the_checkpoint_s_per_head_ones(grown_heads: tuple[str, dict]) -> None:
    llm = LLM(model=grown_heads[0], skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8",
              calculate_kv_scales=True, max_model_len=64)
    impl = llm.llm_engine.model_runner.model.model.layers[0].self_attn.attn
    assert impl.k_head_scales is None and impl.v_head_scales is None and impl.k_scale != 1.0
    assert impl.kv_head_scales("cpu")[0].tolist() == pytest.approx([impl.k_scale] * 2)


def test_calculate_kv_scales_needs_a_float8_cache_and_a_backend_that_applies_scales(
    grown: tuple[str, dict], plain_backend: None
) -> None:
    common = dict(model=grown[0], skip_tokenizer_init=True, dtype="float32", max_model_len=64, calculate_kv_scales=True)
    with pytest.raises(ConfigError, match=re.escape(
            "calculate_kv_scales=True computes the scales of a float8 KV cache; set kv_cache_dtype='fp8' (or "
            "'fp8_e5m2'), or leave calculate_kv_scales off")):
        LLM(**common)
    with pytest.raises(ConfigError, match=re.escape(
            "calculate_kv_scales=True sets each layer's k_scale / v_scale, and attention backend 'plain' (PlainImpl) "
            "does not apply them to its kv_cache_dtype='fp8' cache")):
        LLM(kv_cache_dtype="fp8", attention_backend="plain", **common)


def test_a_latent_cache_s_calculated_scale_is_its_max_over_200(tiny_deepseek: str) -> None:
    llm = LLM(model=tiny_deepseek, skip_tokenizer_init=True, dtype="float32", kv_cache_dtype="fp8",
              calculate_kv_scales=True, max_model_len=64)
    impls = [layer.self_attn.attn for layer in llm.llm_engine.model_runner.model.model.layers]
    # the latent (normed c_kv and the rotated key) is of order 1: its max over 200 is of order 1/200
    assert all(0.001 < impl.k_scale < 0.05 and impl.v_scale == 1.0 for impl in impls), [i.k_scale for i in impls]
    prompt = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    exact = _prompt_logprobs(LLM(model=tiny_deepseek, skip_tokenizer_init=True, dtype="float32", max_model_len=64),
                             prompt)
    assert float((_prompt_logprobs(llm, prompt) - exact).abs().mean()) < 0.05
