"""Plugin objects get the PluginContext of the engine that builds them, lifecycle
hooks the EngineView of the engine that raises them (plugin API 1.2): two engines
serving different models in one process, each with its own tokenizer.

The second model is a tiny random Llama built here with a byte-level BPE
tokenizer trained here on a few lines of text: 320 tokens, where SmolLM2 has 49152."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from vframe import LLM, SamplingParams
from vframe.core.interfaces import LogitsProcessor
from vframe.core.plugin_context import PluginContext
from vframe.core.sample.sampler import DefaultSampler
from vframe.core.sampling_params import StructuredOutputsParams
from vframe.errors import InvalidRequestError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.structured.guidance import GuidanceBackend

GREEDY = dict(temperature=0.0, ignore_eos=True)
TRAINING_TEXT = """\
Once upon a time a small red fox lived under an old oak tree near a quiet river.
Every morning the fox walked to the river to drink cold water and watch the fish jump.
One day a grey heron landed on a stone and asked the fox why it looked so sad.
The fox said that winter was coming and the forest would soon be white with snow.
The heron laughed and told the fox that snow was only water that had learned to fly."""


# --------------------------------------------------------------------------- #
# The plugin: what a third party writes
# --------------------------------------------------------------------------- #

_token_texts: weakref.WeakKeyDictionary[PluginContext, list[str]] = weakref.WeakKeyDictionary()


def token_texts(context: PluginContext) -> list[str]:
    """Every token's text, decoded once per engine (not once per completion)."""
    texts = _token_texts.get(context)
    if texts is None:
        tokenizer = context.tokenizer
        texts = _token_texts[context] = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return texts


class BanSubstring(LogitsProcessor):
    """Never sample a token whose text contains ``substring``."""

    built: list[BanSubstring] = []

    def __init__(self, substring: str, context: PluginContext) -> None:
        self.context = context
        banned = [i for i, text in enumerate(token_texts(context)) if substring in text]
        self.banned_ids = torch.tensor(banned, dtype=torch.long, device=context.device)
        BanSubstring.built.append(self)

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.banned_ids] = float("-inf")
        return logits


