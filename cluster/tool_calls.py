"""Tool calling: the model's tool-call syntax parsed into OpenAI `tool_calls`, and the grammar that forces
a call for `tool_choice: "required"` or a named function.

Formats (chosen from the chat template, or `server.tool_call_parser`):
- "qwen" (Qwen3, Qwen3.5, Hermes style): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call;
- "deepseek" (DeepSeek-V3): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n
  {...}\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- "gemma4" (Gemma 4): `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,flag:true,obj:{...},list:[...]}<tool_call|>`,
  one block per call, back to back: bare keys, strings between `<|"|>` quote tokens, other values bare
  (true/false/null, numbers); arguments become JSON as vLLM's and SGLang's Gemma 4 parsers make them.

Streaming: text before a call streams as content; a call is held back until its block is complete and
then sent as one `tool_calls` delta (index, id, name and the whole arguments string), which the OpenAI
client reassembles exactly like incremental argument deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .reasoning import partial_tag_suffix

FORMATS = ("qwen", "deepseek", "gemma4")

_QWEN_START, _QWEN_END = "<tool_call>", "</tool_call>"
_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_G4_START, _G4_END, _G4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_G4_CALL = re.compile(r"call:(?P<name>[\w\-\.]+)\{(?P<args>.*)\}", re.S)
_DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*?)\n```<｜tool▁call▁end｜>", re.S
)


def format_for_template(template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None if it has no tools."""
    if not template:
        return None
    if "tool▁calls▁begin" in template or "tool▁call▁begin" in template:
        return "deepseek"
    if _G4_START in template:
        return "gemma4"
    if _QWEN_START in template:
        return "qwen"
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def parse(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole output. Text that only looks like a call (bad JSON, no name) is
    left in the content."""
    parser = ToolCallStream(fmt)
    content = parser.feed(text) + parser.finish()
    return content, parser.calls


class ToolCallStream:
    """Incremental parsing: `feed(delta)` returns the content that can be shown now; complete calls are
    appended to `calls` (and `new_calls()` returns those not yet taken)."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self._taken = 0
        self._buffer = ""  # text from a possible call start on
        # Whitespace at the end of the content shown so far, held back: a call may follow it, and whitespace
        # around calls is not content (the non-streamed response strips it too). Sent with the next text.
        self._space = ""

    @property
    def _start(self) -> str:
        return {"qwen": _QWEN_START, "deepseek": _DS_BEGIN, "gemma4": _G4_START}[self.fmt]

    @property
    def _end(self) -> str:
        return {"qwen": _QWEN_END, "deepseek": _DS_END, "gemma4": _G4_END}[self.fmt]

    def feed(self, text: str) -> str:
        self._buffer += text
        shown: list[str] = []
        while self._buffer:
            at = self._buffer.find(self._start)
            if at < 0:
                keep = partial_tag_suffix(self._buffer, self._start)
                self._show(self._buffer[: len(self._buffer) - keep], shown)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            self._show(self._buffer[:at], shown)
            self._buffer = self._buffer[at:]
            end = self._buffer.find(self._end, len(self._start))
            if end < 0:
                break  # a call in progress: hold it back
            block = self._buffer[: end + len(self._end)]
            self._buffer = self._buffer[end + len(self._end) :]
            calls = self._parse_block(block)
            if calls is None:
                self._show(block, shown)  # not a valid call: it was text after all
            else:
                self.calls.extend(calls)
                self._space = ""  # whitespace before a call is not content
        return "".join(shown)

    def _show(self, text: str, shown: list[str]) -> None:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if body:
            shown.append(body)

    def finish(self) -> str:
        """The end of the output: an unfinished call is returned as text; whitespace held back is content
        only if no call came."""
        rest, self._buffer = self._buffer, ""
        space, self._space = self._space, ""
        if rest:
            return space + rest
        return "" if self.calls else space

    def new_calls(self) -> list[tuple[int, ToolCall]]:
        out = list(enumerate(self.calls))[self._taken :]
        self._taken = len(self.calls)
        return out

    def _parse_block(self, block: str) -> list[ToolCall] | None:
        if self.fmt == "qwen":
            body = block[len(_QWEN_START) : -len(_QWEN_END)].strip()
            call = _call_from_json(body)
            return None if call is None else [call]
        if self.fmt == "gemma4":
            m = _G4_CALL.fullmatch(block[len(_G4_START) : -len(_G4_END)].strip())
            args = None if m is None else gemma4_arguments(m.group("args"))
            return None if args is None else [ToolCall(m.group("name"), json.dumps(args, ensure_ascii=False))]
        calls = []
        for m in _DS_CALL.finditer(block):
            try:
                args = json.loads(m.group("args"))
            except json.JSONDecodeError:
                return None
            calls.append(ToolCall(m.group("name").strip(), json.dumps(args, ensure_ascii=False)))
        return calls or None


def gemma4_arguments(text: str) -> dict[str, Any] | None:
    """The members of a Gemma 4 call's `{...}` (without the braces) as a dict; None if malformed."""
    try:
        value, end = _g4_members(text, 0, "")
    except ValueError:
        return None
    return value if end == len(text) else None


def _g4_members(text: str, i: int, close: str) -> tuple[dict[str, Any], int]:
    """key:value pairs from i up to `close` (or the end when close is ""); returns (dict, index of close)."""
    out: dict[str, Any] = {}
    while i < len(text) and text[i] != close:
        colon = text.find(":", i)
        if colon < 0:
            raise ValueError("a key without a value")
        key = text[i:colon].strip().replace(_G4_QUOTE, "")
        if not key:
            raise ValueError("an empty key")
        out[key], i = _g4_value(text, colon + 1, close)
        if i < len(text) and text[i] == ",":
            i += 1
    if close and i >= len(text):
        raise ValueError("unclosed object")
    return out, i


def _g4_value(text: str, i: int, close: str) -> tuple[Any, int]:
    """One value from i; returns (value, index just past it)."""
    if text.startswith(_G4_QUOTE, i):
        end = text.find(_G4_QUOTE, i + len(_G4_QUOTE))
        if end < 0:
            raise ValueError("unterminated string")
        return text[i + len(_G4_QUOTE) : end], end + len(_G4_QUOTE)
    if text.startswith("{", i):
        value, end = _g4_members(text, i + 1, "}")
        return value, end + 1
    if text.startswith("[", i):
        items, i = [], i + 1
        while i < len(text) and text[i] != "]":
            item, i = _g4_value(text, i, "]")
            items.append(item)
            if i < len(text) and text[i] == ",":
                i += 1
        if i >= len(text):
            raise ValueError("unclosed list")
        return items, i + 1
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    return _g4_bare(text[i:end].strip()), end


def _g4_bare(token: str) -> Any:
    if token in ("true", "false"):
        return token == "true"
    if token in ("null", "none", "nil"):
        return None
    try:
        return float(token) if any(c in token for c in ".eE") else int(token)
    except ValueError:
        return token


def _call_from_json(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


# ------------------------------------------------------------------------------------- forcing a call


def forced_call_grammar(
    tools: list[dict[str, Any]], choice: str | dict, parallel: bool, fmt: str, token_id: Callable[[str], int | None] | None = None
) -> str:
    """A Lark grammar (llguidance, with embedded JSON schemas) that only admits tool calls: of any of
    `tools` for "required", of the named function otherwise; one call, or several if `parallel`.

    `token_id` maps a marker (e.g. DeepSeek's `<｜tool▁calls▁begin｜>`) to its special token id, if the
    tokenizer has one: the grammar then asks for that token (`<[id]>`) rather than the marker's text."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; expected one of {FORMATS}")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
    compact = {"x-guidance": {"whitespace_flexible": False}}  # as response_format's JSON

    def schema_text(schema: dict) -> str:
        return json.dumps({**schema, **compact}, separators=(",", ":"))

    repeat = "+" if parallel else ""
    if fmt == "qwen":
        schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": _parameters(t)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        return f'start: call{repeat}\ncall: "{_QWEN_START}\\n" body "\\n{_QWEN_END}" "\\n"?\nbody: %json {schema_text(schema)}\n'

    def marker(text: str) -> str:
        tid = token_id(text) if token_id is not None else None
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    if fmt == "gemma4":
        return _gemma4_call_grammar(tools, repeat, marker)
    begin, end = marker(_DS_BEGIN), marker(_DS_END)
    call_begin, call_end, sep = marker("<｜tool▁call▁begin｜>"), marker("<｜tool▁call▁end｜>"), marker("<｜tool▁sep｜>")
    lines = [f"start: {begin} call{repeat} {end}", "call: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        header = json.dumps(t["function"]["name"] + "\n```json\n")
        lines.append(f'call{i}: {call_begin} "function" {sep} {header} args{i} "\\n```" {call_end}')
        lines.append(f"args{i}: %json {schema_text(_parameters(t))}")
    return "\n".join(lines) + "\n"


def _gemma4_call_grammar(tools: list[dict[str, Any]], repeat: str, marker: Callable[[str], str]) -> str:
    """Gemma 4 calls of the given functions: each function's own keys (from its parameters' properties,
    required ones first, in the schema's order) with Gemma's value syntax. Values are checked for syntax,
    not against the schema (Gemma's arguments are no JSON the schema grammar could read)."""
    quote = marker(_G4_QUOTE)
    lines = [f"start: call{repeat}", "call: " + " | ".join(f"call{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        params = _parameters(t)
        props = list((params.get("properties") or {}).keys())
        required = [k for k in params.get("required") or [] if k in props]
        optional = [k for k in props if k not in required]
        members = [f'"{k}:" value' for k in required]
        body = ' "," '.join(members)
        if optional:
            extra = " | ".join(f'"{k}:" value' for k in optional)
            body = f'{body} ("," ({extra}))*' if body else f'(({extra}) ("," ({extra}))*)?'
        header = json.dumps(f"call:{t['function']['name']}{{")
        lines.append(f'call{i}: {marker(_G4_START)} {header} {body or ""} "}}" {marker(_G4_END)}')
    lines += [
        f"value: {quote} TEXT {quote} | object | list | BARE",
        'object: "{" (member ("," member)*)? "}"',
        'member: KEY ":" value',
        'list: "[" (value ("," value)*)? "]"',
        "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
        "TEXT: /[^<]*/",
        "BARE: /-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?|true|false|null/",
    ]
    return "\n".join(lines) + "\n"


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}
