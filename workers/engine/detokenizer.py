"""Incremental detokenisation for streaming: text deltas that never split a UTF-8 character, at a cost per
token independent of the output's length.

Decoding a token alone is not enough (byte-level BPE can end a token in the middle of a multi-byte
character, and some tokenizers render a token differently after a neighbour), and decoding the whole
output every token costs O(n) per token. So, like vLLM's and TGI's incremental detokenisers, each token
decodes a short window: the tokens from `prefix_offset` (a few tokens of context already emitted) to the
end, and emits what that text adds to the window's already-emitted part (`prefix_offset:read_offset`).
A window ending in an incomplete character (U+FFFD) is held back until a later token completes it.
"""

from __future__ import annotations

from workers.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces: list[str] = []  # the text emitted so far, in the deltas it was emitted in
        self.num_chars = 0  # len(self.text)
        self.prefix_offset = 0  # the window's first token (context whose text is already emitted)
        self.read_offset = 0  # tokens whose text has been emitted

    @property
    def text(self) -> str:
        """The text emitted so far. Joined when read (then kept joined): the per-token path reads only `tail`,
        so a long output is not copied for every token."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @text.setter
    def text(self, value: str) -> None:
        self._pieces = [value] if value else []
        self.num_chars = len(value)

    def tail(self, n: int) -> str:
        """The last `n` characters emitted (fewer if there are fewer), at a cost that depends on n only."""
        if n <= 0:
            return ""
        parts, have = [], 0
        for piece in reversed(self._pieces):
            parts.append(piece)
            have += len(piece)
            if have >= n:
                break
        return "".join(reversed(parts))[-n:]

    def replace_tail(self, n: int, text: str) -> None:
        """The last `n` characters replaced by `text` (a stop condition trimming the output's end)."""
        full = self.text
        self.text = full[: len(full) - n] + text

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """The new text of `output_ids` (the whole output so far; only its tail is decoded)."""
        if self.tokenizer is None:
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(output_ids[self.prefix_offset : self.read_offset])
        new_text = decode(output_ids[self.prefix_offset :])
        if not final and (new_text.endswith("\ufffd") or len(new_text) <= len(prefix_text)):
            return ""  # an incomplete character, or nothing visible yet: wait for the next token
        if not new_text.startswith(prefix_text):
            return ""  # decoding changed the window's earlier text (rare merge effects); wait
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        self._pieces.append(delta)
        self.num_chars += len(delta)
        return delta
