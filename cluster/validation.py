"""The request-validation layer shared by the HTTP (OpenAI) and gRPC front ends.

Everything a client sends is checked here, in the ingress, before anything reaches a worker: body size
(before parsing or tokenising), JSON shape (nesting depth, lone surrogates, oversized numbers), strict
types, unsupported OpenAI fields, chat messages, the prompt (length, token ids in the vocabulary), and
the sampling parameters (ranges, stop token ids in the vocabulary, prompt + max_tokens within the
context). Every failure is an `APIError` (HTTP 4xx, gRPC INVALID_ARGUMENT and friends) with a one-line
message; no traceback ever reaches a client.

The engine validates again when a request enters it (`EngineCore.validate`); a `ValueError` coming back
from a worker is mapped to a 400 / INVALID_ARGUMENT by `client_error` here, never to a 500 / INTERNAL.

Tokenising a long prompt and rendering a chat template take time (about a second per MiB): both run on a
worker thread (`encode_batch` releases the GIL, `encode` does not), so the ingress event loop keeps
serving other requests and health probes meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from google.protobuf.message import DecodeError
from pydantic import BaseModel, ValidationError

from protos.moray.v1 import moray_pb2
from workers.engine.sampling_params import SamplingParams, StructuredOutputs
from workers.engine.structured import GrammarCompiler, GrammarError

from . import openai_api as oa
from . import tool_calls
from .reasoning import prompt_opens_reasoning, template_tags

log = logging.getLogger("moray.cluster")

# Deeper JSON than this is refused (real requests need ~6 levels; JSON schemas of tools a few more).
MAX_JSON_DEPTH = 64
# A client-chosen gRPC request id is echoed in every response message: keep it short.
MAX_REQUEST_ID_CHARS = 256
# Prompts shorter than this are tokenised inline: a thread hop costs more than the work.
OFFLOAD_CHARS = 4096
DEFAULT_MAX_TOKENS = 16

_GRPC_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
)


def _grpc_structured(s: moray_pb2.SamplingOptions) -> StructuredOutputs | None:
    kind = s.WhichOneof("structured")
    if kind is None or (kind == "json_object" and not s.json_object):
        return None
    value = list(s.choice.choices) if kind == "choice" else getattr(s, kind)
    try:
        return StructuredOutputs.from_fields(**{kind: value})
    except ValueError as e:
        raise oa.APIError(400, f"sampling.{kind}: {e}", param=kind) from None


# `\uD800`-`\uDFFF` escapes: the only way a JSON body can carry a surrogate (raw UTF-8 cannot).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class Checked:
    """A request that passed validation: what the orchestrator needs."""

    prompt: list[int]
    params: SamplingParams
    # Chat requests of a thinking model (cluster/reasoning.py): whether the output starts inside
    # <think> (True/False); None when the output is not split into reasoning and content.
    reasoning: bool | None = None
    reasoning_tags: str = "think"  # the tag set (cluster.reasoning.TAGS) the output is split by
    # Chat requests with tools: the tool-call format to parse the output with (cluster/tool_calls.py).
    tool_format: str | None = None
    # Completions with echo: the prompt's text, sent before the output. max_tokens 0 (scoring the prompt):
    # the engine samples one token (on the prefill worker, which then finishes) that nobody is sent.
    echo: str | None = None
    score_only: bool = False


# ----------------------------------------------------------------------------------- worker errors


def one_line(e: BaseException, limit: int = 500) -> str:
    """The message of an exception without any traceback: unwraps Ray's task errors, keeps the first line."""
    seen = 0
    while getattr(e, "cause", None) is not None and seen < 8:  # RayTaskError(ValueError) -> the ValueError
        e = e.cause
        seen += 1
    text = str(e).strip()
    line = text.splitlines()[0].strip() if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def client_error(e: BaseException) -> oa.APIError | None:
    """A worker-side error caused by the request (the engine's `ValueError`s) as a 400; else None."""
    if isinstance(e, oa.APIError):
        return e
    if isinstance(e, ValueError):
        return oa.APIError(400, one_line(e))
    return None


