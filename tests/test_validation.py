"""The request-validation layer (cluster/validation.py) in process, the ingress's error mapping with a fake
orchestrator, and AsyncEngine's duplicate-id guard. End-to-end cases are in test_cluster.py's tables."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import fakes
import grpc
import pytest
from fakes import FakeContext, ScriptedOrchestrator, frontend_without_workers

from cluster import openai_api as oa
from cluster import validation
from cluster.grpc_service import ClientErrorLogFilter
from protos.moray.v1 import moray_pb2
from workers.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.models.make_model import make_model

    return make_model(tmp_path_factory.mktemp("validation") / "tiny", "qwen3_moe", "tiny", seed=11)


@pytest.fixture(scope="module")
def validator(model_dir):
    from workers.models import load_config
    from workers.models.tokenizer import Tokenizer

    _, cfg = load_config(str(model_dir))
    return validation.RequestValidator(
        model_name="tiny",
        vocab_size=cfg.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        tokenizer=Tokenizer.from_dir(model_dir),
        max_body_bytes=1 << 20,
    )


def api_error(fn, *args) -> oa.APIError:
    with pytest.raises(oa.APIError) as e:
        result = fn(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    return e.value


def completions(validator, body: dict | bytes) -> list:
    """The Checked of each prompt of a completions request."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(validator.completion(validation.parse_request(raw, oa.CompletionRequest)))


def completion(validator, body: dict | bytes):
    (checked,) = completions(validator, body)
    return checked


def chat(validator, body: dict | bytes):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return asyncio.run(validator.chat(validation.parse_request(raw, oa.ChatCompletionRequest)))


def refused(fn, validator, body) -> oa.APIError:
    with pytest.raises(oa.APIError) as e:
        fn(validator, body)
    return e.value


GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# ------------------------------------------------------------------------------------- JSON bodies


def test_integer_past_the_int_conversion_limit_is_a_400(validator):
    raw = b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"
    e = refused(completion, validator, raw)
    assert e.status == 400 and "digits" in e.message


def test_lone_surrogate_is_a_400_naming_the_field(validator):
    e = refused(completion, validator, b'{"model": "tiny", "prompt": "ab\\ud800cd"}')
    assert e.status == 400 and e.param == "prompt" and "unicode" in e.message.lower()
    e = refused(chat, validator, b'{"model": "tiny", "messages": [{"role": "user", "content": "x\\udc00"}]}')
    assert e.param == "messages.0.content"
    # A proper pair is one character (an emoji), and fine.
    assert completion(validator, b'{"model": "tiny", "prompt": "ab\\ud83d\\ude00cd", "max_tokens": 2}').prompt


@pytest.mark.parametrize("depth", [100, 200_000])
def test_deeply_nested_json_is_a_400(validator, depth):
    raw = b'{"model": "tiny", "prompt": "hi", "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    assert len(raw) < 1 << 20
    e = refused(completion, validator, raw)
    assert e.status == 400 and "nested" in e.message


def test_nan_and_other_non_json_constants_are_a_400(validator):
    assert "NaN" in refused(completion, validator, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}').message


@pytest.mark.parametrize(
    "field,value",
    [("max_tokens", "16"), ("max_tokens", True), ("max_tokens", 16.0), ("stream", "yes"), ("temperature", "0.5"), ("prompt", [1, True])],
)
def test_types_are_strict(validator, field, value):
    e = refused(completion, validator, {**GOOD, field: value})
    assert e.status == 400 and field in e.message


def test_stream_options_need_stream(validator):
    e = refused(completion, validator, {**GOOD, "stream_options": {"include_usage": True}})
    assert e.param == "stream_options" and "stream" in e.message
    assert completion(validator, {**GOOD, "stream": True, "stream_options": {"include_usage": True}})


def test_top_logprobs_needs_logprobs(validator):
    e = refused(chat, validator, {**CHAT, "top_logprobs": 2})
    assert e.param == "top_logprobs" and "logprobs" in e.message
    assert chat(validator, {**CHAT, "logprobs": True, "top_logprobs": 2}).params.logprobs == 2


UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]),
]


@pytest.mark.parametrize(
    "field,value",
    UNSUPPORTED + [("suffix", "tail"), ("best_of", 2), ("use_beam_search", True), ("include_stop_str_in_output", True)],
)
def test_unsupported_completion_fields_are_a_400(validator, field, value):
    e = refused(completion, validator, {**GOOD, field: value})
    assert e.status == 400 and e.param == field and "not supported" in e.message


