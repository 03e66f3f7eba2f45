"""Reasoning content: the text a thinking model writes between `<think>` and `</think>` goes to the chat
response's `reasoning_content` (streamed as `delta.reasoning_content`), the rest to `content`, as vLLM's
reasoning parsers do for Qwen3 and DeepSeek-R1.

Whether a request is parsed this way follows its chat template: a template that mentions the start tag
is a thinking model's. Where the rendered prompt itself ends inside an open `<think>` (DeepSeek-R1, and
Qwen3 thinking templates that open the block for the model), the output starts as reasoning; where the
template closed an empty block (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`) or never
opened one, it starts as content and switches only on a `<think>` the model writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

START, END = "<think>", "</think>"


def template_thinks(template: str | None) -> bool:
    """A chat template that writes think tags: its model's output is split into reasoning and content."""
    return bool(template) and START in template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """The rendered prompt ends inside an unclosed `<think>`: the model's output begins as reasoning."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


@dataclass
class ThinkSplitter:
    """Splits streamed text into (reasoning, content) deltas. A tag cut across two deltas is held back
    until it is complete, and the newlines after `</think>` are dropped wherever they arrive, so the
    concatenated deltas equal the split of the whole text."""

    in_reasoning: bool = False
    _held: str = field(default="", repr=False)
    _done_thinking: bool = field(default=False, repr=False)  # one reasoning block per response
    _after_end: bool = field(default=False, repr=False)  # content so far is only the newlines after </think>

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        reasoning, content = [], []
        while text:
            if not self.in_reasoning and self._done_thinking:
                content.append(self._content(text))
                break
            tag = END if self.in_reasoning else START
            at = text.find(tag)
            if at < 0:
                keep = partial_tag_suffix(text, tag)
                head, self._held = text[: len(text) - keep], text[len(text) - keep :]
                if self.in_reasoning:
                    reasoning.append(head)
                else:
                    content.append(self._content(head))
                break
            if self.in_reasoning:
                reasoning.append(text[:at])
                self._done_thinking = self._after_end = True
            else:
                content.append(self._content(text[:at]))
            self.in_reasoning = not self.in_reasoning
            text = text[at + len(tag) :]
        return "".join(reasoning), "".join(content)

    def _content(self, text: str) -> str:
        if self._after_end:
            text = text.lstrip("\n")
            self._after_end = not text
        return text

    def finish(self) -> tuple[str, str]:
        """Whatever is held back at the end of the output (an incomplete tag is just text)."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", self._content(held))


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole output."""
    splitter = ThinkSplitter(in_reasoning=starts_in_reasoning)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    reasoning = r1 + r2
    return (reasoning if reasoning.strip() else None), (c1 + c2)


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
