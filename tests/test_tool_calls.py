"""Tool-call parsing per format (whole and streamed alike) and the grammar that forces a call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.tool_calls import ToolCallStream, forced_call_grammar, format_for_template, parse
from workers.engine.sampling_params import StructuredOutputs
from workers.engine.structured import GrammarCompiler
from workers.models.make_model import make_model
from workers.models.tokenizer import Tokenizer

QWEN = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
DEEPSEEK = (
    "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n```'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
GEMMA4 = 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_call>call:add{a:1,b:2}<tool_call|>'
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize(
    "fmt,text,content", [("qwen", QWEN, "Let me check.\n"), ("deepseek", DEEPSEEK, "Checking."), ("gemma4", GEMMA4, "Checking.")]
)
def test_parse_whole_and_streamed(fmt, text, content):
    got_content, calls = parse(text, fmt)
    assert got_content.strip() == content.strip()
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    for size in (1, 3, 7):
        stream = ToolCallStream(fmt)
        shown, calls_seen = "", []
        for i in range(0, len(text), size):
            shown += stream.feed(text[i : i + size])
            calls_seen += [call for _, call in stream.new_calls()]
        shown += stream.finish()
        assert shown.strip() == content.strip() and [(c.name, json.loads(c.arguments)) for c in calls_seen] == EXPECTED


def test_text_that_only_looks_like_a_call_stays_content():
    for text in (
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        "a <tool_ca",
        '<tool_call>\n{"name": "f"',
    ):
        content, calls = parse(text, "qwen")
        assert calls == [] and content == text


def test_arguments_given_as_a_string_are_parsed():
    _, (call,) = parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>', "qwen")
    assert json.loads(call.arguments) == {"x": 1}


def test_format_from_template():
    assert format_for_template("...<tool_call>...") == "qwen"
    assert format_for_template("...<｜tool▁calls▁begin｜>...") == "deepseek"
    assert format_for_template("...<|tool_call>call:...") == "gemma4"
    assert format_for_template("{{ messages }}") is None and format_for_template(None) is None


def test_gemma4_argument_syntax_becomes_json():
    """Gemma 4's values as vLLM's parser reads them: quoted strings (commas and braces inside stay text),
    numbers, booleans, null, nested objects and lists; a malformed call stays content."""
    text = '<|tool_call>call:f.x-y{s:<|"|>a, {b}<|"|>,i:-3,f:2.5,t:true,n:null,o:{k:[1,<|"|>z<|"|>,{q:false}]},e:[]}<tool_call|>'
    _, (call,) = parse(text, "gemma4")
    assert call.name == "f.x-y"
    assert json.loads(call.arguments) == {
        "s": "a, {b}",
        "i": -3,
        "f": 2.5,
        "t": True,
        "n": None,
        "o": {"k": [1, "z", {"q": False}]},
        "e": [],
    }
    for bad in ('<|tool_call>call:f{a:<|"|>open}<tool_call|>', "<|tool_call>call:f{a:[1,2}<tool_call|>", "<|tool_call>f{a:1}<tool_call|>"):
        assert parse(bad, "gemma4") == (bad, [])


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
]


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    tok = Tokenizer.from_dir(make_model(tmp_path_factory.mktemp("tools") / "tiny", "qwen3_moe", "tiny", seed=0))
    return tok, GrammarCompiler(tok, 512, tok.eos_token_ids)


def consumes(compiler, grammar: str, text: str) -> bool:
    tok, c = compiler
    state = c.new_state(StructuredOutputs(kind="lark", value=grammar))
    return all(state.accept(t) for t in tok.encode(text, add_special_tokens=False))


def test_forced_grammar_admits_only_calls_of_the_chosen_tools(compiler):
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"c"}}\n</tool_call>'
    required = forced_call_grammar(TOOLS, "required", parallel=False, fmt="qwen")
    assert consumes(compiler, required, call)
    assert not consumes(compiler, required, "Hello")
    assert not consumes(compiler, required, call.replace('"c"', '"k"'))  # the arguments follow the schema
    named = forced_call_grammar(TOOLS, {"type": "function", "function": {"name": "add"}}, parallel=False, fmt="qwen")
    assert not consumes(compiler, named, call) and consumes(
        compiler, named, '<tool_call>\n{"name":"add","arguments":{"a":3}}\n</tool_call>'
    )
    content, (parsed,) = parse(call, "qwen")
    jsonschema.validate(json.loads(parsed.arguments), TOOLS[0]["function"]["parameters"])
    with pytest.raises(ValueError, match="unknown tool call format"):
        forced_call_grammar(TOOLS, "required", parallel=False, fmt="llama")


def test_forced_grammar_for_the_deepseek_format(compiler):
    call = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city":"Oslo","unit":"f"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    grammar = forced_call_grammar(TOOLS, "required", parallel=False, fmt="deepseek")
    assert consumes(compiler, grammar, call)
    assert not consumes(compiler, grammar, call.replace('"f"', '"x"')) and not consumes(compiler, grammar, "Sure")
    _, (parsed,) = parse(call, "deepseek")
    jsonschema.validate(json.loads(parsed.arguments), TOOLS[0]["function"]["parameters"])
    # A tokenizer with the markers as special tokens gets them asked for by id.
    ids = {"<｜tool▁calls▁begin｜>": 9001, "<｜tool▁calls▁end｜>": 9002}
    assert "<[9001]>" in forced_call_grammar(TOOLS, "required", False, "deepseek", token_id=ids.get)


def test_forced_grammar_for_the_gemma4_format(compiler):
    """The function's own keys, required ones first, in Gemma 4's value syntax."""
    call = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,unit:<|"|>c<|"|>}<tool_call|>'
    grammar = forced_call_grammar(TOOLS, "required", parallel=True, fmt="gemma4")
    assert consumes(compiler, grammar, call) and consumes(compiler, grammar, call + call)
    assert not consumes(compiler, grammar, call.replace("city", "town")) and not consumes(compiler, grammar, "Sure")
    assert not consumes(compiler, grammar, '<|tool_call>call:get_weather{unit:<|"|>c<|"|>}<tool_call|>')  # city is required
    named = forced_call_grammar(TOOLS, {"type": "function", "function": {"name": "add"}}, parallel=False, fmt="gemma4")
    assert consumes(compiler, named, "<|tool_call>call:add{a:3}<tool_call|>") and consumes(
        compiler, named, "<|tool_call>call:add{}<tool_call|>"
    )
    assert not consumes(compiler, named, call)
    _, (parsed,) = parse(call, "gemma4")
    jsonschema.validate(json.loads(parsed.arguments), TOOLS[0]["function"]["parameters"])
    ids = {'<|"|>': 52, "<|tool_call>": 48, "<tool_call|>": 49}
    assert "<[48]>" in forced_call_grammar(TOOLS, "required", False, "gemma4", token_id=ids.get)


@pytest.mark.parametrize("size", [1, 2, 5, 100])
def test_a_streamed_call_sends_no_whitespace_content_around_it(size):
    """A forced (named) call's output starts and ends with newlines around the call: streamed, no content
    delta is sent at all (the stray "\\n" before the call was one); plain text keeps its whitespace."""
    call = '\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    stream = ToolCallStream("qwen")
    pieces = [stream.feed(call[i : i + size]) for i in range(0, len(call), size)] + [stream.finish()]
    assert [p for p in pieces if p] == [] and [c.name for _, c in stream.new_calls()] == ["add"]
    text = "Hello \n there \n\n"
    stream = ToolCallStream("qwen")
    shown = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size)) + stream.finish()
    assert shown == text and stream.calls == []
