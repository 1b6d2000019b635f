"""`vframe plugins --check NAME` on built-ins and on an installed plugin, and
``run_quick_checks`` in process."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vframe.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
from vframe.core.interfaces import LogitsProcessor
from vframe.errors import PluginError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.testing.quick import QuickResult, plan_quick_checks, run_check, run_quick_checks

VFRAME = str(Path(sys.executable).with_name("vframe"))

# An installed plugin: a module on PYTHONPATH plus the dist-info that declares its
# entry point, which is all importlib.metadata looks at.
PLUGIN_SOURCE = '''
from vframe import hookimpl


@hookimpl
def vframe_register_attention_backends(register):
    register("test-ignores-prefix", "vframe_test_check_plugin_impl:IgnoresPrefixBackend")


@hookimpl
def vframe_register_logits_processors(register):
    register("test-ban-eos", "vframe_test_check_plugin_impl:BanEndOfSequence")
'''
IMPL_SOURCE = '''
from vframe.backends.torch_attn import PrefillSpan, TorchAttentionBackend, TorchAttentionImpl, TorchAttentionMetadata
from vframe.core.interfaces import LogitsProcessor


class IgnoresPrefixImpl(TorchAttentionImpl):
    """A prefill chunk attends only to its own tokens: the cached prefix is ignored."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        meta = TorchAttentionMetadata.from_common(attn_metadata.common, self.sliding_window)
        meta.prefills = [PrefillSpan(p.query_start, p.query_end, 0, None, None) for p in meta.prefills]
        return super().forward(query, key, value, kv_cache, meta)


class IgnoresPrefixBackend(TorchAttentionBackend):
    name = "test-ignores-prefix"

    @staticmethod
    def get_impl_cls():
        return IgnoresPrefixImpl


class BanEndOfSequence(LogitsProcessor):
    def __init__(self, context):
        self.eos = sorted(context.eos_token_ids)

    def __call__(self, token_ids, logits):
        logits[self.eos] = float("-inf")
        return logits
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("installed")
    (root / "vframe_test_check_plugin.py").write_text(textwrap.dedent(PLUGIN_SOURCE))
    (root / "vframe_test_check_plugin_impl.py").write_text(textwrap.dedent(IMPL_SOURCE))
    dist = root / "vframe_test_check_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vframe-test-check-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vframe]\ntestcheck = vframe_test_check_plugin\n")
    return root


def vframe_plugins(*args: str, plugin_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VFRAME_PLUGINS"}
    if plugin_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_path), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [VFRAME, "plugins", *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


# --------------------------------------------------------------------------- #
# The command
# --------------------------------------------------------------------------- #


def test_builtin_torch_backend_passes_in_every_dtype() -> None:
    result = vframe_plugins("--check", "torch")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "PASS  attention_backend 'torch' (float32, cpu)",
        "PASS  attention_backend 'torch' (bfloat16, cpu)",
        "PASS  attention_backend 'torch' (float16, cpu)",
        "PASS  lora_kernel 'torch' (float32)",  # the built-in LoRA kernel has the same name
    ]


def test_installed_broken_backend_fails_with_the_reason(plugin_path: Path) -> None:
    result = vframe_plugins("--check", "test-ignores-prefix", plugin_path=plugin_path)

    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    for line, dtype in zip(lines, ("float32", "bfloat16", "float16"), strict=True):
        assert line.startswith(
            f"FAIL  attention_backend 'test-ignores-prefix' ({dtype}, cpu): attention backend "
            f"'test-ignores-prefix', case 'cached-prefix-gqa' (torch.{dtype}, head_size=64, block_size=16, "
            "H=6, KVH=2), step 1, layer 0: output differs from the float32 reference"
        ), line


def test_installed_logits_processor_gets_the_embedded_models_context(plugin_path: Path) -> None:
    result = vframe_plugins("--check", "test-ban-eos", plugin_path=plugin_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["PASS  logits_processor 'test-ban-eos'"]


def test_model_has_no_quick_check_and_exits_1() -> None:
    result = vframe_plugins("--check", "MistralForCausalLM")

    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "SKIP  model 'MistralForCausalLM': model parity needs a checkpoint, which a quick check does not "
        "have; in your tests call vframe.testing.models.assert_matches_transformers(<checkpoint dir or "
        ".gguf>, prompts)"
    ]


def test_unknown_name_is_an_error_listing_the_entries() -> None:
    result = vframe_plugins("--check", "flash")

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(
        "vframe: error: no plugin registers an entry named 'flash', and no loaded plugin of that name "
        "has lifecycle hooks; registered: model 'BertModel', model 'DeepseekV2ForCausalLM', "
    )
    assert "attention_backend 'torch'" in result.stderr