@pytest.mark.parametrize(
    "field,value",
    [u for u in UNSUPPORTED if u[0] not in ("tools", "tool_choice")]
    + [("echo", True), ("chat_template", "{{ messages }}"), ("skip_special_tokens", False), ("add_special_tokens", True)],
)
def test_unsupported_chat_fields_are_a_400(validator, field, value):
    e = refused(chat, validator, {**CHAT, field: value})
    assert e.status == 400 and e.param == field and "not supported" in e.message


@pytest.mark.parametrize("fn,body", [("completion", GOOD), ("chat", CHAT)])
def test_unknown_top_level_fields_are_refused_by_name_documented_ones_are_not(validator, fn, body):
    """Issue #29: unknown fields were silently dropped at the top level (nested ones were refused). Now
    every field is accepted, ignored for a documented reason, or refused by name; vLLM's documented no-op
    values pass."""
    check = completion if fn == "completion" else chat
    e = refused(check, validator, {**body, "temprature": 0.5})
    assert e.status == 400 and e.param == "temprature" and "unknown field" in e.message
    ignored = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "request_id": "mine", "priority": 3}
    defaults = {"use_beam_search": False, "skip_special_tokens": True, "include_stop_str_in_output": False, "cache_salt": None}
    assert check(validator, {**body, **ignored, **defaults}).params.max_tokens == 2


def test_what_sglang_router_forwards_is_accepted(validator):
    """sglang-router 0.3.2 adds SGLang's fields to every request it forwards (captured bodies): accepted at
    those values (found by `bench routing --peer sglang-router` once unknown fields were refused)."""
    completion(
        validator,
        {**GOOD, "echo": False, "no_stop_trim": False, "ignore_eos": True, "skip_special_tokens": True, "return_hidden_states": False},
    )
    extra = {"no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True}
    chat(
        validator, {**CHAT, "logprobs": False, **extra, "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
    )
    assert refused(chat, validator, {**CHAT, "no_stop_trim": True}).param == "no_stop_trim"


def test_batched_prompts_n_and_scoring_requests(validator):
    """A list of prompts is one Checked each (echo texts kept); max_tokens 0 scores the prompt: only with
    echo, one engine token nobody sees, prompt logprobs as many as asked; n is bounded."""
    out = completions(validator, {**GOOD, "prompt": ["ab", "cd"], "echo": True, "logprobs": 2, "max_tokens": 0})
    assert [c.echo for c in out] == ["ab", "cd"] and all(c.score_only and c.params.max_tokens == 1 for c in out)
    assert all(c.params.prompt_logprobs == 2 for c in out)
    ids = completions(validator, {**GOOD, "prompt": [[5, 6], [7, 8, 9]]})
    assert [c.prompt for c in ids] == [[5, 6], [7, 8, 9]] and not ids[0].score_only and ids[0].echo is None
    e = refused(completion, validator, {**GOOD, "max_tokens": 0})
    assert e.param == "max_tokens" and "echo" in e.message
    e = refused(completion, validator, {**GOOD, "prompt": ["ab", ""]})
    assert "prompt[1]" in e.message
    e = refused(completion, validator, {**GOOD, "prompt": [[5], [99999]]})
    assert "prompt[1]" in e.message and "vocabulary" in e.message
    for n in (0, 129):
        assert refused(completion, validator, {**GOOD, "n": n}).param == "n"
    assert completion(validator, {**GOOD, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})


@pytest.mark.parametrize(
    "field,value",
    [("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"), ("logit_bias", {}), ("best_of", 1), ("suffix", None)],
)
def test_values_that_ask_for_nothing_are_accepted(validator, field, value):
    assert completion(validator, {**GOOD, field: value}).params.max_tokens == 2


# ------------------------------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields,kind",
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}}, "json"),
        ({"structured_outputs": {"json": SCHEMA}}, "json"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice"),
        ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar"),
        ({"guided_json": json.dumps(SCHEMA)}, "json"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"guided_choice": ["x", "y"]}, "choice"),
        ({"guided_grammar": 'start: "a"+'}, "grammar"),
    ],
)
def test_structured_output_fields(validator, fields, kind):
    for build, body in ((completion, GOOD), (chat, CHAT)):
        assert build(validator, {**body, **fields}).params.structured.kind == kind
    assert completion(validator, {**GOOD, "response_format": {"type": "text"}}).params.structured is None


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", '"schema"'),
        ({"response_format": {"type": "xml"}}, "response_format", "unknown type"),
        ({"response_format": {"type": "text", "extra": 1}}, "response_format", "unknown key"),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "unknown key"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "only one"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
        ({"guided_regex": "(unclosed"}, "response_format", "cannot be compiled"),
        ({"guided_grammar": "start: undefined_rule"}, "response_format", "cannot be compiled"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "response_format", "cannot be compiled"),
    ],
)
def test_bad_structured_outputs_are_a_400_naming_the_field(validator, fields, param, words):
    e = refused(completion, validator, {**GOOD, **fields})
    assert e.status == 400 and e.param == param and words in e.message, e.message


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_tools_render_and_force_a_call(validator):
    auto = chat(validator, {**CHAT, "tools": TOOLS})
    assert auto.tool_format == "qwen" and auto.params.structured is None
    assert "get_weather" in validator.tokenizer.decode(auto.prompt)  # rendered through the template
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = chat(validator, {**CHAT, "tools": TOOLS, "tool_choice": choice})
        assert forced.params.structured.kind == "lark" and "get_weather" in forced.params.structured.value
    none = chat(validator, {**CHAT, "tools": TOOLS, "tool_choice": "none"})
    assert none.tool_format is None and "get_weather" not in validator.tokenizer.decode(none.prompt)
    tool_turn = [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert chat(validator, {**CHAT, "messages": tool_turn, "tools": TOOLS}).prompt


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"tools": "f"}, "tools", "must be a list"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
        ({"tools": [{"type": "retrieval"}]}, "tools", '"type": "function"'),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ],
)
def test_bad_tools_are_a_400(validator, fields, param, words):
    e = refused(chat, validator, {**CHAT, **fields})
    assert e.status == 400 and e.param == param and words in e.message, e.message


