"""The ``ray`` executor: tensor-parallel ranks as Ray actors of a local Ray
cluster started here (2 CPUs), giving the tokens one process gives; an actor
that dies fails the engine at once."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray executor needs Ray: pip install 'vframe[ray]'")

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import save_tiny_llama  # noqa: E402

from vframe import LLM, SamplingParams  # noqa: E402
from vframe.errors import ExecutorDeadError  # noqa: E402

PROMPTS = [{"prompt_token_ids": [1, 5, 9, 60, 17]}, {"prompt_token_ids": list(range(3, 40))}]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-ray")
    save_tiny_llama(path, num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=97)
    return path


def completions(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, detokenize=False)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, detokenize=False)
    return [o.outputs[0].token_ids for params in (greedy, seeded) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_two_ray_actors_give_the_tokens_of_one_process(local_ray, tiny_llama: Path) -> None:
    kwargs = dict(skip_tokenizer_init=True, dtype="float32", seed=0)
    one = LLM(str(tiny_llama), **kwargs)
    expected = completions(one)
    one.shutdown()

    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **kwargs)
    try:
        assert completions(llm) == expected
        executor = llm.llm_engine.executor
        assert type(executor).__name__ == "RayExecutor"
        assert len(set(executor.pids)) == 2 and os.getpid() not in executor.pids

        os.kill(executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ExecutorDeadError, match=rf"^tensor-parallel rank 1 \(pid {executor.pids[1]}\): its Ray "
                           r"actor died \(.*\); the engine stopped every worker and cannot run more steps$"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=2, detokenize=False), use_tqdm=False)
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{executor.pids[0]}") and time.monotonic() < deadline:
            time.sleep(0.1)  # rank 0's actor is killed too
        assert not os.path.exists(f"/proc/{executor.pids[0]}")
    finally:
        llm.shutdown()