@pytest.mark.skipif(
    "stepstats" not in {ep.name for ep in importlib.metadata.entry_points(group="vframe")},
    reason="vframe-plugin-stepstats is not installed: pip install -e contrib/vframe-plugin-stepstats",
)
def test_a_plugin_with_lifecycle_hooks_gets_the_lifecycle_check() -> None:
    result = vframe_plugins("--check", "stepstats")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["PASS  lifecycle hooks of plugin 'stepstats'"]


def test_kind_without_check_is_an_error() -> None:
    result = vframe_plugins("--kind", "scheduler")

    assert (result.returncode, result.stderr) == (2, "vframe: error: --kind only applies with --check NAME\n")


def test_kind_narrows_a_name_several_kinds_use() -> None:
    every = vframe_plugins("--check", "default")
    only = vframe_plugins("--check", "default", "--kind", "scheduler")

    assert every.returncode == 0 and only.returncode == 0
    assert every.stdout.splitlines() == [
        "PASS  scheduler 'default'",
        "SKIP  kv_cache_manager 'default': no quick check exists for a KV cache manager yet",
        "SKIP  sampler 'default': no quick check exists for a sampler yet",
        "SKIP  model_runner 'default': no quick check exists for a model runner yet",
    ]
    assert only.stdout.splitlines() == ["PASS  scheduler 'default'"]


# --------------------------------------------------------------------------- #
# In process
# --------------------------------------------------------------------------- #


class OffByAHundredth(TorchAttentionImpl):
    """Right but for 0.01 added to every output: 1000 times the float32 tolerance."""

    def forward(self, query, key, value, kv_cache, attn_metadata):
        out = super().forward(query, key, value, kv_cache, attn_metadata)
        return out + 0.01


class NeedsAThreshold(LogitsProcessor):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def __call__(self, token_ids, logits):
        return logits.clamp(min=self.threshold)


@pytest.fixture
def runtime_plugin() -> Iterator[None]:
    class Plugin:
        @staticmethod
        @hookimpl
        def vframe_register_attention_backends(register) -> None:
            register("test-offset", type("OffsetBackend", (TorchAttentionBackend,), {
                "name": "test-offset", "get_impl_cls": staticmethod(lambda: OffByAHundredth)
            }))
            register("test-unimportable", "vframe_no_such_module:Backend")

        @staticmethod
        @hookimpl
        def vframe_register_logits_processors(register) -> None:
            register("test-threshold", NeedsAThreshold)

    register_plugin(Plugin, "test-quick-checks")
    yield
    unregister_plugin("test-quick-checks")


def test_run_quick_checks_returns_what_ran() -> None:
    assert run_quick_checks("torch") == [
        "attention_backend 'torch' (float32, cpu)",
        "attention_backend 'torch' (bfloat16, cpu)",
        "attention_backend 'torch' (float16, cpu)",
        "lora_kernel 'torch' (float32)",
    ]
    assert run_quick_checks("fcfs", kind="scheduling_policy") == ["scheduling_policy 'fcfs'"]
    assert run_quick_checks("LlamaForCausalLM") == []  # nothing to run for a model


def test_run_quick_checks_raises_the_first_failure(runtime_plugin: None) -> None:
    with pytest.raises(
        AssertionError, match=r"case 'prefill-gqa' \(torch.float32, .*\), step 0, layer 0: output differs"
    ):
        run_quick_checks("test-offset")
    with pytest.raises(PluginError, match="unknown attention backend 'test-offset-typo'; known: "):
        run_quick_checks("test-offset-typo", kind="attention_backend")


def test_unimportable_entry_is_a_failed_check(runtime_plugin: None) -> None:
    [check] = plan_quick_checks("test-unimportable")

    result = run_check(check)

    assert result.status == "FAIL"
    assert result.reason.startswith(
        "PluginError: attention backend 'test-unimportable' from plugin 'test-quick-checks': cannot import "
        "'vframe_no_such_module:Backend': ModuleNotFoundError"
    )


def test_processor_that_needs_arguments_is_skipped_with_advice(runtime_plugin: None) -> None:
    [check] = plan_quick_checks("test-threshold")

    assert run_check(check) == QuickResult(
        "logits_processor 'test-threshold'",
        "SKIP",
        "its constructor needs threshold; test it with "
        "vframe.testing.logits.check_logits_processor('test-threshold', kwargs={...})",
    )