def test_logit_bias_and_allowed_token_ids(validator):
    params = completion(
        validator, {**GOOD, "logit_bias": {"5": 10, "7": -100.0}, "allowed_token_ids": [9, 3, 9], "bad_words": ["x y"]}
    ).params
    assert params.logit_bias == ((5, 10.0), (7, -100.0)) and params.allowed_token_ids == (3, 9) and params.bad_words == ("x y",)
    for body, param, words in [
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": True}}, "logit_bias", "[-100, 100]"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty"),
        ({"allowed_token_ids": [100000]}, "allowed_token_ids", "outside the vocabulary"),
        ({"bad_words": [""]}, "bad_words", "non-empty strings"),
    ]:
        e = refused(completion, validator, {**GOOD, **body})
        assert e.status == 400 and e.param == param and words in e.message, e.message


# ------------------------------------------------------------------------------------- context, vocabulary


def test_max_tokens_past_the_context_is_a_400_with_the_numbers(validator):
    prompt = list(range(1, 11))
    e = refused(completion, validator, {**GOOD, "prompt": prompt, "max_tokens": 1000})
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert (
        f"{MAX_MODEL_LEN}" in e.message
        and "1010" in e.message
        and "10 in the prompt" in e.message
        and "1000 in the completion" in e.message
    )
    assert completion(validator, {**GOOD, "prompt": prompt, "max_tokens": MAX_MODEL_LEN - 10}).params.max_tokens == MAX_MODEL_LEN - 10
    # An unset max_tokens is the default, cut to the room left.
    assert completion(validator, {"model": "tiny", "prompt": list(range(1, MAX_MODEL_LEN - 5))}).params.max_tokens == 6
    assert completion(validator, {"model": "tiny", "prompt": [1, 2]}).params.max_tokens == validation.DEFAULT_MAX_TOKENS


def test_stop_token_ids_outside_the_vocabulary_are_a_400(validator):
    e = refused(completion, validator, {**GOOD, "stop_token_ids": [1, 10**6]})
    assert e.status == 400 and e.param == "stop_token_ids" and "vocabulary" in e.message
    req = moray_pb2.GenerateRequest(model="tiny", prompt="hi", sampling=moray_pb2.SamplingOptions(stop_token_ids=[99999]))
    assert "vocabulary" in api_error(validator.grpc, req).message


def test_chat_message_with_junk_tool_calls_is_a_400(validator):
    e = refused(
        chat,
        validator,
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": "junk"}]},
    )
    assert e.status == 400 and e.param.startswith("messages")
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}}
    ok = chat(
        validator,
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}],
            "max_tokens": 2,
        },
    )
    assert ok.prompt


