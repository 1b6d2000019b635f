"""What batching may change, per dtype (docs/decoding.md, "Batch independence").

float32: a request's greedy and seeded tokens do not depend on what else is in the
batch. bfloat16: they may (measured: 4 of these 6 greedy prompts differ alone vs
batched within 32 tokens), but the same batch gives the same tokens every time."""

import pytest
from test_engine_invariance import PROMPTS

from vframe import SamplingParams

GREEDY = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(PROMPTS)
SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(6)]


def token_ids(llm, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_float32_tokens_are_the_same_alone_and_batched(llm_fp32, params):
    batched = token_ids(llm_fp32, PROMPTS, params)
    alone = [token_ids(llm_fp32, [prompt], [p])[0] for prompt, p in zip(PROMPTS, params)]
    assert alone == batched


@pytest.fixture(scope="module")
def llm_bf16():
    from vframe import LLM

    return LLM(dtype="bfloat16", max_model_len=1024, num_threads=2)


# Slow marker: in one full `make test` run (after the server tests) the second call
# returned token 0 runs (NaN logits) while it passes alone and after tests/core. A
# likely cause is fixed since: the torch backend's decode gathered whole blocks and
# let NaN in unwritten slots through the mask (0 * NaN), found by the attention
# conformance kit. It stays in `make test-slow` until full runs show it gone.
@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_bfloat16_same_batch_gives_the_same_tokens(llm_bf16, params):
    first = token_ids(llm_bf16, PROMPTS, params)
    assert token_ids(llm_bf16, PROMPTS, params) == first
    assert token_ids(llm_bf16, PROMPTS[:1], params[:1]) == token_ids(llm_bf16, PROMPTS[:1], params[:1])
