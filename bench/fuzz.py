"""`moray bench fuzz`: property-based fuzzing of a running server's HTTP (OpenAI) and gRPC APIs.

Hypothesis strategies built from the request schemas (`cluster/openai_api.py`, `protos/moray/v1/moray.proto`)
draw `--cases` HTTP requests and `--grpc-cases` gRPC requests from a fixed `--seed`: valid requests (small
max_tokens, so the run stays fast), valid requests with one to three hostile mutations (wrong types, huge
numbers and 5,000-digit integers, lone surrogates and invalid UTF-8, JSON nested past the depth limit but
under the body limit, unknown fields, unsupported OpenAI fields with non-trivial values, out-of-vocabulary
token ids and stop_token_ids, bad roles, null content with junk tool_calls, max_tokens beyond the context,
stream flags of the wrong type, bad auth headers), malformed bodies and HTTP framing (bad Content-Length,
chunked bodies, garbage request lines), gRPC messages with random field values, and malformed protobuf
bytes. Each case carries what a correct server must do with it: answer (`ok`), refuse with a 4xx /
INVALID_ARGUMENT-like status (`reject`), or either (`any`).

Reported: counts by HTTP status and gRPC code (also per case kind), every 5xx / gRPC UNKNOWN, INTERNAL,
DATA_LOSS, UNAVAILABLE, every timeout, every malformed success (a 200 that is not a completion, a stream that
breaks off or carries an error event), every rejection slower than `--slow-rejection-s` (2 s), the slowest
rejection, valid requests that were refused and invalid ones that were accepted (findings, not failures).
Before and after, the server must answer /health and a greedy completion (HTTP, and gRPC with --grpc) with
the same text. Exit 1 when anything in the failure list happened, else 0.

Only loopback servers are fuzzed (the URL's host must be localhost or a loopback address).

    moray bench fuzz --url http://127.0.0.1:8000 --grpc 127.0.0.1:9000 --cases 10000 --grpc-cases 2000 --seed 0 --json fuzz.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.report import add_report_argument, report_if_asked

SERVER_ERROR_GRPC_CODES = ("UNKNOWN", "INTERNAL", "DATA_LOSS", "UNAVAILABLE")
REJECT_GRPC_CODES = (
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "UNAUTHENTICATED",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "OUT_OF_RANGE",
    "FAILED_PRECONDITION",
    "ALREADY_EXISTS",
)
SHOW = 600  # characters of a request or response kept in the report
MAX_EXAMPLES = 500  # server errors listed one by one; all of them are counted and grouped
GREEDY_PROMPT = "The quick brown fox jumps over the lazy dog"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of a running server on this machine, e.g. http://127.0.0.1:8000")
    p.add_argument("--grpc", help="gRPC address of the same server, e.g. 127.0.0.1:9000 (default: HTTP only)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--cases", type=int, default=1000, help="HTTP cases")
    p.add_argument("--grpc-cases", type=int, default=None, help="gRPC cases (default: --cases / 5 with --grpc, else 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=900.0, help="stop sending new cases after this long (default 900)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it counts as a hang")
    p.add_argument("--slow-rejection-s", type=float, default=2.0, help="a refusal slower than this is a failure (default 2)")
    p.add_argument(
        "--drain-timeout", type=float, default=90.0, help="seconds to wait afterwards for the workers' KV use to reach 0 (reported)"
    )
    p.add_argument("--json", help="also write the JSON report here")
    add_report_argument(p)


# ------------------------------------------------------------------------------------ loopback only


def require_loopback_host(host: str | None, what: str) -> None:
    """Refuses anything but localhost and loopback addresses (no name resolution: a name could point anywhere)."""
    host = (host or "").strip("[]")
    if host.lower() == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{what}: only loopback servers may be fuzzed or soaked (localhost, 127.0.0.0/8, ::1); got host {host!r}")


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http:// or https://, got {url!r}")
    require_loopback_host(parts.hostname, "--url")
    return url.rstrip("/")


def check_grpc_address(addr: str) -> str:
    host = addr.rsplit(":", 1)[0] if addr.count(":") == 1 or addr.startswith("[") else addr
    require_loopback_host(host, "--grpc")
    return addr


# ------------------------------------------------------------------------------------ JSON building


class Raw:
    """JSON text written as is (numbers past what json.dumps writes, invalid UTF-8, NaN, deep nesting)."""

    def __init__(self, text: str | bytes):
        self.data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")

    def __repr__(self) -> str:
        return f"Raw({_short(self.data, 80)})"


class Pairs:
    """A JSON object written from (key, value) pairs: duplicate keys."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        self.pairs = pairs

    def __repr__(self) -> str:
        return f"Pairs({self.pairs!r:.80})"


class Big:
    """A long JSON string of `n` characters (built when encoded, so cases stay small until sent)."""

    def __init__(self, n: int, unit: str = "lorem ipsum dolor sit amet "):
        self.n, self.unit = n, unit

    def text(self) -> str:
        return (self.unit * (self.n // len(self.unit) + 1))[: self.n]

    def __repr__(self) -> str:
        return f"Big({self.n})"


def encode(obj: Any) -> bytes:
    """JSON bytes of a tree that may hold Raw / Pairs / Big (lone surrogates are written as \\uXXXX escapes)."""
    out: list[bytes] = []
    _encode(obj, out)
    return b"".join(out)


def _encode(obj: Any, out: list[bytes]) -> None:
    if isinstance(obj, Raw):
        out.append(obj.data)
    elif isinstance(obj, Big):
        out.append(json.dumps(obj.text()).encode())
    elif isinstance(obj, (dict, Pairs)):
        items = obj.pairs if isinstance(obj, Pairs) else list(obj.items())
        out.append(b"{")
        for i, (k, v) in enumerate(items):
            if i:
                out.append(b",")
            out.append(json.dumps(k).encode() if isinstance(k, str) else (k.data if isinstance(k, Raw) else json.dumps(str(k)).encode()))
            out.append(b":")
            _encode(v, out)
        out.append(b"}")
    elif isinstance(obj, (list, tuple)):
        out.append(b"[")
        for i, v in enumerate(obj):
            if i:
                out.append(b",")
            _encode(v, out)
        out.append(b"]")
    elif isinstance(obj, int) and not isinstance(obj, bool):
        out.append(_int_text(obj).encode())
    else:
        out.append(json.dumps(obj, allow_nan=True).encode())


def _int_text(n: int) -> str:
    """str(n) past sys.get_int_max_str_digits() too."""
    try:
        return str(n)
    except ValueError:
        digits = []
        neg, n = n < 0, abs(n)
        while n:
            n, r = divmod(n, 10**1000)
            digits.append(str(r).zfill(1000))
        return ("-" if neg else "") + "".join(reversed(digits)).lstrip("0")


def digits(k: int, lead: str = "9") -> str:
    return lead + "7" * (k - 1)


def deep(depth: int, kind: str = "list", leaf: str = "1") -> Raw:
    if kind == "list":
        return Raw("[" * depth + leaf + "]" * depth)
    return Raw('{"a":' * depth + leaf + "}" * depth)


def _short(data: bytes | str, limit: int = SHOW) -> str:
    text = data.decode("utf-8", "backslashreplace") if isinstance(data, (bytes, bytearray)) else str(data)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


# ------------------------------------------------------------------------------------ cases


@dataclass
class Target:
    """What the generators need to know about the server (probed before fuzzing)."""

    model: str
    vocab_size: int
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


@dataclass
class HttpCase:
    kind: str  # "valid", "mutated:<labels>", "raw_body:<label>", "framing:<label>", "route:<label>"
    path: str
    body: Any = None  # a tree for encode(), or bytes as sent
    expect: str = "ok"  # ok | reject | any
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    framing: bytes | None = None  # a whole raw HTTP request (sent on a socket of its own)

    def body_bytes(self) -> bytes | None:
        if self.body is None:
            return None
        return self.body if isinstance(self.body, (bytes, bytearray)) else encode(self.body)

    def describe(self) -> dict:
        if self.framing is not None:
            return {"kind": self.kind, "raw_request": _short(self.framing)}
        body = self.body_bytes()
        headers = {k: ("<api key>" if k.lower() == "authorization" and "Bearer" in v else _short(v, 120)) for k, v in self.headers.items()}
        return {
            "kind": self.kind,
            "method": self.method,
            "path": self.path,
            "headers": headers,
            "body": None if body is None else _short(body),
            "body_bytes": None if body is None else len(body),
        }


@dataclass
class GrpcCase:
    kind: str
    method: str  # Generate | Complete | ListModels | Health
    data: bytes  # the serialized request as sent
    expect: str = "ok"
    metadata: tuple = ()
    text: str = ""  # text_format of the message (empty for raw bytes)

    def describe(self) -> dict:
        md = [(k, "<api key>" if k == "authorization" and "Bearer" in v else _short(v, 80)) for k, v in self.metadata]
        return {
            "kind": self.kind,
            "method": self.method,
            "metadata": md,
            "message": _short(self.text, SHOW) if self.text else None,
            "bytes_hex": self.data[:200].hex() + ("..." if len(self.data) > 200 else ""),
            "bytes": len(self.data),
        }


def _combine(*expects: str) -> str:
    if "reject" in expects:
        return "reject"
    if "any" in expects:
        return "any"
    return "ok"


# ------------------------------------------------------------------------------------ HTTP strategies

COMMON_FIELDS = {
    "model": "str",
    "max_tokens": "opt_int",
    "temperature": "opt_float",
    "top_p": "opt_float",
    "n": "int",
    "stream": "bool",
    "stream_options": "opt_obj",
    "stop": "opt_stop",
    "seed": "opt_int",
    "presence_penalty": "opt_float",
    "frequency_penalty": "opt_float",
    "user": "opt_str",
    "top_k": "opt_int",
    "min_p": "opt_float",
    "repetition_penalty": "opt_float",
    "min_tokens": "opt_int",
    "ignore_eos": "bool",
    "stop_token_ids": "opt_list_int",
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "prompt": "prompt", "logprobs": "opt_int", "echo": "bool"}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": "messages",
    "max_completion_tokens": "opt_int",
    "logprobs": "bool",
    "top_logprobs": "opt_int",
    "add_generation_prompt": "bool",
}
UNSUPPORTED_FIELDS = ("response_format", "tools", "tool_choice", "functions", "function_call", "logit_bias", "suffix", "best_of")
ALL_KNOWN = set(COMPLETION_FIELDS) | set(CHAT_FIELDS) | set(UNSUPPORTED_FIELDS)

WRONG_TYPES: dict[str, list] = {
    "int": ["1", 1.5, True, False, None, [], {}, [1], "", Raw("1.0"), Raw("1e2")],
    "opt_int": ["1", 1.5, True, False, [], {}, [1], "", Raw("1.0"), Raw("1e2"), Raw("-0.0")],
    "opt_float": ["0.5", True, False, [], {}, [0.5], "", "inf", "NaN"],
    "bool": ["true", "false", 1, 0, 1.0, [], {}, "yes", None, "", [True]],
    "str": [1, 1.5, True, [], {}, ["a"], None],
    "opt_str": [1, 1.5, True, [], {}, ["a"], {"id": "x"}],
    "opt_obj": ["yes", 1, True, [], [{"include_usage": True}]],
    "opt_stop": [5, 1.5, True, [5], [None], {"a": "b"}, [["x"]], [True]],
    "opt_list_int": ["1,2", 1, [1.5], ["1"], [True], {}, [[1]], [None]],
    "prompt": [None, 5, 1.5, True, {}, {"text": "hi"}, [1.5], [True], [None], [[1.5]], [{"a": 1}], [[[1]]], ["a", 1], [1, "a"]],
    "messages": [None, "hi", 5, {}, {"role": "user", "content": "hi"}, [None], [1], ["hi"], [[]], [[{"role": "user", "content": "x"}]]],
}
INT_LIMITED = ("max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "min_tokens")
BAD_ROLES = ["", "USER", "User", " user", "user ", "function", "model", "ai", "human", "bot", "system\x00", None, 1, True, [], {}, ["user"]]


def _st():
    from hypothesis import strategies as st

    return st


def _pick(seq):
    """A uniform choice from `seq` (hypothesis's sampled_from favours the first elements strongly, which would
    leave most hostile variants of a table untried)."""
    items = list(seq)
    return _st().integers(0, 2**32 - 1).map(lambda i: items[i % len(items)])


def _ascii_text(max_size: int, min_size: int = 1):
    st = _st()
    return st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=min_size, max_size=max_size)


def _unicode_text(max_size: int, min_size: int = 1):
    st = _st()
    return st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=min_size, max_size=max_size)