# ----------------------------------------------------------------------------------- JSON bodies


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise oa.APIError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except UnicodeDecodeError as e:
        raise oa.APIError(400, f"the body is not valid JSON: it is not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise oa.APIError(400, f"the body is not valid JSON: {e}") from None
    except ValueError:  # int() past sys.get_int_max_str_digits(): the only other ValueError json.loads raises
        raise oa.APIError(400, f"the body is not valid JSON: a number has more than {sys.get_int_max_str_digits()} digits") from None
    if not isinstance(data, dict):
        raise oa.APIError(400, "the body must be a JSON object")
    # Cheap byte-level tests decide whether the tree needs walking at all (most bodies do not).
    deep = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    surrogates = _SURROGATE_ESCAPE.search(raw) is not None
    if deep or surrogates:
        _check_tree(data, deep, surrogates)
    return data


def parse_request(raw: bytes, model_cls: type[BaseModel]):
    """An OpenAI request body (`oa.CompletionRequest`, `oa.ChatCompletionRequest`) from its bytes."""
    data = parse_json_body(raw)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise oa.validation_error(e) from None


def _reject_constant(name: str):
    raise oa.APIError(400, f"the body is not valid JSON: {name} is not a JSON number")


def _param(path: Sequence[Any]) -> str | None:
    return ".".join(str(p) for p in path) or None


def _valid_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_tree(data: Any, depth_limit: bool, strings: bool) -> None:
    """Walks a parsed body without recursion: nesting depth and strings that are not valid Unicode."""
    stack: list[tuple[Any, int, tuple]] = [(data, 1, ())]
    while stack:
        node, depth, path = stack.pop()
        if depth_limit and depth > MAX_JSON_DEPTH:
            raise oa.APIError(400, f"the body is nested more than {MAX_JSON_DEPTH} levels deep", param=_param(path[:1]))
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if strings:
                if isinstance(key, str) and not _valid_unicode(key):
                    raise _surrogate_error(path)
                if isinstance(value, str) and not _valid_unicode(value):
                    raise _surrogate_error((*path, key))
            if isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (*path, key)))


def _surrogate_error(path: Sequence[Any]) -> oa.APIError:
    param = _param(path)
    where = f"{param}: " if param else ""
    return oa.APIError(400, f"{where}the string is not valid Unicode (it has an unpaired surrogate escape such as \\ud800)", param=param)


# ----------------------------------------------------------------------------------- the validator


