"""What ``vframe serve`` changes in an engine configuration left at its defaults."""

from __future__ import annotations

import pytest

from vframe.core.config import EngineConfig
from vframe.core.worker.model_runner import cpu_has_fast_bf16
from vframe.entrypoints.openai.api_server import (
    SERVER_CPU_TOKEN_BUDGET,
    SERVER_CPU_TOKEN_BUDGET_BF16,
    apply_server_defaults,
)


@pytest.mark.parametrize(
    ("dtype", "budget"),
    [
        ("float32", 2048),
        ("bfloat16", 1024),
        ("auto", 1024 if cpu_has_fast_bf16() else 2048),  # auto: bfloat16 where the CPU has it natively
    ],
)
def test_a_cpu_server_steps_a_budget_for_its_dtype_unless_told_otherwise(dtype: str, budget: int) -> None:
    assert (SERVER_CPU_TOKEN_BUDGET, SERVER_CPU_TOKEN_BUDGET_BF16) == (2048, 1024)
    config = apply_server_defaults(EngineConfig.from_sources(device="cpu", dtype=dtype))
    assert config.scheduler.max_num_batched_tokens == budget
    # the offline engine keeps its own default (4096, chosen when the engine starts)
    assert EngineConfig.from_sources(device="cpu").scheduler.max_num_batched_tokens is None


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"max_num_batched_tokens": 4096}, 4096),  # a user's value stands
        ({"max_num_batched_tokens": 512}, 512),
        ({"enable_chunked_prefill": False}, None),  # the engine sizes it to max_model_len
    ],
)
def test_a_server_keeps_what_the_user_chose(settings: dict, expected: int | None) -> None:
    config = apply_server_defaults(EngineConfig.from_sources(device="cpu", **settings))
    assert config.scheduler.max_num_batched_tokens == expected
