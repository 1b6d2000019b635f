"""vLLM's ``AsyncLLM`` example (``examples/offline_inference/async_llm_streaming.py``)
in its vLLM form, only the imports and the model changed, on the embedded SmolLM2:
DELTA outputs that add up to what ``LLM.generate`` gives, CUMULATIVE outputs that
grow, a stream left early that aborts its request, and a clean shutdown."""

from __future__ import annotations

import asyncio

import pytest

from vframe import SamplingParams  # vLLM: from vllm import SamplingParams
from vframe.engine.arg_utils import AsyncEngineArgs  # vLLM: from vllm.engine.arg_utils import AsyncEngineArgs
from vframe.sampling_params import RequestOutputKind  # vLLM: from vllm.sampling_params import RequestOutputKind
from vframe.v1.engine.async_llm import AsyncLLM  # vLLM: from vllm.v1.engine.async_llm import AsyncLLM

PROMPTS = ["The future of artificial intelligence is", "In a galaxy far, far away", "The key to happiness is"]


async def stream_response(engine: AsyncLLM, prompt: str, request_id: str) -> list[str]:
    sampling_params = SamplingParams(
        max_tokens=24,  # vLLM's example: 100
        temperature=0.8,
        top_p=0.95,
        seed=42,
        output_kind=RequestOutputKind.DELTA,
    )
    pieces = []
    async for output in engine.generate(request_id=request_id, prompt=prompt, sampling_params=sampling_params):
        for completion in output.outputs:
            if completion.text:
                pieces.append(completion.text)
        if output.finished:
            break
    return pieces


async def main() -> tuple[list[list[str]], list[str], str]:
    engine_args = AsyncEngineArgs(
        model=None,  # vLLM's example: "meta-llama/Llama-3.2-1B-Instruct"; None is vframe's embedded SmolLM2
        enforce_eager=True,
        dtype="float32",  # so that the texts are comparable with the shared float32 LLM
    )
    engine = AsyncLLM.from_engine_args(engine_args)
    try:
        streamed = [await stream_response(engine, p, f"stream-example-{i}") for i, p in enumerate(PROMPTS, 1)]

        cumulative = SamplingParams(max_tokens=6, temperature=0, output_kind=RequestOutputKind.CUMULATIVE)
        texts = [o.outputs[0].text async for o in engine.generate(PROMPTS[0], cumulative, "cumulative")]

        # Leaving a stream early aborts its request; the engine serves the next one.
        long = SamplingParams(max_tokens=200, temperature=0, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
        async for _ in engine.generate(PROMPTS[1], long, "left-early"):
            break
        await asyncio.sleep(0.2)
        assert engine.engine.num_in_flight == 0
        final = [o async for o in engine.generate(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0), "final")]
        assert len(final) == 1 and final[0].finished  # vframe's default output_kind: the final output only
        tokenizer = await engine.get_tokenizer()
        assert tokenizer.decode(final[0].outputs[0].token_ids) == final[0].outputs[0].text
        await engine.check_health()
    finally:
        engine.shutdown()
    assert not engine.is_running
    return streamed, texts, final[0].outputs[0].text


def test_async_llm_streaming_example(llm_fp32) -> None:
    streamed, cumulative, final = asyncio.run(main())
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=42)
    expected = [o.outputs[0].text for o in llm_fp32.generate(PROMPTS, params, use_tqdm=False)]
    assert ["".join(pieces) for pieces in streamed] == expected
    assert all(len(pieces) > 1 for pieces in streamed)  # streamed in pieces, not at the end

    greedy6 = llm_fp32.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert cumulative[-1] == greedy6[0].outputs[0].text
    assert all(later.startswith(earlier) for earlier, later in zip(cumulative, cumulative[1:]))
    assert len(cumulative) == 6
    greedy4 = llm_fp32.generate(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert final == greedy4[0].outputs[0].text


def test_a_shut_down_engine_refuses_requests() -> None:
    from vframe.core.async_engine import EngineDeadError

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(dtype="float32", num_threads=1))
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="the engine is not running"):
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=2), "after-shutdown"):
                pass

    asyncio.run(run())


def test_vllms_older_names_are_the_same_objects() -> None:
    import vframe
    from vframe.engine.async_llm_engine import AsyncLLMEngine

    assert vframe.AsyncLLMEngine is AsyncLLMEngine is AsyncLLM
    assert vframe.AsyncEngineArgs is AsyncEngineArgs