def test_a_template_that_raises_anything_is_a_400(validator, monkeypatch):
    def boom(*a, **kw):
        raise TypeError("Object of type Undefined is not JSON serializable")

    monkeypatch.setattr(validator.tokenizer, "apply_chat_template", boom)
    e = refused(chat, validator, CHAT)
    assert e.status == 400 and e.param == "messages" and "TypeError" in e.message


# ------------------------------------------------------------------------------------- gRPC requests


def test_grpc_undecodable_bytes_are_a_400(validator):
    e = api_error(validator.parse_grpc, b"\xff\xff\xff not a protobuf")
    assert e.status == 400 and "GenerateRequest" in e.message and "\n" not in e.message


def test_grpc_size_limit_is_checked_before_decoding_or_tokenising(validator, monkeypatch):
    monkeypatch.setattr(validator, "_encode", lambda *a: pytest.fail("tokenised an oversized request"))
    big = moray_pb2.GenerateRequest(model="tiny", prompt="x" * (2 << 20))
    for request in (big, big.SerializeToString()):
        assert api_error(validator.parse_grpc, request).status == 413
    ok = moray_pb2.GenerateRequest(model="tiny", prompt="hi")
    assert validator.parse_grpc(ok.SerializeToString()) == ok


def test_grpc_sampling_uses_the_same_rules(validator):
    req = moray_pb2.GenerateRequest(
        model="tiny", token_ids=moray_pb2.TokenIds(ids=[1, 2, 3]), sampling=moray_pb2.SamplingOptions(max_tokens=1000)
    )
    assert "maximum context length" in api_error(validator.grpc, req).message
    req = moray_pb2.GenerateRequest(model="tiny", token_ids=moray_pb2.TokenIds(ids=[1, 2, 3]))
    assert asyncio.run(validator.grpc(req)).params.max_tokens == validation.DEFAULT_MAX_TOKENS
    req = moray_pb2.GenerateRequest(model="tiny", prompt="hi", request_id="x" * 1000)
    assert api_error(validator.grpc, req).param == "request_id"


def test_grpc_developer_role_is_a_system_message_as_over_http(validator):
    """Found by `moray bench fuzz`: HTTP accepted "developer" (OpenAI's newer name for system), gRPC refused it."""
    msgs = moray_pb2.ChatMessages(
        messages=[moray_pb2.ChatMessage(role="developer", content="Be brief."), moray_pb2.ChatMessage(role="user", content="hi")]
    )
    developer = asyncio.run(validator.grpc(moray_pb2.GenerateRequest(model="tiny", messages=msgs)))
    msgs.messages[0].role = "system"
    system = asyncio.run(validator.grpc(moray_pb2.GenerateRequest(model="tiny", messages=msgs)))
    assert developer.prompt == system.prompt


def test_long_prompts_are_tokenised_off_the_event_loop(validator):
    text = "The quick brown fox jumps over the lazy dog. " * 20000  # ~0.9 MB: about a second of tokenising

    async def main():
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        ids = await validator.encode(text)
        elapsed = time.perf_counter() - start
        done.set()
        await task
        return ids, elapsed, max(gaps)

    ids, elapsed, worst_gap = asyncio.run(main())
    assert ids == validator.tokenizer.encode(text)
    assert worst_gap < 0.5 * elapsed, (worst_gap, elapsed)


# ------------------------------------------------------------------------------------- worker errors and logs


def ray_task_error(cause: BaseException) -> BaseException:
    """What a Serve handle raises for a replica's exception: the remote traceback in str(), the cause kept."""
    from ray.exceptions import RayTaskError

    return RayTaskError(
        "DecodeServer.generate", f'Traceback (most recent call last):\n  File "engine.py"\n{cause!r}', cause
    ).as_instanceof_cause()


def test_worker_errors_become_one_line_client_errors():
    cause = ValueError("stop token id 99999 is outside the vocabulary [0, 512)")
    wrapped = ray_task_error(cause)
    assert isinstance(wrapped, ValueError) and "engine.py" in str(wrapped)  # the remote frames
    err = validation.client_error(wrapped)
    assert err.status == 400 and err.message == str(cause)
    assert validation.client_error(ray_task_error(RuntimeError("boom"))) is None
    assert validation.one_line(ValueError("first\nTraceback ...")) == "first"


