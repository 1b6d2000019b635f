"""Incremental detokenization while streaming (``output_kind="delta"``): multi-byte
UTF-8 text never shows a partial character, stop strings that span tokens are cut
(or kept with include_stop_str_in_output), deltas add up to the whole text.

A logits processor forces the model to emit the tokens of a chosen text, so the
streamed tokens are known exactly."""

import pytest
import torch

from vframe import SamplingParams

TEXT = "Hello 你好，世界！I love 🍕 and 🎉🎉. 日本語も大丈夫 👨‍👩‍👧 done"


def forcing(target: list[int], eos: int):
    def force(output_ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[target[len(output_ids)] if len(output_ids) < len(target) else eos] = 0.0
        return out

    return force


def stream(llm, prompt: str, params: SamplingParams):
    """(text deltas, final output) of one streamed request."""
    engine = llm.llm_engine
    request_id = engine.add_request(None, prompt, params)
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.extend(c.text for c in out.outputs)
                final = out
    return deltas, final


@pytest.fixture(scope="module")
def target(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT
    return ids


def params(tokenizer, target, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=len(target) + 5,
        output_kind="delta",
        logits_processors=[forcing(target, tokenizer.eos_token_id)],
        **kw,
    )


def test_multibyte_text_streams_whole_characters(llm_fp32, tokenizer, target):
    # Some characters are split over several tokens: the test means something.
    assert any("\ufffd" in tokenizer.decode([t]) for t in target)
    deltas, final = stream(llm_fp32, "Say something:", params(tokenizer, target))
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert final.finished and final.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        ("世界", False, "Hello 你好，"),
        ("世界", True, "Hello 你好，世界"),
        ("o 你", False, "Hell"),  # spans the end of one word and a split Chinese character
        ("🎉🎉", True, "Hello 你好，世界！I love 🍕 and 🎉🎉"),
        ("not there", False, TEXT),
    ],
)
def test_stop_strings_across_token_boundaries(llm_fp32, tokenizer, target, stop, include, expected):
    deltas, final = stream(
        llm_fp32, "Say something:", params(tokenizer, target, stop=[stop], include_stop_str_in_output=include)
    )
    assert "".join(deltas) == expected
    assert not any("\ufffd" in d for d in deltas)
    comp = final.outputs[0]
    assert comp.finish_reason == "stop"
    assert comp.stop_reason == (None if stop == "not there" else stop)


def test_final_output_equals_the_streamed_text(llm_fp32, tokenizer, target):
    p = params(tokenizer, target)
    p.output_kind = "final"
    [out] = llm_fp32.generate("Say something:", p, use_tqdm=False)
    assert out.outputs[0].text == TEXT and out.outputs[0].token_ids == target + [tokenizer.eos_token_id]
