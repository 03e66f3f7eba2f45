"""Incremental detokenisation for streaming: text deltas that never split a UTF-8 character."""

from __future__ import annotations

from workers.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Decodes the growing output and emits only the new, complete text.

    Byte-level BPE can end a token in the middle of a multi-byte character; decoding then yields U+FFFD.
    We hold such a tail back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # text emitted so far

    def update(self, output_ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens)
        if not final:
            full = full.rstrip("\ufffd")
        if not full.startswith(self.text):
            return ""  # decoding changed earlier text (rare merge effects); wait for a stable prefix
        delta = full[len(self.text) :]
        self.text = full
        return delta
