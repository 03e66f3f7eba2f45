"""Reasoning content: the text a thinking model writes between `<think>` and `</think>` goes to the chat
response's `reasoning_content` (streamed as `delta.reasoning_content`), the rest to `content`, as vLLM's
reasoning parsers do for Qwen3 and DeepSeek-R1. Gemma 4 writes `<|channel>thought\n...<channel|>` instead
(special tokens: its requests are decoded with them, `validation.py`); the `thought\n` label is no reasoning.

Whether a request is parsed this way follows its chat template: a template that mentions the start tag
is a thinking model's. Where the rendered prompt itself ends inside an open `<think>` (DeepSeek-R1, and
Qwen3 thinking templates that open the block for the model), the output starts as reasoning; where the
template closed an empty block (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`) or never
opened one, it starts as content and switches only on a `<think>` the model writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Tags:
    start: str
    end: str
    label: str = ""  # written right after `start`, not part of the reasoning (Gemma 4's "thought\n")


TAGS = {"think": Tags(START, END), "gemma4": Tags("<|channel>", "<channel|>", "thought\n")}


def template_tags(template: str | None) -> str | None:
    """The reasoning tags a chat template writes (a key of TAGS), or None for a model that does not think."""
    if not template:
        return None
    if TAGS["gemma4"].start in template:
        return "gemma4"
    return "think" if START in template else None


def template_thinks(template: str | None) -> bool:
    """A chat template that writes reasoning tags: its model's output is split into reasoning and content."""
    return template_tags(template) is not None


def prompt_opens_reasoning(prompt_text: str, tags: str = "think") -> bool:
    """The rendered prompt ends inside an unclosed reasoning block: the model's output begins as reasoning."""
    t = TAGS[tags]
    return prompt_text.rfind(t.start) > prompt_text.rfind(t.end)


@dataclass
class ThinkSplitter:
    """Splits streamed text into (reasoning, content) deltas. A tag cut across two deltas is held back
    until it is complete, and the newlines after `</think>` are dropped wherever they arrive, so the
    concatenated deltas equal the split of the whole text."""

    in_reasoning: bool = False
    tags: Tags = TAGS["think"]
    _held: str = field(default="", repr=False)
    _label_due: bool = field(default=False, repr=False)  # just entered reasoning: the label may follow
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
            if self.in_reasoning and self._label_due:
                label = self.tags.label
                if len(text) < len(label) and label.startswith(text):
                    self._held = text  # maybe the label, cut across deltas
                    break
                self._label_due = False
                if text.startswith(label):
                    text = text[len(label) :]
                    continue
            tag = self.tags.end if self.in_reasoning else self.tags.start
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
                self._label_due = bool(self.tags.label)
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


def split_reasoning(text: str, starts_in_reasoning: bool = False, tags: str = "think") -> tuple[str | None, str]:
    """(reasoning_content or None, content) of a whole output."""
    splitter = ThinkSplitter(in_reasoning=starts_in_reasoning, tags=TAGS[tags])
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
