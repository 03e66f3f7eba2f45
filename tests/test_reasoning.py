"""reasoning_content: the <think> split of chat outputs (cluster/reasoning.py), streamed and whole, and
its switch from the chat template (enable_thinking through chat_template_kwargs)."""

from __future__ import annotations

import asyncio

import pytest

from cluster import openai_api as oa
from cluster import validation
from cluster.reasoning import ThinkSplitter, prompt_opens_reasoning, split_reasoning, template_thinks
from workers.models.make_model import make_model
from workers.models.tokenizer import Tokenizer

CASES = [
    # (output text, starts in reasoning, reasoning_content, content)
    ("<think>\nplan the answer\n</think>\n\nThe answer is 4.", False, "\nplan the answer\n", "The answer is 4."),
    ("plan first</think>\n\nDone.", True, "plan first", "Done."),  # the template opened the block
    ("No thinking here.", False, None, "No thinking here."),
    ("<think>\n\n</think>\n\nQuick.", False, None, "Quick."),  # an empty block, as enable_thinking=false writes
    ("<think>never closed", False, "never closed", ""),
    ("a < b <thi", False, None, "a < b <thi"),  # a partial tag at the end is text
    ("<think>x</think>y <think>z</think>", False, "x", "y <think>z</think>"),  # one reasoning block
]


@pytest.mark.parametrize("text,starts,reasoning,content", CASES)
def test_split_whole_and_streamed_alike(text, starts, reasoning, content):
    assert split_reasoning(text, starts) == (reasoning, content)
    for size in (1, 2, 3, 5, 8):  # tags cut across deltas at every position
        splitter = ThinkSplitter(in_reasoning=starts)
        parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)] + [splitter.finish()]
        got_reasoning, got_content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        assert (got_reasoning if got_reasoning.strip() else None, got_content) == (reasoning, content), size


QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{%- endif %}"
)
R1_LIKE = "{%- for m in messages %}{{ m.content }}{%- endfor %}{%- if add_generation_prompt %}<assistant><think>\n{%- endif %}"


def test_template_switches():
    assert template_thinks(QWEN3_LIKE) and template_thinks(R1_LIKE) and not template_thinks("{{ messages }}")
    assert prompt_opens_reasoning("<assistant><think>\n") and not prompt_opens_reasoning("<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(make_model(tmp_path_factory.mktemp("reasoning") / "tiny", "qwen3_moe", "tiny", seed=0))


def checked(tokenizer, template: str, **body):
    tok = Tokenizer(tokenizer.backend, chat_templates={"default": template}, eos_token_ids=tokenizer.eos_token_ids)
    v = validation.RequestValidator(model_name="m", vocab_size=512, max_model_len=256, tokenizer=tok)
    request = oa.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return asyncio.run(v.chat(request))


def test_validator_decides_how_each_chat_output_is_split(tokenizer):
    assert checked(tokenizer, QWEN3_LIKE).reasoning is False  # the model opens <think> itself
    off = checked(tokenizer, QWEN3_LIKE, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning is False and "<think>\n\n</think>\n\n" in tokenizer.decode(off.prompt)
    assert checked(tokenizer, R1_LIKE).reasoning is True
    assert checked(tokenizer, "{%- for m in messages %}{{ m.content }}{%- endfor %}").reasoning is None  # not a thinking model
    with pytest.raises(oa.APIError, match="cannot be set"):
        checked(tokenizer, QWEN3_LIKE, chat_template_kwargs={"messages": []})


GEMMA4 = "<|channel>thought\nThe user wants a number.<channel|>Four."


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_gemma4_channel_tags_and_label(size):
    """Gemma 4 writes `<|channel>thought\n...<channel|>`: the label is not reasoning; a prompt that closed an
    empty thought block (thinking off) starts as content."""
    from cluster.reasoning import TAGS, template_tags

    assert split_reasoning(GEMMA4, False, "gemma4") == ("The user wants a number.", "Four.")
    splitter = ThinkSplitter(tags=TAGS["gemma4"])
    parts = [splitter.feed(GEMMA4[i : i + size]) for i in range(0, len(GEMMA4), size)] + [splitter.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == ("The user wants a number.", "Four.")
    assert split_reasoning("<|channel>though<channel|>x", False, "gemma4") == ("though", "x")  # no full label: kept
    assert template_tags("{{ '<|channel>thought' }}") == "gemma4" and template_tags("<think>") == "think"
    assert not prompt_opens_reasoning("<|turn>model\n<|channel>thought\n<channel|>", "gemma4")
    assert prompt_opens_reasoning("<|turn>model\n<|channel>thought\n", "gemma4")


# Gemma 4's chat format, reduced to what decides the split: thinking is on only when asked for, and with it
# off the generation prompt closes an empty thought block; calls are written as <|tool_call>...<tool_call|>.
GEMMA4_LIKE = (
    "{%- set think = enable_thinking | default(false) -%}"
    "{%- if think or tools -%}<|turn>system\n{% if think %}<|think|>\n{% endif %}"
    "{%- for t in tools or [] %}<|tool>declaration:{{ t.function.name }}<tool|>{% endfor %}<turn|>\n{%- endif -%}"
    "{%- for m in messages -%}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|turn>model\n{% if not think %}<|channel>thought\n<channel|>{% endif %}{%- endif -%}"
    "{#- calls: <|tool_call>call:NAME{...}<tool_call|> -#}"
)


def test_validator_splits_gemma4_output_by_its_channel_tags_and_keeps_its_markers(tokenizer):
    off = checked(tokenizer, GEMMA4_LIKE)
    assert (off.reasoning, off.reasoning_tags, off.tool_format) == (False, "gemma4", None)
    assert off.params.skip_special_tokens is False  # the markers are special tokens of the real tokenizer
    on = checked(tokenizer, GEMMA4_LIKE, chat_template_kwargs={"enable_thinking": True})
    assert on.reasoning is False and "<|think|>" in tokenizer.decode(on.prompt, skip_special_tokens=False)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    assert checked(tokenizer, GEMMA4_LIKE, tools=[tool]).tool_format == "gemma4"
    assert checked(tokenizer, QWEN3_LIKE).params.skip_special_tokens is True