def test_log_filter_turns_client_errors_into_one_info_line():
    from ray.serve.exceptions import gRPCStatusError

    f = ClientErrorLogFilter()

    def record(exc):
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", (), sys.exc_info())

    r = record(gRPCStatusError(oa.APIError(400, "bad thing"), grpc.StatusCode.INVALID_ARGUMENT, "bad thing"))
    assert f.filter(r) and r.levelno == logging.INFO and r.exc_info is None and "bad thing" in r.getMessage()
    r = record(oa.APIError(404, "no such model"))
    assert f.filter(r) and r.levelno == logging.INFO and r.exc_info is None
    r = record(oa.APIError(500, "internal error: KeyError", "server_error"))
    assert f.filter(r) and r.levelno == logging.ERROR and r.exc_info is not None
    r = record(RuntimeError("a real bug"))
    assert f.filter(r) and r.levelno == logging.ERROR and r.exc_info is not None


# ------------------------------------------------------------------------------------- the ingress, in process


@pytest.fixture(scope="module")
def ingress(model_dir):
    return frontend_without_workers(model_dir)


WORKER_REFUSAL = ray_task_error(ValueError("stop token id 99999 is outside the vocabulary [0, 512)"))


def http_request(body: dict, path: str = "/v1/completions"):
    return fakes.http_request(body, path, stay=False)


@pytest.mark.parametrize("stream", [False, True])
def test_http_worker_value_error_is_a_400_without_traceback(ingress, monkeypatch, stream):
    monkeypatch.setattr(ingress.pipeline, "orchestrator", ScriptedOrchestrator(error=WORKER_REFUSAL))
    response = asyncio.run(ingress.completions(http_request({**GOOD, "stream": stream})))
    body = json.loads(response.body)
    assert response.status_code == 400, body
    assert body["error"]["message"] == "stop token id 99999 is outside the vocabulary [0, 512)"


def test_http_worker_crash_is_a_500_without_traceback(ingress, monkeypatch):
    monkeypatch.setattr(ingress.pipeline, "orchestrator", ScriptedOrchestrator(error=KeyError("kv")))
    response = asyncio.run(ingress.completions(http_request(GOOD)))
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["message"] == "internal error: KeyError"