class RequestValidator:
    """Checks requests against one model and server config; the same rules for HTTP and gRPC."""

    def __init__(
        self,
        *,
        model_name: str,
        vocab_size: int,
        max_model_len: int,
        tokenizer=None,
        max_body_bytes: int = 1 << 20,
        max_prompt_tokens: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        tool_call_parser: str = "auto",
        coerce_one_of: bool = False,
    ):
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.max_body_bytes = max_body_bytes
        self.max_prompt_tokens = max_prompt_tokens
        self.default_max_tokens = default_max_tokens
        template = tokenizer.chat_template if tokenizer is not None else None
        self.tool_format = tool_calls.format_for_template(template) if tool_call_parser == "auto" else tool_call_parser
        # Structured outputs are compiled here too, so a spec the engine cannot compile is a 400 before
        # anything reaches a worker (the workers compile again, from their own cache).
        eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos, coerce_one_of)

    # ---------------------------------------------------------------- size and model

    def check_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise oa.APIError(
                413, f"the request is larger than {self.max_body_bytes} bytes (server.max_body_bytes)", code="request_too_large"
            )

    def check_content_length(self, header: str | None) -> None:
        """A Content-Length header over the limit: refused before reading the body."""
        if header is None:
            return
        header = header.strip()
        if not header.isdigit():
            raise oa.APIError(400, "the Content-Length header is not a number")
        # Past 19 digits it is over any limit; int() on thousands of digits would raise.
        self.check_size(int(header) if len(header) <= 19 else self.max_body_bytes + 1)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise oa.APIError(
                404, f"the model '{model}' does not exist; this server serves '{self.model_name}'", param="model", code="model_not_found"
            )

    # ---------------------------------------------------------------- prompts

    def check_prompt(self, prompt: Sequence[int]) -> None:
        if not prompt:
            raise oa.APIError(400, "the prompt is empty", param="prompt")
        limit = self.max_model_len - 1  # room for at least one generated token
        if self.max_prompt_tokens:
            limit = min(limit, self.max_prompt_tokens)
        if len(prompt) > limit:
            raise oa.APIError(
                400, f"the prompt has {len(prompt)} tokens; the limit is {limit}", param="prompt", code="context_length_exceeded"
            )
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise oa.APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="prompt")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise oa.APIError(400, "this model has no tokenizer: send token ids", param="prompt")
        if len(text) <= OFFLOAD_CHARS:
            return self._encode(text, add_special_tokens)
        return await asyncio.to_thread(self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            # encode_batch releases the GIL while the Rust tokenizer runs; encode holds it throughout.
            return self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except (TypeError, ValueError, UnicodeError) as e:  # e.g. a string that is not valid Unicode
            raise oa.APIError(400, f"the prompt cannot be tokenised: {one_line(e)}", param="prompt") from None

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        return (await self.render_chat_text(messages, add_generation_prompt, template_kwargs))[0]

    async def render_chat_text(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], str]:
        """The prompt's ids and its rendered text."""
        if self.tokenizer is None or self.tokenizer.chat_template is None:
            raise oa.APIError(400, "this model has no chat template: use /v1/completions")
        size = sum(len(m.get("content") or "") if isinstance(m.get("content"), str) else 0 for m in messages)
        kwargs = {**(template_kwargs or {}), "tools": tools}
        if size <= OFFLOAD_CHARS:
            text = self._render(messages, add_generation_prompt, kwargs)
        else:
            text = await asyncio.to_thread(self._render, messages, add_generation_prompt, kwargs)
        # The template wrote the special tokens itself.
        return await self.encode(text, add_special_tokens=False), text

    async def message_boundaries(
        self,
        messages: list[dict[str, Any]],
        text: str,
        prompt: list[int],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Where prefixes that other prompts likely share end in `prompt` (rendered as `text`), in tokens:
        the leading system messages with the tools (many requests, one system prompt), and the conversation
        before its last message (an agent forks there; the next turn continues there). A hybrid model keeps
        its state at those points (`SamplingParams.prefix_boundaries`). A prefix counts only where its own
        rendering and tokens are exactly the prompt's start (a template that renders a partial
        conversation differently, or a token merged across the junction, gives no boundary there)."""
        kwargs = {**(template_kwargs or {}), "tools": tools}
        system = next((i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")), len(messages))
        out = []
        for k in sorted({system, len(messages) - 1}):
            if not 0 < k < len(messages):
                continue
            try:
                if len(text) <= OFFLOAD_CHARS:
                    part = self._render(messages[:k], False, kwargs)
                else:
                    part = await asyncio.to_thread(self._render, messages[:k], False, kwargs)
            except oa.APIError:  # a template that refuses a partial conversation: no boundary there
                continue
            if not part or not text.startswith(part):
                continue
            ids = await self.encode(part, add_special_tokens=False)
            if 0 < len(ids) < len(prompt) and prompt[: len(ids)] == ids:
                out.append(len(ids))
        return out

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> str:
        reserved = sorted(set(template_kwargs) & {"messages", "add_generation_prompt", "tokenize", "chat_template"})
        if reserved:
            raise oa.APIError(400, f"chat_template_kwargs: {reserved[0]!r} cannot be set here", param="chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
            )
        except ValueError as e:  # the tokenizer's own message checks, ChatTemplateError (raise_exception)
            raise oa.APIError(400, f"messages: {one_line(e)}", param="messages") from None
        except Exception as e:  # noqa: BLE001 - a template choking on odd input is the input's fault
            log.info("chat template failed on a request: %s: %s", type(e).__name__, one_line(e))
            raise oa.APIError(
                400, f"messages: the chat template cannot render these messages ({type(e).__name__}: {one_line(e, 200)})", param="messages"
            ) from None

    # ---------------------------------------------------------------- sampling

    def sampling_params(self, fields: dict[str, Any], prompt_len: int, max_tokens: int | None) -> SamplingParams:
        """SamplingParams from request fields, checked against the model: ranges (SamplingParams itself),
        stop token ids in the vocabulary, and prompt + max_tokens within max_model_len (vLLM's rule; an
        unset max_tokens defaults to `default_max_tokens`, cut to what the context has room for)."""
        room = self.max_model_len - prompt_len
        fields = {**fields, "max_tokens": max_tokens if max_tokens is not None else max(1, min(self.default_max_tokens, room))}
        try:
            params = SamplingParams(**fields)
        except ValueError as e:
            errors = getattr(e, "errors", None)
            param = (errors[0][0] or None) if errors else None
            raise oa.APIError(400, str(e), param=param) from None
        named = {
            "stop_token_ids": params.stop_token_ids,
            "logit_bias": [t for t, _ in params.logit_bias],
            "allowed_token_ids": params.allowed_token_ids,
        }
        for field, ids in named.items():
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise oa.APIError(400, f"{field}: token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=field)
        if params.structured is not None:
            try:
                self.grammars.grammar(params.structured)
            except GrammarError as e:
                raise oa.APIError(400, str(e), param="response_format") from None
        if max_tokens is not None and prompt_len + params.max_tokens > self.max_model_len:
            raise oa.APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the prompt, {params.max_tokens} in the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return params

    # ---------------------------------------------------------------- OpenAI requests

    def check_openai(self, body: oa._Common) -> None:
        """Cross-field rules and unsupported features of an OpenAI request body."""
        self.check_model(body.model)
        for name, message in body.unsupported():
            raise oa.APIError(400, message, param=name, code="unsupported_parameter")
        if isinstance(body, oa.CompletionRequest):
            for name, no_op in (("tools", (None, [])), ("tool_choice", (None, "none"))):
                if getattr(body, name) not in no_op:
                    raise oa.APIError(
                        400,
                        f"{name} is not supported on /v1/completions (use /v1/chat/completions)",
                        param=name,
                        code="unsupported_parameter",
                    )
        if body.stream_options is not None and not body.stream:
            raise oa.APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(body, oa.ChatCompletionRequest) and body.echo:
            raise oa.APIError(400, "echo is not supported on chat completions", param="echo", code="unsupported_parameter")
        if isinstance(body, oa.ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise oa.APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")

    async def completion(self, body: oa.CompletionRequest) -> list[Checked]:
        """One Checked per prompt (a batch of prompts is several engine requests)."""
        self.check_openai(body)
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise oa.APIError(400, "max_tokens must be at least 1 (0 only with echo: scoring the prompt)", param="max_tokens")
        if score_only and body.stream:
            raise oa.APIError(400, "max_tokens 0 (scoring the prompt) cannot be streamed", param="max_tokens")
        fields = body.sampling_fields(body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens get logprobs too
            fields["prompt_logprobs"] = max(fields.get("prompt_logprobs") or 0, body.logprobs)
        max_tokens = 1 if score_only else body.max_tokens
        batch = body.prompts()
        out = []
        for i, p in enumerate(batch):
            try:
                prompt = await self.encode(p) if isinstance(p, str) else list(p)
                self.check_prompt(prompt)
                params = self.sampling_params(fields, len(prompt), max_tokens)
            except oa.APIError as e:
                if len(batch) > 1:  # which prompt of the batch
                    e.message = f"prompt[{i}]: {e.message}"
                raise
            echo = (p if isinstance(p, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)) if body.echo else None
            out.append(Checked(prompt, params, echo=echo, score_only=score_only))
        return out

    async def chat(self, body: oa.ChatCompletionRequest) -> Checked:
        self.check_openai(body)
        try:
            messages = body.template_messages()
        except ValueError as e:
            raise oa.APIError(400, f"messages: {e}", param="messages") from None
        if body.chat_template_kwargs and "tools" in body.chat_template_kwargs:
            raise oa.APIError(400, "chat_template_kwargs: 'tools' cannot be set here; use tools", param="chat_template_kwargs")
        tools, choice = body.tool_spec()
        if tools is not None and self.tool_format is None:
            raise oa.APIError(400, "tools: this model's chat template has no tool-call format", param="tools")
        rendered_tools = tools if choice != "none" else None
        prompt, text = await self.render_chat_text(messages, body.add_generation_prompt, body.chat_template_kwargs, rendered_tools)
        self.check_prompt(prompt)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        fields = body.sampling_fields(logprobs)
        if choice == "required" or isinstance(choice, dict):
            if fields.get("structured") is not None:
                raise oa.APIError(400, "tool_choice required or named cannot be combined with response_format", param="tool_choice")
            try:
                grammar = tool_calls.forced_call_grammar(
                    tools, choice, body.parallel_tool_calls is not False, self.tool_format, token_id=self.tokenizer.token_to_id
                )
            except ValueError as e:
                raise oa.APIError(400, f"tool_choice: {e}", param="tool_choice") from None
            fields["structured"] = StructuredOutputs(kind="lark", value=grammar)
        tags = template_tags(self.tokenizer.chat_template)
        reasoning = prompt_opens_reasoning(text, tags) if tags is not None else None
        tool_format = self.tool_format if rendered_tools is not None else None
        if tags == "gemma4" or tool_format == "gemma4":
            # Gemma 4's reasoning and tool-call markers (and its string quotes) are special tokens: the
            # parsers read them in the text, so this output is decoded with them (as vLLM's parsers ask).
            fields["skip_special_tokens"] = False
        shared = await self.message_boundaries(messages, text, prompt, body.chat_template_kwargs, rendered_tools)
        fields["prefix_boundaries"] = sorted(set(fields.get("prefix_boundaries") or ()) | set(shared))
        params = self.sampling_params(fields, len(prompt), max_tokens)
        return Checked(prompt, params, reasoning, tags or "think", tool_format)

    # ---------------------------------------------------------------- /tokenize, /detokenize

    async def tokenize(self, body: oa.TokenizeRequest) -> list[int]:
        if body.model is not None:
            self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise oa.APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.prompt is not None:
            return await self.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        if body.continue_final_message:  # not on chat completions either
            raise oa.APIError(400, "continue_final_message is not supported", param="continue_final_message", code="unsupported_parameter")
        try:
            messages = body.chat_messages()
        except ValueError as e:
            raise oa.APIError(400, f"messages: {e}", param="messages") from None
        if not messages:
            raise oa.APIError(400, "messages must not be empty", param="messages")
        _, text = await self.render_chat_text(messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools)
        return await self.encode(text, add_special_tokens=bool(body.add_special_tokens))

    def detokenize(self, body: oa.DetokenizeRequest) -> str:
        if body.model is not None:
            self.check_model(body.model)
        if self.tokenizer is None:
            raise oa.APIError(400, "this model has no tokenizer", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise oa.APIError(400, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="tokens")
        return self.tokenizer.decode(body.tokens, skip_special_tokens=False)

    # ---------------------------------------------------------------- gRPC requests

    def parse_grpc(self, request: Any) -> moray_pb2.GenerateRequest:
        """A GenerateRequest from the wire bytes (size checked first) or an already parsed message."""
        if isinstance(request, moray_pb2.GenerateRequest):
            self.check_size(request.ByteSize())
            return request
        if not isinstance(request, (bytes, bytearray, memoryview)):
            raise oa.APIError(400, f"expected a moray.v1.GenerateRequest, got {type(request).__name__}")
        self.check_size(len(request))
        try:
            return moray_pb2.GenerateRequest.FromString(bytes(request))
        except DecodeError as e:
            raise oa.APIError(400, f"the request is not a valid moray.v1.GenerateRequest ({one_line(e).rsplit(': ', 1)[-1]})") from None

    async def grpc(self, request: moray_pb2.GenerateRequest) -> Checked:
        if request.model:
            self.check_model(request.model)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise oa.APIError(400, f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters", param="request_id")
        kind = request.WhichOneof("input")
        shared: list[int] = []
        if kind == "prompt":
            prompt = await self.encode(request.prompt)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        elif kind == "messages":
            # OpenAI's "developer" role is a system message, as on the HTTP API.
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content} for m in request.messages.messages]
            prompt, text = await self.render_chat_text(messages)
            shared = await self.message_boundaries(messages, text, prompt)
        else:
            raise oa.APIError(400, "one of prompt, token_ids or messages is required")
        self.check_prompt(prompt)
        s = request.sampling
        fields: dict[str, Any] = {name: getattr(s, name) for name in _GRPC_SAMPLING_FIELDS if s.HasField(name)}
        max_tokens = fields.pop("max_tokens", None)
        fields.update(stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
        fields["prefix_boundaries"] = sorted(set(s.prefix_boundaries) | set(shared))
        fields["structured"] = _grpc_structured(s)
        return Checked(prompt, self.sampling_params(fields, len(prompt), max_tokens))
