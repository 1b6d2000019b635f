"""Incremental detokenization with stop strings.

Text is decoded over a small window of token ids::

    ids   | ... context ... | done tokens | new |
                  prefix_offset ^    read_offset ^

``decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])`` is the
new text. A window that ends in U+FFFD is an incomplete UTF-8 character (a
multi-byte character split over tokens): nothing is emitted until it completes.
"""

from __future__ import annotations

# Prompt tokens kept as left context so that the first output token decodes
# with the right leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self._num_sent = 0  # characters already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def update(self, new_token_ids: list[int], stop_checked: bool = True) -> str | None:
        """Decode the new tokens; return the stop string that ended the text, if any."""
        start = len(self.output_text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self.output_text += new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
        if self.stop and stop_checked:
            return self._check_stop_strings(start)
        return None

    def _check_stop_strings(self, start: int) -> str | None:
        for stop in self.stop:
            # A stop string may straddle the old text and the new delta.
            idx = self.output_text.find(stop, max(0, start - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.include_stop_str_in_output else idx
                self.output_text = self.output_text[:end]
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text so far, or only what is new since the last call when ``delta``.

        While unfinished, the last ``len(longest stop) - 1`` characters are held
        back: they might be the start of a stop string that must not be shown."""
        length = len(self.output_text)
        if not finished and self.stop and not self.include_stop_str_in_output:
            length -= max(len(s) for s in self.stop) - 1
        length = max(length, self._num_sent)
        if not delta:
            return self.output_text[:length]
        text = self.output_text[self._num_sent : length]
        self._num_sent = length
        return text