def test_grpc_worker_value_error_is_invalid_argument_with_one_line(ingress, monkeypatch):
    monkeypatch.setattr(ingress.pipeline, "orchestrator", ScriptedOrchestrator(error=WORKER_REFUSAL))
    request = moray_pb2.GenerateRequest(model="tiny", prompt="hi").SerializeToString()

    async def generate(ctx):
        return [m async for m in ingress.Generate(request, grpc_context=ctx)]

    ctx = FakeContext()
    with pytest.raises(oa.APIError):
        asyncio.run(generate(ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.details == "stop token id 99999 is outside the vocabulary [0, 512)"
    ctx = FakeContext()
    assert asyncio.run(ingress.Complete(request, grpc_context=ctx)) == moray_pb2.CompleteResponse()
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "Traceback" not in ctx.details


def test_grpc_client_errors_in_unary_calls_are_returned_not_raised(ingress):
    # Raising makes Serve log the error with its traceback twice (replica and proxy); a unary call
    # returns with the status set instead.
    ctx = FakeContext()
    asyncio.run(ingress.Complete(b"\x08\x96\x01garbage", grpc_context=ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "GenerateRequest" in ctx.details
    ctx = FakeContext()
    big = moray_pb2.GenerateRequest(model="tiny", prompt="x" * (2 << 20)).SerializeToString()
    asyncio.run(ingress.Complete(big, grpc_context=ctx))
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_grpc_same_client_request_id_twice_at_once(ingress, monkeypatch):
    fake = ScriptedOrchestrator(tokens=3, delay=0.01)
    monkeypatch.setattr(ingress.pipeline, "orchestrator", fake)
    request = moray_pb2.GenerateRequest(model="tiny", prompt="hi", request_id="mine")

    async def generate():
        return [m async for m in ingress.Generate(request, grpc_context=FakeContext())]

    async def main():
        return await asyncio.gather(generate(), generate())

    a, b = asyncio.run(main())
    assert a[-1].finished and b[-1].finished
    assert {m.request_id for m in a + b} == {"mine"}  # the client's id is echoed ...
    assert len(set(fake.ids)) == 2 and "mine" not in fake.ids  # ... but never used inside


# ------------------------------------------------------------------------------------- AsyncEngine


class FakeCore:
    """Just enough of EngineCore for AsyncEngine: requests wait until `finish` is called."""

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.to_finish: list[str] = []

    def add_request(self, request_id, prompt, params, hold_kv=False, kv_import=None, session_id=None, resume=None):
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = 0

    def has_unfinished(self):
        return bool(self.to_finish)

    def step(self):
        from workers.messages import TokenDelta

        out = [TokenDelta(rid, [5], "", 1, 0, "length") for rid in self.to_finish]
        for rid in self.to_finish:
            self.requests.pop(rid, None)
        self.to_finish = []
        return out

    def abort(self, request_id):
        self.requests.pop(request_id, None)


def test_async_engine_duplicate_id_never_touches_the_running_stream():
    from workers.engine.async_engine import AsyncEngine

    core = FakeCore()
    engine = AsyncEngine(None, core=core)

    async def main():
        first = await engine.add_request("r1", [1], SamplingParams())
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("r1", [1], SamplingParams())
        assert "r1" in core.requests  # the running request is untouched
        engine.submit(lambda c: c.to_finish.append("r1"))
        outs = [out async for out in first]  # the first stream still gets its output
        return outs

    try:
        outs = asyncio.run(asyncio.wait_for(main(), timeout=10))
    finally:
        engine.shutdown()
    assert outs[-1].finished and outs[-1].token_ids == [5]


@pytest.mark.parametrize(
    "method, path, status, words",
    [
        ("GET", "/v1/nope", 404, "unknown route: GET /v1/nope"),
        ("POST", "/", 404, "unknown route"),
        ("DELETE", "/v1/completions", 405, "method DELETE is not allowed on /v1/completions"),
        ("PUT", "/health", 405, "not allowed"),
    ],
)
def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(method, path, status, words):
    """Found by `moray bench fuzz`: FastAPI's `{"detail": "Not Found"}` is not what OpenAI clients parse."""
    from starlette.testclient import TestClient

    from cluster.frontend import api

    r = TestClient(api).request(method, path)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"] in ("not_found_error", "invalid_request_error"), error
    if status == 405:
        assert "allow" in {k.lower() for k in r.headers}


def test_chat_marks_where_shared_prefixes_end(validator):
    """The chat path sets `prefix_boundaries` (a hybrid model keeps its state there): the end of the
    system prompt with the tools, and of the conversation before its last message; each is exactly the
    token count of that part rendered alone, and a prefix of the prompt. The user's own are kept."""
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]
    system = {"role": "system", "content": "Be brief."}
    turns = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "go"},
    ]
    body = {"model": "tiny", "messages": [system, *turns], "max_tokens": 2, "tools": tools}
    checked = chat(validator, body)
    tok = validator.tokenizer

    def tokens(messages) -> int:
        text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False, tools=tools)
        return len(validator._encode(text, add_special_tokens=False))

    expected = [tokens([system]), tokens([system, *turns[:2]])]
    assert list(checked.params.prefix_boundaries) == expected and expected[0] < expected[1] < len(checked.prompt)
    assert chat(validator, {**body, "messages": turns[:1]}).params.prefix_boundaries == ()  # nothing shared to mark
    mine = chat(validator, {**body, "prefix_boundaries": [5]}).params.prefix_boundaries
    assert list(mine) == sorted({5, *expected})
    assert completion(validator, {**GOOD, "prefix_boundaries": [3]}).params.prefix_boundaries == (3,)
    e = refused(completion, validator, {**GOOD, "prefix_boundaries": [0]})
    assert e.status == 400 and e.param == "prefix_boundaries"
    # gRPC: messages input gets the same (no tools here), the field's own are kept.
    grpc_messages = [moray_pb2.ChatMessage(role="system", content=system["content"]), moray_pb2.ChatMessage(role="user", content="go")]
    req = moray_pb2.GenerateRequest(
        model="tiny",
        messages=moray_pb2.ChatMessages(messages=grpc_messages),
        sampling=moray_pb2.SamplingOptions(prefix_boundaries=[2]),
    )
    system_alone = tok.apply_chat_template([system], add_generation_prompt=False, tokenize=False)
    got = asyncio.run(validator.grpc(req)).params.prefix_boundaries
    assert list(got) == [2, len(validator._encode(system_alone, add_special_tokens=False))]
