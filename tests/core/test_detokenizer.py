"""The incremental detokenizer on SmolLM2's byte-level BPE: whole characters only,
stop strings found across token boundaries."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vframe.core.detokenizer import IncrementalDetokenizer

# Latin, accents, CJK, emoji (4-byte, with joiners and modifiers), spaces and newlines.
ALPHABET = st.sampled_from(list("ab xyZ.,é\nçö你好世界中文日本語한국어") + ["🍕", "🎉", "👍🏽", "👨‍👩‍👧", "∑", "€"])
PROMPT = [1, 504, 3575]


def stream(tokenizer, ids, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, PROMPT, **kw)
    deltas = []
    for token_id in ids:
        before = len(detok.output_text)
        detok.update([token_id])
        deltas.append(detok.output_text[before:])
    return deltas, detok


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(ALPHABET, min_size=1, max_size=30).map("".join))
def test_deltas_are_whole_characters_and_add_up(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _ = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_a_character_split_over_tokens_appears_once_complete(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # one emoji, several byte tokens
    deltas, _ = stream(tokenizer, ids)
    assert deltas == [""] * (len(ids) - 1) + ["🎉"]


def test_stop_string_spanning_tokens(tokenizer):
    ids = tokenizer.encode("Hello 你好，世界！", add_special_tokens=False)
    for include, expected in ((False, "Hello 你"), (True, "Hello 你好，世")):
        detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["好，世"], include_stop_str_in_output=include)
        for n, token_id in enumerate(ids, 1):
            if detok.update([token_id]) is not None:  # the engine stops the request here
                break
        assert detok.output_text == expected
        assert "世" in tokenizer.decode(ids[:n]) and "世" not in tokenizer.decode(ids[: n - 1])


def test_unfinished_text_holds_back_a_possible_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, PROMPT, stop=["STOP"])
    detok.update(tokenizer.encode("abc ST", add_special_tokens=False))
    assert detok.get_next_output_text(finished=False, delta=True) == "abc"  # "ST" may start "STOP"
    detok.update(tokenizer.encode("AY", add_special_tokens=False))
    assert detok.get_next_output_text(finished=True, delta=True) == " STAY"