def _json_values(max_leaves: int = 6):
    """Small, valid JSON values (no surrogates, finite floats)."""
    st = _st()
    scalars = (
        st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False) | _unicode_text(12, 0)
    )
    return st.recursive(
        scalars, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_unicode_text(6, 0), kids, max_size=3), max_leaves=max_leaves
    )


def _text_budget(t: Target) -> int:
    """Characters of ASCII text a valid prompt may have: well inside the context whatever the tokenizer."""
    return max(4, min(60, t.max_model_len // 5))


def _valid_ids(draw, t: Target, max_len: int = 32) -> list[int]:
    st = _st()
    n = draw(st.integers(1, max(1, min(max_len, t.max_model_len // 4))))
    return draw(st.lists(st.integers(0, t.vocab_size - 1), min_size=n, max_size=n))


def _valid_sampling(draw, t: Target, chat: bool) -> dict:
    st = _st()
    body: dict[str, Any] = {}
    optional = {
        "temperature": _pick([0, 0.0, 0.5, 1.0, 1.7, 2]) | st.floats(0, 2),
        "top_p": st.floats(0.01, 1.0),
        "top_k": _pick([-1, 0, 1, 5, 50]),
        "min_p": st.floats(0, 1),
        "seed": st.integers(0, 2**31 - 1),
        "stop": _ascii_text(6) | st.lists(_ascii_text(6), max_size=4),
        "stop_token_ids": st.lists(st.integers(0, t.vocab_size - 1), max_size=4),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.5, 2.0),
        "ignore_eos": st.booleans(),
        "user": _ascii_text(16),
        "n": st.just(1),
        # Unimplemented fields with values that ask for nothing: must be accepted.
        "response_format": _pick([None, {"type": "text"}]),
        "tools": _pick([None, []]),
        "tool_choice": _pick([None, "none"]),
        "logit_bias": _pick([None, {}]),
    }
    if chat:
        optional["add_generation_prompt"] = st.just(True)
    else:
        optional["echo"] = st.just(False)
        optional["suffix"] = _pick([None, ""])
        optional["best_of"] = _pick([None, 1])
    for name in draw(st.lists(_pick(sorted(optional)), max_size=6, unique=True)):
        body[name] = draw(optional[name])
    if draw(st.integers(0, 9)):  # mostly a small explicit max_tokens (an unset one is 16 tokens)
        key = "max_completion_tokens" if chat and draw(st.booleans()) else "max_tokens"
        body[key] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, body.get("max_tokens", body.get("max_completion_tokens", 16))))
    if chat and draw(st.integers(0, 3)) == 0:
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    elif not chat and draw(st.integers(0, 3)) == 0:
        body["logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    elif draw(st.integers(0, 3)) == 0:
        body["stream"] = False
    return body


def _valid_messages(draw, t: Target) -> list[dict]:
    st = _st()
    budget = _text_budget(t) // 2
    content = (
        _ascii_text(budget)
        | _unicode_text(max(2, budget // 6))
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _ascii_text(budget // 2 or 1)}), min_size=1, max_size=2)
    )
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": draw(_pick(["system", "developer"])), "content": draw(content)})
    turns = draw(st.integers(0, 1))
    for _ in range(turns):
        msgs.append({"role": "user", "content": draw(content)})
        msgs.append({"role": "assistant", "content": draw(content)})
    msgs.append({"role": "user", "content": draw(content)})
    if draw(st.integers(0, 5)) == 0:
        msgs[-1]["name"] = draw(_ascii_text(8))
    return msgs


def _valid_body(draw, t: Target, chat: bool) -> dict:
    st = _st()
    body: dict[str, Any] = {"model": t.model}
    if chat:
        body["messages"] = _valid_messages(draw, t)
    else:
        budget = _text_budget(t)
        body["prompt"] = draw(st.one_of(_ascii_text(budget), _unicode_text(max(2, budget // 6)), st.just(None)))
        if body["prompt"] is None:
            ids = _valid_ids(draw, t)
            body["prompt"] = draw(_pick([ids, [ids]]))
    body.update(_valid_sampling(draw, t, chat))
    return body


def _small_body(draw, t: Target) -> dict:
    return {"model": t.model, "prompt": draw(_ascii_text(_text_budget(t))), "max_tokens": 2}


def _headers(t: Target) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if t.api_key:
        h["Authorization"] = f"Bearer {t.api_key}"
    return h


# ---- mutations: each changes a valid body (and its headers) in place and returns (label, expectation)


def m_wrong_type(draw, t, chat, body, headers):
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    name = draw(_pick(sorted(fields)))
    body[name] = draw(_pick(WRONG_TYPES[fields[name]]))
    return f"wrong_type:{name}", "reject"


def m_huge_number(draw, t, chat, body, headers):
    numeric = [n for n, k in (CHAT_FIELDS if chat else COMPLETION_FIELDS).items() if k in ("int", "opt_int", "opt_float")]
    name = draw(_pick(sorted(numeric)))
    k = draw(
        _pick(
            [
                "1e308",
                "1e400",
                "-1e400",
                "2^31-1",
                "2^31",
                "2^53+1",
                "2^63",
                "2^64",
                "-2^63-1",
                "d4300",
                "d4301",
                "d5000",
                "-d5000",
                "f400",
                "f5000",
                "tiny",
                "1e-400",
                "e-huge",
            ]
        )
    )
    value = {
        "1e308": 1e308,
        "1e400": Raw("1e400"),
        "-1e400": Raw("-1e400"),
        "2^31-1": 2**31 - 1,
        "2^31": 2**31,
        "2^53+1": 2**53 + 1,
        "2^63": 2**63,
        "2^64": 2**64,
        "-2^63-1": -(2**63) - 1,
        "d4300": Raw(digits(4300)),
        "d4301": Raw(digits(4301)),
        "d5000": Raw(digits(5000)),
        "-d5000": Raw("-" + digits(5000)),
        "f400": Raw("1" + "0" * 400 + ".5"),
        "f5000": Raw("0." + "0" * 5000 + "1"),
        "tiny": 5e-324,
        "1e-400": Raw("1e-400"),
        "e-huge": Raw("1E+99999999999999999999"),
    }[k]
    body[name] = value
    _only_this_limit(chat, body, name)
    if k in ("d4301", "d5000", "-d5000", "1e400", "-1e400", "f400", "e-huge"):
        return f"huge_number:{name}:{k}", "reject"  # past the digit limit, or infinite
    label = f"huge_number:{name}:{k}"
    if COMPLETION_FIELDS.get(name, CHAT_FIELDS.get(name)) == "opt_float":
        if name in ("temperature", "repetition_penalty"):  # no upper bound: a huge finite value may be valid
            return label, "any"
        return label, "any" if k in ("tiny", "1e-400", "f5000") else "reject"  # out of range, except the tiny ones
    if k in ("1e308", "tiny", "1e-400", "f5000"):
        return label, "reject"  # a float in an integer field
    return label, "reject" if name in INT_LIMITED else "any"  # seed and top_k may be huge


def _only_this_limit(chat: bool, body: dict, name: str) -> None:
    """A chat request's max_completion_tokens wins over max_tokens: drop the other so `name` counts."""
    if chat and name in ("max_tokens", "max_completion_tokens"):
        body.pop("max_completion_tokens" if name == "max_tokens" else "max_tokens", None)


def _messages_ok(body: dict) -> bool:
    """Whether an earlier mutation left `messages` a non-empty list of objects (others need one)."""
    msgs = body.get("messages")
    return isinstance(msgs, list) and bool(msgs) and all(isinstance(m, dict) for m in msgs)


def _surrogate_text(draw) -> str:
    st = _st()
    # One or two surrogates, each followed by an ASCII character: two in a row could make a valid pair.
    lone = [draw(st.characters(categories=["Cs"])) + draw(_ascii_text(1)) for _ in range(draw(st.integers(1, 2)))]
    return draw(_ascii_text(6, 0)) + "".join(lone) + draw(_ascii_text(6, 0))


def m_surrogate(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    bad = _surrogate_text(draw)
    places = ["model", "user", "stop", "stop_list", "unknown_value", "unknown_key"]
    places += ["content", "content_part", "name", "message_extra", "tool_call_id"] if chat else ["prompt", "prompt_list"]
    where = draw(_pick(places))
    msg = body["messages"][-1] if chat else None
    if where == "model":
        body["model"] = bad
    elif where == "user":
        body["user"] = bad
    elif where == "stop":
        body["stop"] = bad
    elif where == "stop_list":
        body["stop"] = ["ok", bad]
    elif where == "unknown_value":
        body["x_fuzz"] = {"nested": [bad]}
    elif where == "unknown_key":
        body[bad] = 1
    elif where == "content":
        msg["content"] = bad
    elif where == "content_part":
        msg["content"] = [{"type": "text", "text": bad}]
    elif where == "name":
        msg["name"] = bad
    elif where == "message_extra":
        msg["reasoning_content"] = bad
    elif where == "tool_call_id":
        body["messages"].insert(-1, {"role": "tool", "content": "r", "tool_call_id": bad})
    elif where == "prompt":
        body["prompt"] = bad
    else:
        body["prompt"] = [bad]
    return f"lone_surrogate:{where}", "reject"


def m_valid_pair(draw, t, chat, body, headers):
    """An escaped surrogate pair (a real emoji) is valid JSON and valid Unicode."""
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    text = "smile \U0001f600 ok"
    if chat:
        body["messages"][-1]["content"] = text
    else:
        body["prompt"] = text
    return "surrogate_pair", "ok"


def m_invalid_utf8(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    junk = draw(_pick([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82"]))
    raw = Raw(b'"ok ' + junk + b' ok"')
    if chat:
        body["messages"][-1]["content"] = raw
    else:
        body["prompt"] = raw
    return "invalid_utf8", "reject"


DEPTHS = [2, 10, 32, 60, 62, 63, 64, 65, 66, 70, 100, 500, 999, 1000, 1001, 5000, 50000, 200000]


def m_deep(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    depth = draw(_pick(DEPTHS))
    kind = draw(_pick(["list", "dict"]))
    if kind == "dict":
        depth = min(depth, 100000)  # 6 bytes a level: stay under the body limit
    value = deep(depth, kind)
    places = ["unknown", "logit_bias", "stop", "stream_options"] + (["content", "tool_args", "message_extra"] if chat else ["prompt"])
    where = draw(_pick(places))
    label = f"deep:{where}:{kind}:{depth}"
    if where == "unknown":
        body["metadata"] = value
        return label, "ok" if depth <= 58 else ("reject" if depth >= 70 else "any")
    if where == "message_extra":
        body["messages"][-1]["extra"] = value
        return label, "any" if depth <= 58 else ("reject" if depth >= 70 else "any")
    if where == "tool_args":
        body["messages"].insert(
            -1,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(depth, "dict")}}],
            },
        )
        return label, "any" if depth <= 58 else ("reject" if depth >= 70 else "any")
    if where == "content":
        body["messages"][-1]["content"] = value
    elif where == "prompt":
        body["prompt"] = value
        if kind == "list" and depth <= 2:
            return label, "any"
    else:
        body[where] = value
    return label, "reject"


def m_unknown_fields(draw, t, chat, body, headers):
    st = _st()
    keys = draw(st.lists(_unicode_text(12).filter(lambda k: k not in ALL_KNOWN), min_size=1, max_size=5, unique=True))
    for k in keys:
        body[k] = draw(_json_values())
    return "unknown_fields", "ok"


def m_unknown_nested(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    where = draw(_pick(["stream_options", "message", "content_part", "tool_function"] if chat else ["stream_options"]))
    if where == "stream_options":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "x_fuzz": draw(_json_values(3))}
        return "unknown_nested:stream_options", "reject"  # its schema is closed
    if where == "message":
        body["messages"][-1]["x_fuzz"] = draw(_json_values(3))
        return "unknown_nested:message", "any"
    if where == "content_part":
        body["messages"][-1]["content"] = [{"type": "text", "text": "hi", "x_fuzz": draw(_json_values(3))}]
        return "unknown_nested:content_part", "ok"
    body["messages"].insert(
        -1,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "x_fuzz": 1}}],
        },
    )
    return "unknown_nested:tool_function", "any"


UNSUPPORTED_VALUES = {
    "response_format": [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}},
        "text",
        {"type": "text", "extra": 1},
        [],
        {"type": "TEXT"},
    ],
    # Invalid on chat too (valid tools are served there; on /v1/completions any tools are refused).
    "tools": [[{"type": "retrieval"}], [{"type": "function", "function": {"name": ""}}], "x", {}, [None], [1]],
    "tool_choice": ["always", "required", {"type": "function", "function": {"name": "f"}}, "None", 0],
    "functions": [[{"name": "f", "parameters": {}}], {}, "f"],
    "function_call": ["auto", {"name": "f"}, "None"],
    "logit_bias": [{"99999999": -100}, {"1": 101}, [], {"abc": 1}, {"1": "x"}, {"1": Raw("1e400")}, "x"],
    "suffix": ["x", 5, []],
    "best_of": [2, 0, -1, "1", True],
    "echo": [True],
    "n": [2, 0, -1, 100],
}


def m_unsupported(draw, t, chat, body, headers):
    names = [n for n in UNSUPPORTED_VALUES if not (chat and n in ("suffix", "best_of", "echo"))]
    name = draw(_pick(names))
    body[name] = draw(_pick(UNSUPPORTED_VALUES[name]))
    return f"unsupported:{name}", "reject"


def m_ignored_on_chat(draw, t, chat, body, headers):
    """Completion-only fields on a chat request are unknown there (accepted, ignored)."""
    name = draw(_pick(["suffix", "best_of", "echo"]))
    body[name] = draw(_pick(UNSUPPORTED_VALUES[name]))
    return f"completion_field_on_chat:{name}", "ok" if chat else "reject"


def _oov(draw, t) -> int:
    v = t.vocab_size
    return draw(_pick([v, v + 1, 2 * v, 2**31 - 1, 2**31, 2**32, 2**53, 2**63, 2**64, -1, -(2**31), -(2**63) - 1]))


def m_oov_tokens(draw, t, chat, body, headers):
    st = _st()
    bad = _oov(draw, t)
    where = draw(_pick(["stop_token_ids"] if chat else ["prompt", "prompt_nested", "stop_token_ids"]))
    if where == "stop_token_ids":
        ids = draw(st.lists(st.integers(0, t.vocab_size - 1), max_size=3))
        ids.insert(draw(st.integers(0, len(ids))), bad)
        body["stop_token_ids"] = ids
    else:
        ids = _valid_ids(draw, t)
        ids[draw(st.integers(0, len(ids) - 1))] = bad
        body["prompt"] = ids if where == "prompt" else [ids]
    return f"oov_token:{where}:{bad}", "reject"


def m_boundary_tokens(draw, t, chat, body, headers):
    """Ids at the edges of the vocabulary: valid."""
    ids = [0, t.vocab_size - 1, 1, t.vocab_size - 2]
    if chat:
        body["stop_token_ids"] = ids
    else:
        body["prompt"] = ids
    return "vocab_edges", "ok"


def m_bad_role(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    st = _st()
    if not chat:
        return m_wrong_type(draw, t, chat, body, headers)
    msgs = body["messages"]
    i = draw(st.integers(0, len(msgs) - 1))
    how = draw(_pick(["value", "random", "missing"]))
    if how == "missing":
        msgs[i] = {k: v for k, v in msgs[i].items() if k != "role"}
        return "bad_role:missing", "reject"
    if how == "random":
        role = draw(_unicode_text(10).filter(lambda r: r not in ("system", "user", "assistant", "tool", "developer")))
    else:
        role = draw(_pick(BAD_ROLES))
    msgs[i]["role"] = role
    return "bad_role", "reject"


JUNK_TOOL_CALLS = [
    ("valid", [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}], "any"),
    ("dict_args", [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}], "any"),
    ("bad_json_args", [{"function": {"name": "f", "arguments": "not json {"}}], "any"),
    ("empty_list", [], "any"),
    ("many", [{"function": {"name": f"f{i}", "arguments": "{}"}} for i in range(100)], "any"),
    ("no_arguments", [{"function": {"name": "f"}}], "reject"),
    ("other_type", [{"type": "other", "function": {"name": "f", "arguments": "{}"}}], "reject"),
    ("ints", [1], "reject"),
    ("strings", ["x"], "reject"),
    ("nulls", [None], "reject"),
    ("nested_list", [[]], "reject"),
    ("string", "x", "reject"),
    ("int", 5, "reject"),
    ("object", {}, "reject"),
    ("bool", True, "reject"),
    ("name_int", [{"function": {"name": 5, "arguments": "{}"}}], "reject"),
    ("args_int", [{"function": {"name": "f", "arguments": 5}}], "reject"),
    ("id_int", [{"id": 5, "function": {"name": "f", "arguments": "{}"}}], "reject"),
    ("function_null", [{"function": None}], "reject"),
    ("name_surrogate", [{"function": {"name": "f\ud800", "arguments": "{}"}}], "reject"),
]


def m_null_content_tool_calls(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    st = _st()
    if not chat:
        return m_wrong_type(draw, t, chat, body, headers)
    label, junk, expect = draw(_pick(JUNK_TOOL_CALLS))
    msg = {"role": "assistant", "content": None, "tool_calls": junk}
    if draw(st.booleans()):
        body["messages"].insert(-1, msg)
    else:
        body["messages"].append(msg)
        expect = _combine(expect, "any")
    return f"null_content_tool_calls:{label}", expect


def m_null_content(draw, t, chat, body, headers):
    if chat and not _messages_ok(body):
        return m_ranges(draw, t, chat, body, headers)
    st = _st()
    if not chat:
        body["prompt"] = None
        return "null_prompt", "reject"
    msg = body["messages"][draw(st.integers(0, len(body["messages"]) - 1))]
    if draw(st.booleans()):
        msg["content"] = None
    else:
        msg.pop("content", None)
    return "null_content", "any"


def m_beyond_context(draw, t, chat, body, headers):
    L = t.max_model_len
    value = draw(_pick([L, L + 1, 2 * L, 2**31 - 1, 2**31, 2**53, 2**63, 10**30, 0, -1, -(2**63)]))
    name = draw(_pick(["max_tokens", "max_completion_tokens"])) if chat else "max_tokens"
    body[name] = value
    _only_this_limit(chat, body, name)
    body.pop("min_tokens", None)
    return f"max_tokens_beyond_context:{name}:{value}", "reject"


def m_prompt_at_limit(draw, t, chat, body, headers):
    """A token prompt that fills the context: L-1 tokens + 1 is valid, L tokens (or L-1 + 2) is not."""
    st = _st()
    if chat:
        return m_beyond_context(draw, t, chat, body, headers)
    over = draw(st.booleans())
    n = t.max_model_len - (0 if over else 1)
    body["prompt"] = [(i * 7 + 3) % t.vocab_size for i in range(n)]
    body["max_tokens"] = 1
    body.pop("min_tokens", None)
    return f"prompt_at_limit:{'over' if over else 'fits'}", "reject" if over else "ok"


STREAM_WRONG = ["true", "false", 1, 0, None, [], {}, 1.0, "", [True], "yes"]


def m_stream(draw, t, chat, body, headers):
    st = _st()
    how = draw(_pick(["stream_type", "options_without_stream", "options_type", "include_usage_type", "options_null", "options_empty"]))
    body.pop("stream_options", None)
    if how == "stream_type":
        body["stream"] = draw(_pick(STREAM_WRONG))
        return "stream:wrong_type", "reject"
    if how == "options_without_stream":
        body["stream"] = draw(_pick([False, None])) if draw(st.booleans()) else False
        if body["stream"] is None:
            del body["stream"]
        body["stream_options"] = {"include_usage": True}
        return "stream:options_without_stream", "reject"
    body["stream"] = True
    if how == "options_type":
        body["stream_options"] = draw(_pick(["yes", 1, True, [], [{"include_usage": True}]]))
        return "stream:options_wrong_type", "reject"
    if how == "include_usage_type":
        body["stream_options"] = {"include_usage": draw(_pick(["yes", 1, 0, None, [], "true"]))}
        return "stream:include_usage_wrong_type", "reject"
    body["stream_options"] = None if how == "options_null" else {}
    return f"stream:{how}", "ok"


def m_ranges(draw, t, chat, body, headers):
    cases = [
        ("temperature", -1, "reject"),
        ("temperature", -0.0001, "reject"),
        ("temperature", -0.0, "ok"),
        ("top_p", 0, "reject"),
        ("top_p", -0.1, "reject"),
        ("top_p", 1.0001, "reject"),
        ("top_p", 2, "reject"),
        ("top_p", 1e-300, "ok"),
        ("min_p", -0.1, "reject"),
        ("min_p", 1.1, "reject"),
        ("presence_penalty", 2.1, "reject"),
        ("frequency_penalty", -2.1, "reject"),
        ("repetition_penalty", 0, "reject"),
        ("repetition_penalty", -1, "reject"),
        ("top_k", -2, "reject"),
        ("top_k", -(2**31), "reject"),
        ("top_k", 2**31 - 1, "any"),
        ("n", 0, "reject"),
        ("n", 2, "reject"),
        ("min_tokens", -1, "reject"),
        ("seed", -1, "any"),
        ("seed", 2**64, "any"),
        ("seed", -(2**63), "any"),
        ("stop", "", "reject"),
        ("stop", [""], "reject"),
        ("stop", [], "ok"),
        ("stop", ["s"] * 200, "any"),
        ("stop", "x" * 20000, "any"),
        ("stop_token_ids", [], "ok"),
        ("stop_token_ids", [-1], "reject"),
        ("user", "", "ok"),
        ("user", "u" * 100000, "any"),
    ]
    if chat:
        cases += [("top_logprobs", 21, "reject"), ("top_logprobs", -1, "reject"), ("logprobs", False, "ok")]
    else:
        cases += [("logprobs", 21, "reject"), ("logprobs", -1, "reject")]
    name, value, expect = draw(_pick(cases))
    body[name] = value
    if name == "top_logprobs":
        body["logprobs"] = True
    return f"range:{name}:{_short(repr(value), 20)}", expect


def m_top_logprobs_without_logprobs(draw, t, chat, body, headers):
    if not chat:
        return m_ranges(draw, t, chat, body, headers)
    body["logprobs"] = False
    body["top_logprobs"] = 3
    return "top_logprobs_without_logprobs", "reject"


def m_min_tokens(draw, t, chat, body, headers):
    st = _st()
    mt = body.get("max_completion_tokens") if chat and "max_completion_tokens" in body else body.get("max_tokens")
    if type(mt) is not int or not 1 <= mt <= 64:  # unset, or an earlier mutation made it something else
        body["max_tokens"] = mt = 2
        _only_this_limit(chat, body, "max_tokens")
    body["min_tokens"] = mt + draw(st.integers(1, 1000))
    return "min_tokens_over_max_tokens", "reject"


def m_prompt_shape(draw, t, chat, body, headers):
    st = _st()
    if chat:
        shapes = [
            ("empty", [], "reject"),
            ("parts_ok", [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "ok"),
            ("image_part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}], "reject"),
            ("part_text_int", [{"role": "user", "content": [{"type": "text", "text": 5}]}], "reject"),
            ("part_no_type", [{"role": "user", "content": [{"text": "a"}]}], "reject"),
            ("part_not_object", [{"role": "user", "content": ["a"]}], "reject"),
            ("content_empty_list", [{"role": "user", "content": []}], "any"),
            ("content_empty", [{"role": "user", "content": ""}], "any"),
            ("content_int", [{"role": "user", "content": 5}], "reject"),
            ("name_int", [{"role": "user", "content": "x", "name": 5}], "reject"),
            (
                "many_messages",
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}] * 300 + [{"role": "user", "content": "z"}],
                "any",
            ),
            ("system_only", [{"role": "system", "content": "x"}], "any"),
            ("assistant_last", [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "any"),
            ("tool_message", [{"role": "tool", "content": "r", "tool_call_id": "c1"}], "any"),
            ("tool_call_id_int", [{"role": "tool", "content": "r", "tool_call_id": 5}], "reject"),
            ("huge_content", [{"role": "user", "content": Big(draw(_pick([50_000, 300_000, 900_000])))}], "reject"),
            ("special_tokens", [{"role": "user", "content": "<|im_start|>system\nhi<|im_end|>"}], "ok"),
        ]
        label, msgs, expect = draw(_pick(shapes))
        body["messages"] = msgs
        if label == "assistant_last" and draw(st.booleans()):
            body["add_generation_prompt"] = False
        return f"messages:{label}", expect
    shapes = [
        ("empty_string", "", "reject"),
        ("empty_list", [], "reject"),
        ("empty_nested", [[]], "reject"),
        ("empty_string_list", [""], "reject"),
        ("batched_strings", ["a", "b"], "reject"),
        ("batched_ids", [[1, 2], [3]], "reject"),
        ("nested_strings", [["a"]], "reject"),
        ("one_string_list", ["hello"], "ok"),
        ("whitespace", " ", "any"),
        ("nul", "\x00", "any"),
        ("special_tokens", "<|im_start|><|endoftext|>", "ok"),
        ("control_chars", "\x01\x02\x1b[31m\r\n\t", "any"),
        ("huge", Big(draw(_pick([20_000, 200_000, 900_000]))), "reject"),
        ("huge_ids", list(range(3, 3 + 10 * t.max_model_len)), "reject"),
    ]
    label, prompt, expect = draw(_pick(shapes))
    if label == "huge_ids":
        prompt = [i % t.vocab_size for i in prompt]
    body["prompt"] = prompt
    return f"prompt:{label}", expect


def m_model(draw, t, chat, body, headers):
    how = draw(_pick(["other", "empty", "missing", "case", "padded", "long", "random"]))
    if how == "missing":
        del body["model"]
    else:
        body["model"] = {
            "other": "gpt-5",
            "empty": "",
            "case": t.model.upper() if t.model.upper() != t.model else t.model + "X",
            "padded": f" {t.model} ",
            "long": "m" * 100_000,
            "random": draw(_unicode_text(20).filter(lambda m: m != t.model)),
        }.get(how)
    return f"model:{how}", "reject"


def m_auth(draw, t, chat, body, headers):
    key = t.api_key or "k"
    how = draw(_pick(["missing", "wrong", "lowercase_scheme", "double_space", "trailing_space", "basic", "no_key", "bare_key", "empty"]))
    value = {
        "wrong": "Bearer not-the-key",
        "lowercase_scheme": f"bearer {key}",
        "double_space": f"Bearer  {key}",
        "trailing_space": f"Bearer {key} ",
        "basic": f"Basic {key}",
        "no_key": "Bearer",
        "bare_key": key,
        "empty": "",
    }.get(how)
    headers.pop("Authorization", None)
    if value is not None:
        headers["Authorization"] = value
    if not t.api_key:
        return f"auth:{how}", "any"
    return f"auth:{how}", "ok" if how in ("lowercase_scheme", "double_space", "trailing_space") else "reject"


def m_content_type(draw, t, chat, body, headers):
    ct = draw(
        _pick(["text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1", None, "multipart/form-data"])
    )
    headers.pop("Content-Type", None)
    if ct is not None:
        headers["Content-Type"] = ct
    return "content_type", "any"


def m_duplicate_keys(draw, t, chat, body, headers):
    name = draw(_pick(["max_tokens", "model", "stream", "prompt" if not chat else "messages"]))
    wrong = draw(_pick(WRONG_TYPES[(CHAT_FIELDS if chat else COMPLETION_FIELDS)[name]]))
    pairs = list(body.items())
    pairs.append((name, wrong))
    body.clear()
    body["__pairs__"] = pairs  # unwrapped by _finish
    return f"duplicate_key:{name}", "any"


def m_session_header(draw, t, chat, body, headers):
    headers["x-session-id"] = draw(_pick(["s1", "", " ", "x" * 8000, "a,b", "\t"]))
    return "session_header", "any"


MUTATIONS = [
    m_wrong_type,
    m_wrong_type,
    m_huge_number,
    m_huge_number,
    m_surrogate,
    m_valid_pair,
    m_invalid_utf8,
    m_deep,
    m_deep,
    m_unknown_fields,
    m_unknown_nested,
    m_unsupported,
    m_unsupported,
    m_ignored_on_chat,
    m_oov_tokens,
    m_oov_tokens,
    m_boundary_tokens,
    m_bad_role,
    m_bad_role,
    m_null_content_tool_calls,
    m_null_content_tool_calls,
    m_null_content,
    m_beyond_context,
    m_prompt_at_limit,
    m_stream,
    m_stream,
    m_ranges,
    m_ranges,
    m_top_logprobs_without_logprobs,
    m_min_tokens,
    m_prompt_shape,
    m_prompt_shape,
    m_model,
    m_auth,
    m_content_type,
    m_duplicate_keys,
    m_session_header,
]


def _fingerprint(body: dict, headers: dict) -> dict[str, bytes]:
    out = {f"header:{k.lower()}": v.encode("utf-8", "surrogatepass") for k, v in headers.items()}
    for k, v in body.items():
        out[k if isinstance(k, str) else repr(k)] = encode(v) if k != "__pairs__" else b"pairs"
    return out


def _finish(body: dict) -> Any:
    if "__pairs__" in body:
        return Pairs(body["__pairs__"])
    return body


RAW_BODIES = [
    ("empty", b"", "reject"),
    ("open_brace", b"{", "reject"),
    ("close_brace", b"}", "reject"),
    ("null", b"null", "reject"),
    ("array", b"[]", "reject"),
    ("number", b"1", "reject"),
    ("string", b'"x"', "reject"),
    ("true", b"true", "reject"),
    ("nan", b"NaN", "reject"),
    ("nan_value", b'{"model": NaN}', "reject"),
    ("infinity_value", b'{"model": "m", "temperature": Infinity}', "reject"),
    ("single_quotes", b"{'model': 'x'}", "reject"),
    ("trailing_comma", b'{"a":1,}', "reject"),
    ("trailing_garbage", b'{"a":1} x', "reject"),
    ("two_objects", b'{"a":1}{"b":2}', "reject"),
    ("comment", b'{"model":"m"/*c*/}', "reject"),
    ("nul_bytes", b"\x00" * 100, "reject"),
    ("utf16_bom_junk", b"\xff\xfe\x00", "reject"),
    ("unclosed_deep_obj", b'{"a":' * 50000, "reject"),
    ("unclosed_deep_list", b"[" * 500000, "reject"),
    ("closed_deep_list", b"[" * 200000 + b"]" * 200000, "reject"),
    ("lone_surrogate_key", b'{"\\udc00": 1}', "reject"),
    ("bad_escape", b'{"model": "\\x41"}', "reject"),
    ("short_unicode_escape", b'{"model": "\\u12"}', "reject"),
    ("control_char_in_string", b'{"model": "a\x01b"}', "reject"),
]


RAW_BODY_KINDS = ("random", "truncated", "flipped", "bom", "utf16", "whitespace", "newline", "oversize", "oversize_ws")


def _raw_body_case(draw, t: Target, chat: bool, how: str) -> tuple[str, bytes, str]:
    st = _st()
    path_body = encode(_valid_body(draw, t, chat))
    if how == "random":
        return "random_bytes", draw(st.binary(min_size=1, max_size=300)), "reject"
    if how == "truncated":
        cut = draw(st.integers(1, len(path_body) - 1))
        return "truncated", path_body[:cut], "reject"
    if how == "flipped":
        i = draw(st.integers(0, len(path_body) - 1))
        b = draw(st.integers(0, 255))
        return "byte_flipped", path_body[:i] + bytes([b]) + path_body[i + 1 :], "any"
    if how == "bom":
        return "utf8_bom", b"\xef\xbb\xbf" + path_body, "any"
    if how == "utf16":
        return "utf16", path_body.decode().encode("utf-16"), "any"
    if how == "whitespace":
        return "whitespace_padding", b" \n\t" * 20000 + path_body + b" " * 1000, "ok"
    if how == "newline":
        return "trailing_newline", path_body + b"\n", "ok"
    if how == "oversize":
        pad = b'"' + b"x" * (t.max_body_bytes + 10) + b'"'
        return "oversize", path_body[:-1] + b',"padding":' + pad + b"}", "reject"
    return "oversize_whitespace", path_body + b" " * (t.max_body_bytes + 10), "reject"


def _framing_case(draw, t: Target, host: str, label: str) -> tuple[str, bytes, str]:
    body = encode(_small_body(draw, t))
    auth = f"Authorization: Bearer {t.api_key}\r\n" if t.api_key else ""
    start = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n{auth}Content-Type: application/json\r\n"
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i : i + 7] for i in range(0, len(body), 7))) + b"0\r\n\r\n"
    cases = {
        "cl_not_number": (f"{start}Content-Length: abc\r\n\r\n".encode() + body, "reject"),
        "cl_negative": (f"{start}Content-Length: -1\r\n\r\n".encode() + body, "reject"),
        "cl_huge": (f"{start}Content-Length: 99999999999999999999999999\r\n\r\n".encode() + body, "reject"),
        "cl_over_limit": (f"{start}Content-Length: {t.max_body_bytes + 1}\r\n\r\n".encode() + body, "reject"),
        "cl_longer_than_body": (f"{start}Content-Length: {len(body) + 10}\r\n\r\n".encode() + body, "reject"),
        "cl_shorter_than_body": (f"{start}Content-Length: {len(body) // 2}\r\n\r\n".encode() + body, "reject"),
        "chunked_valid": (f"{start}Transfer-Encoding: chunked\r\n\r\n".encode() + chunked, "ok"),
        "chunked_bad_size": (f"{start}Transfer-Encoding: chunked\r\n\r\nzz\r\n".encode() + body + b"\r\n0\r\n\r\n", "reject"),
        "chunked_over_limit": (
            f"{start}Transfer-Encoding: chunked\r\n\r\n".encode()
            + b"".join(b"%x\r\n%s\r\n" % (1 << 16, b"x" * (1 << 16)) for _ in range(t.max_body_bytes // (1 << 16) + 2))
            + b"0\r\n\r\n",
            "reject",
        ),
        "te_and_cl": (f"{start}Transfer-Encoding: chunked\r\nContent-Length: {len(body)}\r\n\r\n".encode() + chunked, "any"),
        "header_no_colon": (f"{start}NotAHeader\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body, "reject"),
        "header_huge": (f"{start}X-Big: {'a' * 70000}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body, "any"),
        "many_headers": (
            start.encode() + b"".join(b"X-H%d: v\r\n" % i for i in range(300)) + f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
            "any",
        ),
        "garbage_request_line": (b"GARBAGE\r\n\r\n", "reject"),
        "binary_request_line": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)), "reject"),
        "http10_no_host": (
            f"POST /v1/completions HTTP/1.0\r\n{auth}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body,
            "any",
        ),
        "non_ascii_header": (
            start.encode() + b"X-Note: caf\xc3\xa9 \xff\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
            "any",
        ),
        "absolute_uri": (
            start.replace("POST /v1/completions", f"POST http://{host}/v1/completions").encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
            "any",
        ),
        "expect_continue": (f"{start}Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body, "any"),
        "bad_version": (f"POST /v1/completions HTTP/9.9\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body, "reject"),
        "pipelined": (
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            * 2,
            "any",
        ),
    }
    raw, expect = cases[label]
    return label, raw, expect


# Framing cases whose request is incomplete: the client half-closes after sending (servers may treat a half-close
# as the client going away, so complete requests keep the connection open and ask for Connection: close).
HALF_CLOSE = ("cl_longer_than_body", "chunked_bad_size")
FRAMING_KINDS = (
    "cl_not_number",
    "cl_negative",
    "cl_huge",
    "cl_over_limit",
    "cl_longer_than_body",
    "cl_shorter_than_body",
    "chunked_valid",
    "chunked_bad_size",
    "chunked_over_limit",
    "te_and_cl",
    "header_no_colon",
    "header_huge",
    "many_headers",
    "garbage_request_line",
    "binary_request_line",
    "http10_no_host",
    "non_ascii_header",
    "absolute_uri",
    "expect_continue",
    "bad_version",
    "pipelined",
)


ROUTES = [
    ("GET", "/v1/completions", "reject"),
    ("PUT", "/v1/completions", "reject"),
    ("DELETE", "/v1/chat/completions", "reject"),
    ("POST", "/v1/models", "reject"),
    ("POST", "/v1/completions/", "any"),
    ("POST", "/v1/Completions", "reject"),
    ("POST", "/v2/completions", "reject"),
    ("POST", "/v1/completions?stream=true&x=%00", "ok"),
    ("POST", "/v1/%00", "reject"),
    ("POST", "/" + "a" * 10000, "reject"),
    ("GET", "/health?x=1", "any"),
    ("OPTIONS", "/v1/completions", "any"),
    ("POST", "/health", "reject"),
    ("POST", "/metrics", "reject"),
    ("POST", "/v1/chat/completions", "reject"),  # the last: a completion body on the chat route
]


# Shares of the HTTP cases: each stratum is drawn on its own, so every mutation and malformation gets its
# share (hypothesis favours the first choices of a sampled_from, which would starve the later ones).
HTTP_WEIGHTS = {"valid": 3.0, "mutated": 12.0, "raw_body": 2.0, "framing": 1.0, "route": 0.5}


def http_case(t: Target, host: str = "127.0.0.1"):
    """`http_case(t)(family, sub)`: the hypothesis strategy of one HttpCase of a family ("valid", "mutated" with
    `sub` a mutation, which up to two random ones follow, or a tuple of mutations applied in order,
    "raw_table", "raw_body", "framing", "route")."""
    st = _st()

    @st.composite
    def case(draw, family: str, sub: Any = None) -> HttpCase:
        chat = draw(st.booleans())
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = _headers(t)
        if family == "valid":
            return HttpCase("valid", path, _valid_body(draw, t, chat), "ok", headers=headers)
        if family == "mutated":
            body = _valid_body(draw, t, chat)
            labels, expects, touched = [], [], []
            for mutate in list(sub) if isinstance(sub, tuple) else [sub] + draw(st.lists(_pick(MUTATIONS), max_size=2)):
                if "__pairs__" in body:
                    break
                before = _fingerprint(body, headers)
                label, expect = mutate(draw, t, chat, body, headers)
                after = _fingerprint(body, headers)
                changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
                # A later mutation of the same field may undo an earlier one: the earlier refusal is then uncertain.
                expects = ["any" if e == "reject" and keys & changed else e for e, keys in zip(expects, touched)]
                labels.append(label.replace(",", ";"))
                expects.append(expect)
                touched.append(changed)
            return HttpCase("mutated:" + ", ".join(labels), path, _finish(body), _combine(*expects), headers=headers)
        if family == "raw_table":
            label, raw, expect = sub
            return HttpCase(f"raw_body:{label}", path, raw, expect, headers=headers)
        if family == "raw_body":
            label, raw, expect = _raw_body_case(draw, t, chat, sub)
            return HttpCase(f"raw_body:{label}", path, raw, expect, headers=headers)
        if family == "framing":
            label, raw, expect = _framing_case(draw, t, host, sub)
            return HttpCase(f"framing:{label}", "/v1/completions", None, expect, framing=raw)
        method, route, expect = sub
        body = _small_body(draw, t)
        return HttpCase(
            f"route:{method} {route[:40]}",
            route,
            body if method not in ("GET", "OPTIONS") else None,
            expect,
            method=method,
            headers=headers,
        )

    return case


def http_strata(t: Target, host: str = "127.0.0.1") -> list[tuple[str, float, Any]]:
    """(name, weight, hypothesis strategy of one HttpCase) for every kind of HTTP case."""
    case = http_case(t, host)
    w = HTTP_WEIGHTS
    strata = [("valid", w["valid"], case("valid"))]
    for m in dict.fromkeys(MUTATIONS):
        strata.append((f"mutated:{m.__name__[2:]}", w["mutated"] * MUTATIONS.count(m) / len(MUTATIONS), case("mutated", m)))
    for entry in RAW_BODIES:
        strata.append((f"raw_body:{entry[0]}", w["raw_body"] / 2 / len(RAW_BODIES), case("raw_table", entry)))
    for how in RAW_BODY_KINDS:
        strata.append((f"raw_body:{how}", w["raw_body"] / 2 / len(RAW_BODY_KINDS), case("raw_body", how)))
    for label in FRAMING_KINDS:
        strata.append((f"framing:{label}", w["framing"] / len(FRAMING_KINDS), case("framing", label)))
    for route in ROUTES:
        strata.append((f"route:{route[0]} {route[1][:40]}", w["route"] / len(ROUTES), case("route", route)))
    return strata


# ------------------------------------------------------------------------------------ gRPC strategies

INT32 = (-(2**31), 2**31 - 1)
FLOAT_EXTREMES = [float("nan"), float("inf"), float("-inf"), -0.0, 1e-45, 3.4e38, -3.4e38]


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tag(field_no: int, wire: int) -> bytes:
    return _varint((field_no << 3) | wire)


def _ld(field_no: int, payload: bytes) -> bytes:
    return _tag(field_no, 2) + _varint(len(payload)) + payload


GRPC_WEIGHTS = {"valid": 3.0, "random": 6.0, "raw": 3.0, "other_method": 0.5}
GRPC_RAW_KINDS = (
    "random",
    "truncated",
    "garbage_tail",
    "bad_utf8_model",
    "bad_utf8_prompt",
    "bad_utf8_role",
    "wrong_wire_type",
    "field_zero",
    "overlong_varint",
    "length_past_end",
    "deep_groups",
    "int32_64bit",
    "negative_max_tokens",
    "unknown_fields",
    "oversize",
    "empty",
    "many_stop_token_ids",
    "packed_and_unpacked",
    "huge_length",
)


def grpc_strata(t: Target) -> list[tuple[str, float, Any]]:
    """(name, weight, hypothesis strategy of one GrpcCase) for every kind of gRPC case."""
    st = _st()
    from google.protobuf import text_format

    from protos.moray.v1 import moray_pb2

    def good_or_bad(draw, good, bad):
        if draw(st.integers(0, 4)) == 0:
            return draw(bad), "reject"
        return draw(good), "ok"

    def sampling(draw, valid: bool) -> tuple[Any, list[str], list[str]]:
        s = moray_pb2.SamplingOptions()
        expects, labels = [], []
        floats = {
            "temperature": (st.floats(0, 2), _pick([-1.0, float("nan"), float("inf"), float("-inf")])),
            "top_p": (st.floats(0.01, 1), _pick([0.0, -0.5, 1.5, float("nan")])),
            "min_p": (st.floats(0, 1), _pick([-0.1, 1.5, float("nan")])),
            "presence_penalty": (st.floats(-2, 2), _pick([2.5, -3.0, float("nan")])),
            "frequency_penalty": (st.floats(-2, 2), _pick([2.5, -3.0, float("nan")])),
            "repetition_penalty": (st.floats(0.5, 2), _pick([0.0, -1.0, float("nan"), float("-inf")])),
        }
        ints = {
            "top_k": (_pick([-1, 0, 1, 5, 50]), _pick([-2, INT32[0]])),
            "max_tokens": (st.integers(1, 4), _pick([0, -1, INT32[1], INT32[0], t.max_model_len])),
            "logprobs": (st.integers(0, 5), _pick([-1, 21, INT32[1]])),
        }
        for name in draw(
            st.lists(_pick(sorted(floats) + sorted(ints) + ["seed", "stop", "stop_token_ids", "ignore_eos"]), max_size=6, unique=True)
        ):
            if name in floats:
                good, bad = floats[name]
                if not valid and draw(st.integers(0, 6)) == 0:
                    value, e = draw(_pick(FLOAT_EXTREMES)), "any"
                else:
                    value, e = (draw(good), "ok") if valid else good_or_bad(draw, good, bad)
                setattr(s, name, value)
            elif name in ints:
                good, bad = ints[name]
                value, e = (draw(good), "ok") if valid else good_or_bad(draw, good, bad)
                setattr(s, name, value)
            elif name == "seed":
                value = draw(st.integers(0, 2**31)) if valid else draw(st.integers(-(2**63), 2**63 - 1))
                e = "ok" if 0 <= value < 2**32 else "any"
                s.seed = value
            elif name == "stop":
                bad = st.lists(st.just(""), min_size=1, max_size=2)
                value, e = (
                    (draw(st.lists(_ascii_text(6), max_size=3)), "ok")
                    if valid
                    else good_or_bad(draw, st.lists(_unicode_text(6), max_size=3), bad)
                )
                s.stop.extend(value)
            elif name == "stop_token_ids":
                good = st.lists(st.integers(0, t.vocab_size - 1), max_size=4)
                bad = st.lists(_pick([t.vocab_size, -1, INT32[0], INT32[1]]), min_size=1, max_size=3)
                value, e = (draw(good), "ok") if valid else good_or_bad(draw, good, bad)
                s.stop_token_ids.extend(value)
            else:
                s.ignore_eos = draw(st.booleans())
                e = "ok"
            expects.append(e)
            if e != "ok":
                labels.append(name)
        if valid and not s.HasField("max_tokens"):
            s.max_tokens = draw(st.integers(1, 4))
        return s, expects, labels

    def message(draw, valid: bool):
        req = moray_pb2.GenerateRequest()
        expects, labels = [], []
        if valid:
            req.model = draw(_pick([t.model, ""]))
        else:
            model, e = good_or_bad(draw, _pick([t.model, ""]), _unicode_text(20).filter(lambda m: m != t.model))
            req.model = model
            expects.append(e)
            labels += ["model"] if e != "ok" else []
        kind = draw(_pick(["prompt", "token_ids", "messages"] + ([] if valid else ["none"])))
        budget = _text_budget(t)
        if kind == "prompt":
            good = _ascii_text(budget) | _unicode_text(max(2, budget // 6))
            bad = _pick(["", "lorem ipsum " * (t.max_model_len * 2)])
            value, e = (draw(good), "ok") if valid else good_or_bad(draw, good, bad)
            req.prompt = value
        elif kind == "token_ids":
            good = st.lists(st.integers(0, t.vocab_size - 1), min_size=1, max_size=min(32, max(1, t.max_model_len // 4)))
            bad = st.one_of(
                st.just([]),
                st.lists(st.integers(*INT32), min_size=1, max_size=8).filter(lambda ids: any(not 0 <= i < t.vocab_size for i in ids)),
                st.just([5] * t.max_model_len),
            )
            value, e = (draw(good), "ok") if valid else good_or_bad(draw, good, bad)
            req.token_ids.ids.extend(value)
        elif kind == "messages":
            roles = ["system", "user", "assistant", "developer"]
            good_msgs = st.lists(st.tuples(_pick(roles), _ascii_text(budget // 3 or 1)), min_size=0, max_size=2).map(
                lambda m: m + [("user", "hi")]
            )
            bad_msgs = st.one_of(
                st.just([]),
                st.lists(st.tuples(_unicode_text(8).filter(lambda r: r not in roles + ["tool"]), _ascii_text(8)), min_size=1, max_size=2),
            )
            value, e = (draw(good_msgs), "ok") if valid else good_or_bad(draw, good_msgs, bad_msgs)
            for role, content in value:
                req.messages.messages.add(role=role, content=content)
        else:
            e = "reject"
        expects.append(e)
        if e != "ok":
            labels.append(kind)
        s, s_expects, s_labels = sampling(draw, valid)
        req.sampling.CopyFrom(s)
        expects += s_expects
        labels += s_labels
        if draw(st.booleans()):
            req.session_id = draw(_unicode_text(20)) if valid else draw(_pick(["s1", "x" * 10000, "\x00"]))
        if draw(st.integers(0, 3)) == 0:
            if valid:
                req.request_id = draw(_ascii_text(40))
            else:
                rid, e = good_or_bad(draw, _ascii_text(40), _pick(["r" * 257, "r" * 100000]))
                req.request_id = rid
                expects.append(e)
                labels += ["request_id"] if e != "ok" else []
        return req, _combine(*expects), labels

    def raw_mutation(draw, base: bytes, how: str) -> tuple[str, bytes, str]:
        if how == "random":
            return how, draw(st.binary(min_size=1, max_size=200)), "any"
        if how == "truncated":
            return how, base[: draw(st.integers(0, max(0, len(base) - 1)))], "any"
        if how == "garbage_tail":
            return how, base + draw(st.binary(min_size=1, max_size=50)), "any"
        if how == "bad_utf8_model":
            return how, _ld(1, b"ti\xffny") + base, "reject"
        if how == "bad_utf8_prompt":
            return how, base + _ld(2, b"hello \xed\xa0\x80"), "reject"
        if how == "bad_utf8_role":
            return how, base + _ld(4, _ld(1, _ld(1, b"us\xc3\x28er") + _ld(2, b"hi"))), "reject"
        if how == "wrong_wire_type":
            return how, base + _tag(1, 0) + _varint(7), "any"
        if how == "field_zero":
            return how, base + _tag(0, 0) + _varint(1), "reject"
        if how == "overlong_varint":
            return how, base + _tag(6, 0) + b"\xff" * 11 + b"\x01", "reject"
        if how == "length_past_end":
            return how, base + _tag(2, 2) + _varint(1000) + b"abc", "reject"
        if how == "huge_length":
            return how, base + _tag(2, 2) + _varint(2**62) + b"abc", "reject"
        if how == "deep_groups":
            d = draw(_pick([50, 99, 100, 101, 1000, 100000]))
            return f"deep_groups:{d}", base + _tag(15, 3) * d + _tag(15, 4) * d, "any"
        if how == "int32_64bit":
            return how, base + _ld(5, _tag(5, 0) + _varint(2**40 + 3)), "any"
        if how == "negative_max_tokens":
            return how, base + _ld(5, _tag(5, 0) + _varint(-5)), "reject"
        if how == "unknown_fields":
            return how, base + _ld(99, b"junk") + _tag(100, 0) + _varint(5) + _tag(101, 5) + b"\x00\x00\x80\x7f", "ok"
        if how == "oversize":
            return how, base + _ld(6, b"s" * (t.max_body_bytes + 10)), "reject"
        if how == "empty":
            return how, b"", "reject"
        if how == "many_stop_token_ids":
            ids = b"".join(_varint(i % t.vocab_size) for i in range(100000))
            return how, base + _ld(5, _ld(8, ids) + _tag(5, 0) + _varint(2)), "any"
        # The same repeated field packed and one at a time: both are valid encodings.
        return how, base + _ld(3, _ld(1, _varint(1) + _varint(2)) + _tag(1, 0) + _varint(3)), "any"

    def auth(draw, vary: bool) -> tuple[tuple, str]:
        if not t.api_key:
            return (), "ok"
        how = draw(_pick(["ok"] * 12 + ["missing", "wrong", "basic", "bare"])) if vary else "ok"
        md = {
            "ok": (("authorization", f"Bearer {t.api_key}"),),
            "missing": (),
            "wrong": (("authorization", "Bearer nope"),),
            "basic": (("authorization", f"Basic {t.api_key}"),),
            "bare": (("authorization", t.api_key),),
        }[how]
        return md, "ok" if how == "ok" else "reject"

    @st.composite
    def case(draw, family: str, sub: str | None = None) -> GrpcCase:
        method = draw(_pick(["Generate", "Complete"]))
        md, auth_expect = auth(draw, vary=family != "valid")
        if family == "other_method":
            m = draw(_pick(["ListModels", "Health"]))
            data = draw(_pick([b"", b"\x08\x01", draw(st.binary(max_size=64))]))
            return GrpcCase(f"other_method:{m}", m, data, "any", md)  # these two read nothing from the request
        req, expect, labels = message(draw, valid=family == "valid")
        text = text_format.MessageToString(req, as_one_line=True)
        data = req.SerializeToString()
        if family == "raw":
            how, data, raw_expect = raw_mutation(draw, data, sub)
            return GrpcCase(
                f"raw:{how}",
                method,
                data,
                _combine(raw_expect, auth_expect) if raw_expect != "ok" else _combine(expect, auth_expect),
                md,
                text,
            )
        kind = "valid" if family == "valid" else "random:" + (", ".join(labels) or "in_range")
        return GrpcCase(kind, method, data, _combine(expect, auth_expect), md, text)

    w = GRPC_WEIGHTS
    strata = [
        ("valid", w["valid"], case("valid")),
        ("random", w["random"], case("random")),
        ("other_method", w["other_method"], case("other_method")),
    ]
    for how in GRPC_RAW_KINDS:
        strata.append((f"raw:{how}", w["raw"] / len(GRPC_RAW_KINDS), case("raw", how)))
    return strata


# ------------------------------------------------------------------------------------ drawing


def draw_cases(strategy, n: int, seed: int) -> list:
    """`n` examples of a hypothesis strategy, the same ones for the same seed (and hypothesis version)."""
    if n <= 0:
        return []
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list = []

    @hseed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        out.append(case)

    collect()
    # Hypothesis may stop short when it sees little left to explore; top up with fresh seeds.
    extra = 1
    while len(out) < n and extra < 20:
        more: list = []

        @hseed(seed * 1000 + extra)
        @settings(max_examples=n - len(out), database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def top_up(case):
            more.append(case)

        top_up()
        out += more
        extra += 1
    return out[:n]


def allocate(n: int, weights: list[float]) -> list[int]:
    """`n` split in proportion to `weights` (largest remainders), every stratum at least 1 when n allows."""
    if n <= 0:
        return [0] * len(weights)
    total = sum(weights)
    if n < len(weights):
        order = sorted(range(len(weights)), key=lambda i: -weights[i])
        return [1 if i in set(order[:n]) else 0 for i in range(len(weights))]
    counts = [1] * len(weights)
    rest = n - len(weights)
    shares = [rest * w / total for w in weights]
    counts = [c + int(s) for c, s in zip(counts, shares)]
    left = n - sum(counts)
    for i in sorted(range(len(weights)), key=lambda i: -(shares[i] - int(shares[i])))[:left]:
        counts[i] += 1
    return counts


def draw_strata(strata: list[tuple[str, float, Any]], n: int, seed: int) -> list:
    """`n` cases over the strata (each drawn with its own seed), in a seeded random order."""
    counts = allocate(n, [w for _, w, _ in strata])
    out: list = []
    for i, ((_, _, strategy), k) in enumerate(zip(strata, counts)):
        out += draw_cases(strategy, k, seed * 7919 + i)
    random.Random(seed).shuffle(out)
    return out


# ------------------------------------------------------------------------------------ sending


@dataclass
class Outcome:
    status: str  # "200", "400", ..., or "timeout", "closed", "connection_error", "client_error"; gRPC: code name
    latency: float
    problem: str = ""  # a failure: why (a malformed success, a stream that broke off, a traceback...)
    response: str = ""
    openai_error: bool = True  # an HTTP error body in OpenAI's shape ({"error": {"message": ...}})


async def send_http(session, base: str, case: HttpCase, timeout: float) -> Outcome:
    import aiohttp
    import yarl

    start = time.perf_counter()
    if case.framing is not None:
        return await _send_framing(base, case, timeout)
    try:
        kw: dict[str, Any] = {"headers": case.headers, "timeout": aiohttp.ClientTimeout(total=timeout)}
        body = case.body_bytes()
        if body is not None:
            kw["data"] = body
        url = yarl.URL(base + case.path, encoded=True)  # paths as written (%00 included)
        async with session.request(case.method, url, skip_auto_headers=("Content-Type",), **kw) as r:
            text = (await r.read()).decode("utf-8", "replace")
            latency = time.perf_counter() - start
            problem = _check_http_response(r.status, r.headers.get("content-type", ""), text, case)
            return Outcome(str(r.status), latency, problem, _short(text, 400), r.status < 400 or _error_body_ok(text))
    except asyncio.TimeoutError:
        return Outcome("timeout", time.perf_counter() - start, f"no answer within {timeout:.0f}s")
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        if case.expect == "reject":  # e.g. an oversized body cut off by the server: a refusal
            return Outcome("closed", time.perf_counter() - start, "", f"{type(e).__name__}: {e}")
        return Outcome("connection_error", time.perf_counter() - start, f"{type(e).__name__}: {e}")
    except (ValueError, TypeError, UnicodeError, aiohttp.InvalidURL) as e:  # the client refused to send it (e.g. a header it cannot encode)
        return Outcome("client_error", time.perf_counter() - start, "", f"{type(e).__name__}: {e}")


async def _send_framing(base: str, case: HttpCase, timeout: float) -> Outcome:
    parts = urlsplit(base)
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port or 80), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        return Outcome("connection_error", time.perf_counter() - start, f"cannot connect: {e}")
    try:
        writer.write(case.framing)
        await writer.drain()
        if case.kind.endswith(HALF_CLOSE) and writer.can_write_eof():
            writer.write_eof()  # the request is incomplete: tell the server nothing more comes
        head = await asyncio.wait_for(_read_status(reader), min(timeout, 15.0))
    except asyncio.TimeoutError:
        return Outcome("no_response", time.perf_counter() - start, "", "the server kept the connection open without answering")
    except (ConnectionError, OSError):
        return Outcome("closed", time.perf_counter() - start)
    finally:
        writer.close()
    latency = time.perf_counter() - start
    if not head:
        return Outcome("closed", latency)
    m = re.match(rb"HTTP/\d(?:\.\d)? (\d{3})", head)
    if not m:
        return Outcome("unparsable", latency, "", _short(head, 200))
    text = head.decode("utf-8", "replace")
    problem = "the response carries a traceback" if "Traceback (most recent call last)" in text else ""
    return Outcome(m.group(1).decode(), latency, problem, _short(head, 300))


async def _read_status(reader) -> bytes:
    """The response head up to the first final (non-1xx) status line, e.g. after a 100 Continue."""
    head = b""
    while True:
        chunk = await reader.read(4096)
        if not chunk:
            return head
        head += chunk
        final = re.search(rb"HTTP/\d(?:\.\d)? [2-9]\d\d", head)
        if final or len(head) > 65536:
            return head[final.start() :] if final else head


def _check_http_response(status: int, content_type: str, text: str, case: HttpCase) -> str:
    """What is wrong with a response, beyond its status ("" when nothing)."""
    if "Traceback (most recent call last)" in text:
        return "the response carries a traceback"
    if status != 200 or not case.path.startswith(("/v1/completions", "/v1/chat/completions")) or case.method != "POST":
        return ""
    chat = case.path.startswith("/v1/chat")
    if "text/event-stream" in content_type:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "the stream ended without data: [DONE]"
        for e in events[:-1]:
            try:
                obj = json.loads(e)
            except json.JSONDecodeError:
                return f"a stream event is not JSON: {_short(e, 100)}"
            if "error" in obj:
                return f"the stream carries an error event: {_short(e, 300)}"
            if not isinstance(obj.get("choices"), list):
                return f"a stream event has no choices: {_short(e, 200)}"
        return ""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return "a 200 whose body is not JSON"
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1:
        return "a 200 without exactly one choice"
    if chat and not isinstance((choices[0].get("message") or {}).get("content"), str):
        return "a chat 200 without message.content"
    if not chat and not isinstance(choices[0].get("text"), str):
        return "a completion 200 without text"
    usage = obj.get("usage") or {}
    if not isinstance(usage.get("completion_tokens"), int) or usage["completion_tokens"] < 0:
        return "a 200 without usage.completion_tokens"
    return ""


def _groups(records: list[dict]) -> list[dict]:
    """Server errors grouped by status and the first line of the answer: one entry per distinct defect."""
    groups: dict[tuple[str, str], dict] = {}
    for r in records:
        first = (r.get("response") or r.get("problem") or "").strip().splitlines()
        key = (r["status"], re.sub(r"[0-9a-f]{16,}|\d+", "#", first[0] if first else "")[:160])
        g = groups.setdefault(key, {"status": key[0], "response": key[1], "count": 0, "kinds": {}, "example": r["request"]})
        g["count"] += 1
        kind = r["request"]["kind"].split(", ")[0]
        g["kinds"][kind] = g["kinds"].get(kind, 0) + 1
    out = sorted(groups.values(), key=lambda g: -g["count"])
    for g in out:
        g["kinds"] = dict(sorted(g["kinds"].items(), key=lambda kv: -kv[1])[:10])
    return out


def _error_body_ok(text: str) -> bool:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) and isinstance(obj["error"].get("message"), str)


async def send_grpc(channel, case: GrpcCase, timeout: float) -> Outcome:
    import grpc

    from protos.moray.v1 import moray_pb2

    path = f"/moray.v1.Moray/{case.method}"
    start = time.perf_counter()
    try:
        if case.method == "Generate":
            call = channel.unary_stream(path, request_serializer=None, response_deserializer=moray_pb2.GenerateResponse.FromString)
            msgs = [m async for m in call(case.data, metadata=case.metadata, timeout=timeout)]
            problem = ""
            if not msgs or not msgs[-1].finished:
                problem = "an OK stream that did not finish"
            elif not msgs[-1].HasField("usage"):
                problem = "an OK stream without usage on its last message"
            return Outcome("OK", time.perf_counter() - start, problem, _short(str(msgs[-1]) if msgs else "", 300))
        response_type = {
            "Complete": moray_pb2.CompleteResponse,
            "ListModels": moray_pb2.ListModelsResponse,
            "Health": moray_pb2.HealthResponse,
        }[case.method]
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=response_type.FromString)
        resp = await call(case.data, metadata=case.metadata, timeout=timeout)
        problem = ""
        if case.method == "Complete" and (not resp.request_id or not resp.finish_reason):
            problem = "an OK Complete without request_id / finish_reason (an error reported as success?)"
        return Outcome("OK", time.perf_counter() - start, problem, _short(str(resp), 300))
    except grpc.aio.AioRpcError as e:
        latency = time.perf_counter() - start
        details = e.details() or ""
        problem = "the status details carry a traceback" if "Traceback (most recent call last)" in details else ""
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Outcome("timeout", latency, f"no answer within {timeout:.0f}s")
        return Outcome(e.code().name, latency, problem, _short(details, 400))


# ------------------------------------------------------------------------------------ the run


@dataclass
class Tally:
    """Counts and findings of one protocol."""

    protocol: str
    slow_s: float
    by_status: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    server_errors: list[dict] = field(default_factory=list)
    timeouts: list[dict] = field(default_factory=list)
    malformed: list[dict] = field(default_factory=list)
    slow_rejections: list[dict] = field(default_factory=list)
    accepted_invalid: list[dict] = field(default_factory=list)
    rejected_valid: list[dict] = field(default_factory=list)
    non_openai_error_bodies: dict[str, int] = field(default_factory=dict)
    non_openai_examples: list[dict] = field(default_factory=list)
    rejection_latencies: list[float] = field(default_factory=list)
    slowest_rejection: dict | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"accepted_invalid": 0, "rejected_valid": 0})
    cases: int = 0

    def add(self, case, out: Outcome, alongside: list[str] | None = None) -> None:
        self.cases += 1
        self.by_status[out.status] = self.by_status.get(out.status, 0) + 1
        family = case.kind.split(":", 1)[0]
        self.by_kind.setdefault(family, {})
        self.by_kind[family][out.status] = self.by_kind[family].get(out.status, 0) + 1
        record = {"request": case.describe(), "status": out.status, "latency_s": round(out.latency, 4), "response": out.response}
        if out.problem:
            record["problem"] = out.problem
        ok = out.status in ("200", "OK")
        server_error = (out.status.isdigit() and int(out.status) >= 500) or out.status in SERVER_ERROR_GRPC_CODES
        rejected = (out.status.isdigit() and 400 <= int(out.status) < 500) or out.status in REJECT_GRPC_CODES or out.status == "closed"
        if server_error:
            self.server_errors.append(record)
        elif out.status == "timeout":
            self.timeouts.append(record)
        elif out.problem:
            self.malformed.append(record)
        if rejected:
            self.rejection_latencies.append(out.latency)
            if self.slowest_rejection is None or out.latency > self.slowest_rejection["latency_s"]:
                self.slowest_rejection = record
            if out.latency > self.slow_s:
                self.slow_rejections.append({**record, "in_flight_alongside": (alongside or [])[:40]})
            if self.protocol == "http" and not out.openai_error:
                self.non_openai_error_bodies[out.status] = self.non_openai_error_bodies.get(out.status, 0) + 1
                if len(self.non_openai_examples) < 5:
                    self.non_openai_examples.append(record)
            if case.expect == "ok":
                self.counts["rejected_valid"] += 1
                if len(self.rejected_valid) < 25:
                    self.rejected_valid.append(record)
        if ok and case.expect == "reject":
            self.counts["accepted_invalid"] += 1
            if len(self.accepted_invalid) < 25:
                self.accepted_invalid.append(record)

    def report(self) -> dict:
        lat = sorted(self.rejection_latencies)
        q = lambda p: lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] if lat else 0.0  # noqa: E731
        return {
            "cases": self.cases,
            "by_status": dict(sorted(self.by_status.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
            "server_errors": len(self.server_errors),
            "server_error_examples": self.server_errors[:MAX_EXAMPLES],  # every one, up to MAX_EXAMPLES
            "server_error_groups": _groups(self.server_errors),
            "timeouts": len(self.timeouts),
            "timeout_examples": self.timeouts[:20],
            "malformed_responses": len(self.malformed),
            "malformed_examples": self.malformed[:20],
            "slow_rejections": len(self.slow_rejections),
            "slow_rejection_examples": self.slow_rejections[:20],
            "slowest_rejection": self.slowest_rejection,
            "rejection_latency_p50_s": round(q(50), 4),
            "rejection_latency_p99_s": round(q(99), 4),
            "accepted_invalid": self.counts["accepted_invalid"],
            "accepted_invalid_examples": self.accepted_invalid,
            "rejected_valid": self.counts["rejected_valid"],
            "rejected_valid_examples": self.rejected_valid,
            **(
                {"non_openai_error_bodies": self.non_openai_error_bodies, "non_openai_error_examples": self.non_openai_examples}
                if self.protocol == "http"
                else {}
            ),
        }


async def _http_json(session, method: str, url: str, key: str | None, body: dict | None = None, timeout: float = 60):
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    async with session.request(method, url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text


async def _kv_now(session, base: str) -> dict:
    from bench.soak import kv_state

    async with session.get(base + "/metrics") as r:
        return kv_state(await r.text()) if r.status == 200 else {"error": f"/metrics answered {r.status}"}


async def probe(session, base: str, key: str | None) -> Target:
    """The served model, its context and its vocabulary size (from the refusal of an out-of-range token id)."""
    status, models = await _http_json(session, "GET", base + "/v1/models", key)
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {_short(str(models), 200)}")
    card = models["data"][0]
    vocab = None
    status, body = await _http_json(
        session, "POST", base + "/v1/completions", key, {"model": card["id"], "prompt": [2**31 - 1], "max_tokens": 1}
    )
    if isinstance(body, dict):
        m = re.search(r"\[0, (\d+)\)", str(body.get("error", {}).get("message", "")))
        vocab = int(m.group(1)) if m else None
    return Target(model=card["id"], vocab_size=vocab or 32000, max_model_len=int(card.get("max_model_len") or 2048), api_key=key)


async def greedy_check(session, base: str, t: Target, channel=None) -> dict:
    """Health and one greedy completion (HTTP, and gRPC Complete when a channel is given)."""
    out: dict[str, Any] = {}
    try:
        status, health = await _http_json(session, "GET", base + "/health", None, timeout=30)
        out["health_status"], out["health"] = status, health
        body = {"model": t.model, "prompt": GREEDY_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        status, resp = await _http_json(session, "POST", base + "/v1/completions", t.api_key, body, timeout=120)
        out["completion_status"] = status
        if status == 200:
            out["completion_text"] = resp["choices"][0]["text"]
            out["completion_tokens"] = resp["usage"]["completion_tokens"]
        else:
            out["completion_error"] = _short(str(resp), 300)
    except Exception as e:  # noqa: BLE001 - a server that does not answer is the finding
        out["error"] = f"{type(e).__name__}: {e}"
    if channel is not None:
        from protos.moray.v1 import moray_pb2

        try:
            md = (("authorization", f"Bearer {t.api_key}"),) if t.api_key else ()
            call = channel.unary_unary(
                "/moray.v1.Moray/Health",
                request_serializer=moray_pb2.HealthRequest.SerializeToString,
                response_deserializer=moray_pb2.HealthResponse.FromString,
            )
            out["grpc_health"] = (await call(moray_pb2.HealthRequest(), metadata=md, timeout=30)).status
            req = moray_pb2.GenerateRequest(
                model=t.model, prompt=GREEDY_PROMPT, sampling=moray_pb2.SamplingOptions(temperature=0, max_tokens=8, ignore_eos=True)
            )
            call = channel.unary_unary(
                "/moray.v1.Moray/Complete",
                request_serializer=moray_pb2.GenerateRequest.SerializeToString,
                response_deserializer=moray_pb2.CompleteResponse.FromString,
            )
            resp = await call(req, metadata=md, timeout=120)
            out["grpc_completion_text"], out["grpc_completion_tokens"] = resp.text, resp.usage.completion_tokens
        except Exception as e:  # noqa: BLE001
            out["grpc_error"] = f"{type(e).__name__}: {e}"
    return out


def _greedy_ok(before: dict, after: dict, grpc_too: bool) -> list[str]:
    problems = []
    if after.get("health_status") != 200 or (isinstance(after.get("health"), dict) and after["health"].get("status") != "ok"):
        problems.append(f"/health after the fuzz: {after.get('health_status')} {after.get('health')}")
    if after.get("completion_status") != 200 or after.get("completion_tokens") != 8:
        problems.append(f"the greedy completion after the fuzz failed: {after}")
    elif before.get("completion_text") is not None and after.get("completion_text") != before.get("completion_text"):
        problems.append(f"the greedy completion changed: {before.get('completion_text')!r} -> {after.get('completion_text')!r}")
    if grpc_too:
        if after.get("grpc_health") != "ok" or after.get("grpc_completion_tokens") != 8:
            problems.append(f"gRPC health/greedy completion after the fuzz failed: {after.get('grpc_error') or after.get('grpc_health')}")
        elif after.get("grpc_completion_text") != after.get("completion_text"):
            problems.append(
                f"the gRPC greedy completion differs from HTTP's: {after.get('grpc_completion_text')!r} vs {after.get('completion_text')!r}"
            )
    return problems


async def fuzz(args: argparse.Namespace, base: str) -> dict:
    import aiohttp

    t0 = time.perf_counter()
    deadline = t0 + args.max_seconds
    grpc_n = args.grpc_cases if args.grpc_cases is not None else (args.cases // 5 if args.grpc else 0)
    if grpc_n and not args.grpc:
        raise ValueError("--grpc-cases needs --grpc ADDR")
    channel = None
    if args.grpc:
        import grpc

        channel = grpc.aio.insecure_channel(args.grpc, options=[("grpc.max_receive_message_length", 64 << 20)])
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        target = await probe(session, base, args.api_key)
        host = urlsplit(base).netloc
        _progress(
            f"target: model {target.model!r}, vocab {target.vocab_size}, context {target.max_model_len}; drawing cases (seed {args.seed})"
        )
        loop = asyncio.get_running_loop()
        http_list = await loop.run_in_executor(None, draw_strata, http_strata(target, host), args.cases, args.seed)
        grpc_list = await loop.run_in_executor(None, draw_strata, grpc_strata(target), grpc_n, args.seed + 1) if grpc_n else []
        _progress(f"{len(http_list)} HTTP and {len(grpc_list)} gRPC cases drawn in {time.perf_counter() - t0:.1f}s")
        before = await greedy_check(session, base, target, channel)
        kv_before = await _kv_now(session, base)
        tallies = {"http": Tally("http", args.slow_rejection_s), "grpc": Tally("grpc", args.slow_rejection_s)}
        work: list[tuple[str, Any]] = [("http", c) for c in http_list] + [("grpc", c) for c in grpc_list]
        random.Random(args.seed).shuffle(work)  # both protocols at once, as a server sees them
        total, done, last = len(work), 0, time.monotonic()
        stopped_by_time = False
        queue = iter(work)
        alongside: dict[int, set[str]] = {}
        in_flight: dict[int, str] = {}

        async def worker():
            nonlocal done, last, stopped_by_time
            for proto, case in queue:
                if time.perf_counter() > deadline:
                    stopped_by_time = True
                    return
                # What overlapped each case: the suspects when a rejection is slow.
                key, label = id(case), f"{proto}:{case.kind}"
                for other in alongside.values():
                    other.add(label)
                alongside[key] = set(in_flight.values())
                in_flight[key] = label
                try:
                    if proto == "http":
                        out = await send_http(session, base, case, args.timeout)
                    else:
                        out = await send_grpc(channel, case, args.timeout)
                finally:
                    del in_flight[key]
                    others = sorted(alongside.pop(key))
                tallies[proto].add(case, out, others)
                done += 1
                if time.monotonic() - last > 10 or done == total:
                    last = time.monotonic()
                    h, g = tallies["http"], tallies["grpc"]
                    _progress(
                        f"{done}/{total} cases ({h.cases} HTTP, {g.cases} gRPC), server errors {len(h.server_errors) + len(g.server_errors)}, "
                        f"timeouts {len(h.timeouts) + len(g.timeouts)}, slowest rejection "
                        f"{max((x.slowest_rejection or {}).get('latency_s', 0) for x in (h, g)):.3f}s, {time.perf_counter() - t0:.0f}s"
                    )

        await asyncio.gather(*(worker() for _ in range(max(1, args.concurrency))))
        from bench.soak import wait_drained

        kv_after = await wait_drained(session, base, args.drain_timeout)  # aborted work settles first
        after = await greedy_check(session, base, target, channel)
    if channel is not None:
        await channel.close()
    problems = _greedy_ok(before, after, channel is not None)
    report = {
        "url": base,
        "grpc_address": args.grpc,
        "seed": args.seed,
        "target": {"model": target.model, "vocab_size": target.vocab_size, "max_model_len": target.max_model_len},
        "cases_requested": {"http": args.cases, "grpc": grpc_n},
        "cases_run": {"http": tallies["http"].cases, "grpc": tallies["grpc"].cases},
        "stopped_by_time": stopped_by_time,
        "max_seconds": args.max_seconds,
        "wall_s": round(time.perf_counter() - t0, 1),
        "http": tallies["http"].report(),
        "grpc": tallies["grpc"].report(),
        "check_before": before,
        "check_after": after,
        "server_ok_after": not problems,
        "server_check_problems": problems,
        # Not a failure criterion (the fuzz is about input handling), but a leak is a finding.
        "kv_before": kv_before,
        "kv_after": kv_after,
    }
    report["slow_rejection_s"] = args.slow_rejection_s
    report["failures"] = failures(report)
    report["passed"] = not report["failures"]
    return report


def failures(report: dict) -> list[str]:
    out = []
    for proto in ("http", "grpc"):
        r = report[proto]
        if r["server_errors"]:
            out.append(f"{proto}: {r['server_errors']} server errors (5xx / UNKNOWN / INTERNAL / DATA_LOSS / UNAVAILABLE)")
        if r["timeouts"]:
            out.append(f"{proto}: {r['timeouts']} requests got no answer in time")
        if r["malformed_responses"]:
            out.append(
                f"{proto}: {r['malformed_responses']} malformed responses (broken streams, error events, tracebacks, empty successes)"
            )
        if r["slow_rejections"]:
            out.append(f"{proto}: {r['slow_rejections']} rejections slower than {report.get('slow_rejection_s', 2.0)}s")
    out += report["server_check_problems"]
    return out


def _progress(msg: str) -> None:
    print(f"[fuzz] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    base = check_url(args.url)
    if args.grpc:
        check_grpc_address(args.grpc)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ValueError("moray bench fuzz needs hypothesis: pip install 'moray[test]' (or pip install hypothesis)") from None
    report = asyncio.run(fuzz(args, base))
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    report_if_asked(args, "fuzz", report)
    summary = ", ".join(f"{p}: {report['cases_run'][p]} cases {report[p]['by_status']}" for p in ("http", "grpc") if report["cases_run"][p])
    _progress(f"{summary}; {'PASSED' if report['passed'] else 'FAILED: ' + '; '.join(report['failures'])}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
