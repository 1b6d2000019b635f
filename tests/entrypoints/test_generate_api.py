"""The vLLM-style generate API on the real model: prompt forms, n, stops, seeds."""

from vframe import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_prompt_forms_give_the_same_greedy_output(llm_fp32, tokenizer):
    text = "The capital of France is"
    ids = tokenizer(text).input_ids
    params = SamplingParams(max_tokens=6, **GREEDY)
    [a] = llm_fp32.generate(text, params, use_tqdm=False)
    [b] = llm_fp32.generate({"prompt": text}, params, use_tqdm=False)
    [c] = llm_fp32.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert a.prompt == text and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert c.prompt is None
    assert a.outputs[0].text == tokenizer.decode(a.outputs[0].token_ids)
    assert a.outputs[0].finish_reason == "length" and a.finished


def test_outputs_come_back_in_prompt_order_with_per_prompt_params(llm_fp32):
    prompts = ["One", "Two two", "Three three three"]
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in (3, 1, 2)]
    outs = llm_fp32.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 2]


def test_n_completions_with_a_seed_are_distinct_and_reproducible(llm_fp32):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    [first] = llm_fp32.generate("Tell me a story about", params, use_tqdm=False)
    [again] = llm_fp32.generate("Tell me a story about", params, use_tqdm=False)
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3


def test_seeded_request_is_unchanged_by_its_batch(llm_fp32):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    [alone] = llm_fp32.generate("My favourite animal is", seeded, use_tqdm=False)
    others = SamplingParams(temperature=1.3, top_k=20, max_tokens=10, ignore_eos=True)
    outs = llm_fp32.generate(
        ["Hello", "My favourite animal is", "Numbers: 1, 2,"], [others, seeded, others], use_tqdm=False
    )
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_stop_string_ends_the_text_and_is_excluded(llm_fp32):
    params = SamplingParams(max_tokens=40, stop=["Paris"], **GREEDY)
    [out] = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == "Paris"
    assert comp.text == "The capital of France is "


def test_stop_token_id_and_min_tokens(llm_fp32, tokenizer):
    [free] = llm_fp32.generate("The capital of France is", SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    third = free.outputs[0].token_ids[2]
    params = SamplingParams(max_tokens=8, stop_token_ids=[third], **GREEDY)
    [out] = llm_fp32.generate("The capital of France is", params, use_tqdm=False)
    assert out.outputs[0].token_ids == free.outputs[0].token_ids[:3]
    assert out.outputs[0].stop_reason == third
    # min_tokens bans EOS until reached: the chat answer runs past its natural end.
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    [short] = llm_fp32.chat(msg, SamplingParams(temperature=0.0, max_tokens=60), use_tqdm=False)
    n = len(short.outputs[0].token_ids)
    [longer] = llm_fp32.chat(msg, SamplingParams(temperature=0.0, max_tokens=60, min_tokens=n + 5), use_tqdm=False)
    assert len(longer.outputs[0].token_ids) >= n + 5
    assert tokenizer.eos_token_id not in longer.outputs[0].token_ids[: n + 4]


def test_logprobs_have_vllm_shape(llm_fp32):
    [out] = llm_fp32.generate("The capital of France is", SamplingParams(max_tokens=3, logprobs=2, **GREEDY), use_tqdm=False)
    comp = out.outputs[0]
    assert len(comp.logprobs) == 3
    for token_id, step in zip(comp.token_ids, comp.logprobs):
        assert token_id in step and step[token_id].rank == 1  # greedy: the top token
        assert len(step) == 2  # chosen (also the top-1) + the second most likely
        assert sorted(lp.rank for lp in step.values()) == [1, 2]
    assert comp.cumulative_logprob == sum(s[t].logprob for t, s in zip(comp.token_ids, comp.logprobs))


def test_skip_tokenizer_init_takes_token_ids():
    from vframe import LLM

    llm = LLM(dtype="float32", skip_tokenizer_init=True, num_threads=2)
    [out] = llm.generate({"prompt_token_ids": [1, 504, 3575, 282, 4649, 314]}, SamplingParams(max_tokens=4, **GREEDY), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
