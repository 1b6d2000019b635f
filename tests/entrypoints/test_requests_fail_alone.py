"""A bad request fails alone: the engine keeps serving the others (issue 9 items 3, 5, 6, 7).

Each case used to give wrong tokens, or to raise out of ``engine.step()`` and so
end every request in flight (in the server: the engine thread died, exit 1).
"""

from __future__ import annotations

import pytest

from vframe import SamplingParams
from vframe.core.sampling_params import StructuredOutputsParams
from vframe.errors import InvalidRequestError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin

GREEDY = dict(temperature=0.0, max_tokens=6)


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(llm_fp32) -> list[int]:
    return run(llm_fp32, ["The capital of France is"], SamplingParams(**GREEDY))[0].outputs[0].token_ids


def test_a_raising_logits_processor_fails_only_its_request(llm_fp32, reference):
    def boom(output_ids, logits):
        if len(output_ids) == 2:
            raise ValueError("processor bug")
        return logits

    outs = run(
        llm_fp32,
        ["The capital of France is", "Hello"],
        [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logits_processors=[boom])],
    )
    assert outs[0].outputs[0].token_ids == reference
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 2
    assert str(bad.error) == "a logits processor failed: ValueError: processor bug"
    assert bad.error.caused_by_request is False
    assert llm_fp32.llm_engine.kv_cache_manager.usage == 0.0
    # The same prompt again: correct tokens, whatever the cache holds.
    assert run(llm_fp32, ["The capital of France is"], SamplingParams(**GREEDY))[0].outputs[0].token_ids == reference


def test_a_processor_returning_garbage_fails_its_request(llm_fp32, reference):
    outs = run(
        llm_fp32,
        ["The capital of France is", "Hello"],
        [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logits_processors=[lambda ids, logits: None])],
    )
    assert outs[0].outputs[0].token_ids == reference
    assert outs[1].outputs[0].finish_reason == "error"
    assert "TypeError: it returned NoneType , not a [V] tensor" in str(outs[1].outputs[0].error)


def test_grammar_complete_before_min_tokens_stops_instead_of_emitting_token_0(llm_fp32):
    """choice + min_tokens=6 used to give [94, 95, 0, 0, 0, 0, 2]: with EOS banned by
    min_tokens and everything else banned by the grammar, argmax of -inf is 0."""
    params = SamplingParams(
        temperature=0.0, max_tokens=10, min_tokens=6,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    out = run(llm_fp32, ["Is Paris in France? Answer yes or no:"], params)[0].outputs[0]
    assert out.text in ("yes", "no")
    assert 0 not in out.token_ids
    assert out.finish_reason == "stop"


def test_constraints_that_exclude_every_token_fail_as_the_clients_error(llm_fp32, tokenizer, reference):
    word_id = tokenizer.encode("hello", add_special_tokens=False)
    assert len(word_id) == 1
    params = SamplingParams(**GREEDY, allowed_token_ids=word_id, bad_words=["hello"])
    outs = run(llm_fp32, ["The capital of France is", "Say hello"], [SamplingParams(**GREEDY), params])
    assert outs[0].outputs[0].token_ids == reference
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error.caused_by_request is True
    assert str(bad.error).startswith("no token is allowed at this position")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # Each of these used to pass validation and break the step that built its tensors.
        (dict(stop_token_ids=[99999999], min_tokens=2), r"stop_token_ids has token ids out of range \[0, 49152\)"),
        (dict(logprobs=50000), r"logprobs=50000 is too large: this engine returns at most 20"),
        (dict(prompt_logprobs=21), r"prompt_logprobs=21 is too large"),
        (dict(logit_bias={5: 1e39}), r"logit_bias=\{5: 1e\+39\} is invalid"),
        (dict(top_k=2**63), r"top_k=9223372036854775808 is invalid"),
    ],
)
def test_out_of_range_values_are_refused_at_add_request(llm_fp32, params, message):
    engine = llm_fp32.llm_engine
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", "Hi", SamplingParams(max_tokens=4, **params))
    assert not engine.has_unfinished_requests()


def test_the_largest_seed_with_n_2_wraps_for_the_second_completion(llm_fp32):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=2**64 - 1, n=2)
    out = run(llm_fp32, ["Hi"], params)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    # completion 1 is seeded with 0, exactly as a request with seed=0
    alone = run(llm_fp32, ["Hi"], SamplingParams(max_tokens=3, temperature=1.0, seed=0))[0]
    assert out.outputs[1].token_ids == alone.outputs[0].token_ids


def test_child_ids_never_collide_with_user_ids(llm_fp32):
    engine = llm_fp32.llm_engine
    engine.add_request("x", "Hi", SamplingParams(max_tokens=2, temperature=1.0, n=2))
    with pytest.raises(InvalidRequestError, match="request_id '0_x' is already in use"):
        engine.add_request("0_x", "Hi", SamplingParams(max_tokens=2))
    engine.add_request("1_y", "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="needs the id '1_y' for one of its completions"):
        engine.add_request("y", "Hi", SamplingParams(max_tokens=2, temperature=1.0, n=2))
    engine.abort_request(["x", "x", "1_y", "1_y", "never-added"])  # repeats used to raise KeyError
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0


class _ExitingStepHook:
    @hookimpl
    def vframe_engine_step(self, engine, num_scheduled_tokens, elapsed_s):
        raise SystemExit(3)


def test_a_plugin_raising_systemexit_in_a_step_hook_does_not_stop_the_engine(llm_fp32, reference):
    register_plugin(_ExitingStepHook(), name="exits-in-step")
    try:
        out = run(llm_fp32, ["The capital of France is"], SamplingParams(**GREEDY))[0]
    finally:
        unregister_plugin("exits-in-step")
    assert out.outputs[0].token_ids == reference
    from vframe.plugins import plugin_failures

    assert any(
        f.plugin == "exits-in-step" and "vframe_engine_step raised SystemExit: 3; hook disabled" in f.error
        for f in plugin_failures()
    )
