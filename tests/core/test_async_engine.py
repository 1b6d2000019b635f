"""AsyncLLMEngine: the step loop in its own thread, requests from asyncio."""

from __future__ import annotations

import asyncio

import pytest

from vframe import SamplingParams
from vframe.core.async_engine import AsyncLLMEngine, EngineDeadError, RequestAbortedError
from vframe.core.engine import LLMEngine
from vframe.errors import InvalidRequestError

GREEDY = dict(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def llm_engine() -> LLMEngine:
    return LLMEngine.from_kwargs(dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 * 2**20)


def run(llm_engine: LLMEngine, body) -> object:
    """Run ``body(engine)`` on a started AsyncLLMEngine, then shut it down."""

    async def main():
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def collect(engine: AsyncLLMEngine, request_id: str, prompt, **params) -> tuple[str, list[str], str]:
    """(full text, the deltas, finish reason) of one request."""
    deltas = []
    finish_reason = None
    async for out in engine.generate(request_id, prompt, SamplingParams(output_kind="delta", **params)):
        deltas.append(out.outputs[0].text)
        finish_reason = out.outputs[0].finish_reason or finish_reason
    return "".join(deltas), deltas, finish_reason


def test_deltas_concatenate_to_the_offline_text(llm_engine: LLMEngine):
    async def body(engine):
        return await collect(engine, "a", "The capital of France is", **GREEDY)

    text, deltas, finish_reason = run(llm_engine, body)
    assert text == " Paris.\n\nThe answer is:"
    assert len(deltas) == 8  # one output per generated token
    assert finish_reason == "length"


def test_concurrent_requests_each_get_their_own_outputs(llm_engine: LLMEngine):
    prompts = ["The capital of France is", "1, 2, 3,", "The capital of France is", "Hello"]

    async def body(engine):
        alone = [await collect(engine, f"alone-{i}", p, **GREEDY) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, f"together-{i}", p, **GREEDY) for i, p in enumerate(prompts)))
        return alone, together, engine.stats

    alone, together, stats = run(llm_engine, body)
    assert [t[0] for t in together] == [a[0] for a in alone]
    assert alone[0][0] == alone[2][0] == " Paris.\n\nThe answer is:"
    assert stats["kv_cache_usage"] == 0.0
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_leaving_the_stream_early_aborts_and_frees_kv_blocks(llm_engine: LLMEngine):
    async def body(engine):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind="delta")
        stream = await engine.add_request("long", "Once upon a time", params)
        async with stream:
            async for _ in stream:
                break
        usage_while_running = engine.stats["kv_cache_usage"]
        for _ in range(100):  # the engine thread frees the blocks at its next turn
            if engine.stats["kv_cache_usage"] == 0.0:
                break
            await asyncio.sleep(0.02)
        return usage_while_running, engine.stats, engine.num_in_flight

    usage_while_running, stats, in_flight = run(llm_engine, body)
    assert usage_while_running > 0.0
    assert stats["kv_cache_usage"] == 0.0
    assert stats["num_running"] == 0
    assert in_flight == 0


def test_bad_request_raises_and_the_engine_keeps_serving(llm_engine: LLMEngine):
    async def body(engine):
        with pytest.raises(InvalidRequestError, match="the decoder prompt cannot be empty"):
            await engine.add_request("bad", "", SamplingParams(output_kind="delta"))
        with pytest.raises(InvalidRequestError, match=r"prompt token ids out of range \[0, 49152\)"):
            await engine.add_request("bad", [5, 99999], SamplingParams(output_kind="delta"))
        return await collect(engine, "good", "1, 2, 3,", temperature=0.0, max_tokens=4)

    text, _, _ = run(llm_engine, body)
    assert text == " 4, "


def test_abort_all_ends_streams_with_request_aborted_error(llm_engine: LLMEngine):
    async def body(engine):
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind="delta")
        stream = await engine.add_request("long", "Once upon a time", params)
        received = 0
        with pytest.raises(RequestAbortedError, match="shutting down for the test"):
            async for out in stream:
                received += len(out.outputs[0].token_ids)
                if received == 3:
                    assert engine.abort_all("shutting down for the test") == 1
        return received

    assert run(llm_engine, body) == 3


def test_shutdown_ends_streams_in_flight_and_refuses_new_requests(llm_engine: LLMEngine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, output_kind="delta")
        stream = await engine.add_request("long", "Once upon a time", params)
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(RequestAbortedError, match="the engine shut down"):
            async for _ in stream:
                pass
        assert not llm_engine.has_unfinished_requests()
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "hi", SamplingParams(output_kind="delta"))

    asyncio.run(main())


def test_a_failing_step_fails_every_request_and_refuses_new_ones(llm_engine: LLMEngine, monkeypatch):
    def broken_step():
        raise RuntimeError("out of memory (simulated)")

    async def main():
        dead: list[BaseException] = []
        engine = AsyncLLMEngine(llm_engine, on_dead=dead.append)
        monkeypatch.setattr(llm_engine, "step", broken_step)
        engine.start()
        stream = await engine.add_request("doomed", "Hello", SamplingParams(output_kind="delta"))
        with pytest.raises(EngineDeadError, match="the engine failed: RuntimeError"):
            async for _ in stream:
                pass
        assert not engine.is_running
        assert len(dead) == 1
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", "Hello", SamplingParams(output_kind="delta"))
        await engine.shutdown()

    asyncio.run(main())
    monkeypatch.undo()
    llm_engine.abort_request("doomed")  # leave the shared engine clean
    assert not llm_engine.has_unfinished_requests()


def test_a_model_that_cannot_load_raises_from_load(tmp_path):
    from vframe.core.config import EngineConfig
    from vframe.errors import ModelLoadError

    engine = AsyncLLMEngine(EngineConfig.from_sources(model=str(tmp_path / "missing.gguf")))
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        engine.load()
    assert not engine.is_running