class BanTokenId(LogitsProcessor):
    """A plugin API 1.0 processor: no ``context``."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.token_id] = float("-inf")
        return logits


class ContextSampler(DefaultSampler):
    built: list[ContextSampler] = []

    def __init__(self, context: PluginContext) -> None:
        self.context = context
        ContextSampler.built.append(self)


class ContextGuidance(GuidanceBackend):
    built: list[ContextGuidance] = []

    def __init__(self, context: PluginContext) -> None:
        super().__init__(context.tokenizer, context.vocab_size, set(context.eos_token_ids))
        self.context = context
        ContextGuidance.built.append(self)


class LifecycleRecorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []  # (hook, engine_id, detail)
        self.views: dict[str, object] = {}  # engine_id -> the view vframe_engine_started got

    @hookimpl
    def vframe_engine_started(self, engine_view):
        self.views[engine_view.engine_id] = engine_view
        self.events.append(("started", engine_view.engine_id, engine_view.model))

    @hookimpl
    def vframe_request_added(self, request_id, engine_view):
        self.events.append(("added", engine_view.engine_id, request_id))

    @hookimpl
    def vframe_engine_step(self, engine_view):
        self.events.append(("step", engine_view.engine_id, ""))

    @hookimpl
    def vframe_request_finished(self, request_id, engine_view):
        self.events.append(("finished", engine_view.engine_id, request_id))

    @hookimpl
    def vframe_engine_shutdown(self, engine_view):
        self.events.append(("shutdown", engine_view.engine_id, ""))


class ContextPlugin:
    VFRAME_PLUGIN_API = "1.2"

    @hookimpl
    def vframe_register_logits_processors(self, register):
        register("ban_substring", BanSubstring)
        register("ban_token_id", BanTokenId)

    @hookimpl
    def vframe_register_samplers(self, register):
        register("context_sampler", ContextSampler)

    @hookimpl
    def vframe_register_structured_output_backends(self, register):
        register("guidance_with_context", ContextGuidance)


# --------------------------------------------------------------------------- #
# Fixtures
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 1-layer Llama with a byte-level BPE tokenizer trained on TRAINING_TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama-own-tokenizer")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(TRAINING_TEXT.splitlines(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=0,
    )
    LlamaForCausalLM(config).eval().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def plugin():
    register_plugin(ContextPlugin(), "context-plugin-test")
    yield
    unregister_plugin("context-plugin-test")


@pytest.fixture(scope="module")
def engines(plugin, tiny_model) -> tuple[LLM, LLM]:
    """SmolLM2 and the tiny model, both started before either serves a request."""
    smol = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20, num_threads=2)
    tiny = LLM(model=str(tiny_model), dtype="float32", kv_cache_memory_bytes=1 << 20, num_threads=1)
    yield smol, tiny
    smol.shutdown()
    tiny.shutdown()


def generate_ids(llm: LLM, prompt: str, max_tokens: int, **params) -> list[int]:
    [out] = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY, **params), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    return out.outputs[0].token_ids


def texts_of(llm: LLM, prompt: str, max_tokens: int, **params) -> list[str]:
    """The text of each generated token."""
    return [llm.get_tokenizer().decode([t]) for t in generate_ids(llm, prompt, max_tokens, **params)]


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("which", "prompt", "banned", "vocab_size", "banned_tokens"),
    [
        (0, "The capital of France is", "Paris", 49152, [" Paris", " Parish", "Paris"]),
        (1, "the heron", "he", 320, ["he", " the", "The", " he", " heron"]),
    ],
    ids=["smollm2", "tiny"],
)
def test_a_processor_bans_by_the_tokenizer_of_its_own_engine(
    engines, which, prompt, banned, vocab_size, banned_tokens
):
    llm = engines[which]
    plain = texts_of(llm, prompt, 6)
    assert any(banned in text for text in plain)  # without the ban the model says it

    BanSubstring.built.clear()
    constrained = texts_of(llm, prompt, 6, logits_processors=[("ban_substring", {"substring": banned})])

    assert not any(banned in text for text in constrained)
    [processor] = BanSubstring.built  # one instance for the one completion
    assert processor.context is llm.llm_engine.plugin_context
    assert processor.context.tokenizer is llm.get_tokenizer()
    assert processor.context.vocab_size == vocab_size
    assert [llm.get_tokenizer().decode([t]) for t in processor.banned_ids.tolist()] == banned_tokens


def test_each_completion_gets_its_own_instance(engines):
    _, tiny = engines
    BanSubstring.built.clear()
    params = SamplingParams(n=2, max_tokens=2, logits_processors=[("ban_substring", {"substring": "he"})], **GREEDY)
    [out] = tiny.generate("the heron", params, use_tqdm=False)
    assert len(out.outputs) == 2
    assert len(BanSubstring.built) == 2 and BanSubstring.built[0] is not BanSubstring.built[1]


def test_a_processor_without_context_is_built_as_before(engines):
    _, tiny = engines
    first = generate_ids(tiny, "the heron", 3)[0]
    both = generate_ids(
        tiny, "the heron", 3,
        logits_processors=[("ban_token_id", {"token_id": first}), ("ban_substring", {"substring": "he"})],
    )
    assert first not in both
    assert not any("he" in tiny.get_tokenizer().decode([t]) for t in both)


@pytest.mark.parametrize("name", ["ban_substring", "ban_token_id"])
def test_a_request_may_not_pass_context(engines, name):
    _, tiny = engines
    params = SamplingParams(logits_processors=[(name, {"substring": "he", "token_id": 1, "context": "mine"})])
    with pytest.raises(
        InvalidRequestError, match=rf"logits processor '{name}': the argument 'context' is reserved"
    ):
        tiny.generate("the heron", params, use_tqdm=False)


def test_a_sampler_and_a_structured_output_backend_get_the_context(plugin, tiny_model):
    ContextSampler.built.clear()
    ContextGuidance.built.clear()
    llm = LLM(
        model=str(tiny_model), dtype="float32", kv_cache_memory_bytes=1 << 20, num_threads=1,
        sampler="context_sampler",
    )
    choice = StructuredOutputsParams(choice=["snow", "river"], backend="guidance_with_context")
    [out] = llm.generate("the heron", SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice), use_tqdm=False)
    llm.shutdown()

    assert out.outputs[0].text in ("snow", "river")
    [sampler] = ContextSampler.built
    [backend] = ContextGuidance.built
    assert sampler.context is backend.context is llm.llm_engine.plugin_context
    assert (sampler.context.vocab_size, sampler.context.eos_token_ids) == (320, frozenset({0}))
    assert sampler.context.model_config.hidden_size == 32


def test_lifecycle_hooks_tell_two_engines_apart(plugin, tiny_model):
    recorder = LifecycleRecorder()
    register_plugin(recorder, "lifecycle-recorder-test")
    try:
        settings = dict(model=str(tiny_model), dtype="float32", kv_cache_memory_bytes=1 << 20, num_threads=1)
        first, second = LLM(**settings), LLM(**settings)
        first.generate("the fox", SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
        second.generate(["a", "b"], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
        stats = second.llm_engine.engine_view.stats()
        first.shutdown()
        second.shutdown()
    finally:
        unregister_plugin("lifecycle-recorder-test")

    a, b = first.llm_engine.engine_view, second.llm_engine.engine_view
    assert a.engine_id != b.engine_id
    assert recorder.views == {a.engine_id: a, b.engine_id: b}
    assert (a.context, b.context) == (first.llm_engine.plugin_context, second.llm_engine.plugin_context)
    assert (b.max_model_len, b.block_size, b.num_kv_blocks) == (256, 16, 512)
    assert [e for e in recorder.events if e[1] == a.engine_id] == [
        ("started", a.engine_id, str(tiny_model)),
        ("added", a.engine_id, "0"),
        ("step", a.engine_id, ""),  # prefill, first token
        ("finished", a.engine_id, "0"),  # second token: finished is reported inside its step
        ("step", a.engine_id, ""),
        ("shutdown", a.engine_id, ""),
    ]
    assert [e for e in recorder.events if e[1] == b.engine_id] == [
        ("started", b.engine_id, str(tiny_model)),
        ("added", b.engine_id, "0"),
        ("added", b.engine_id, "1"),
        ("finished", b.engine_id, "0"),
        ("finished", b.engine_id, "1"),
        ("step", b.engine_id, ""),
        ("shutdown", b.engine_id, ""),
    ]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0.0
