"""The OpenAI-compatible wire format: request models (validated) and response/chunk builders.

Only protocol lives here; what happens to a request is `orchestrator.py`'s business.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from workers.engine.sampling_params import StructuredOutputs


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body; never a stack trace for the client."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def __reduce__(self):  # picklable across Ray processes (Serve ships exceptions to the proxy)
        return (APIError, (self.status, self.message, self.type, self.param, self.code))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    msg = err["msg"].removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # vLLM: with include_usage, every chunk also carries the usage so far (guidellm always sends it).
    continuous_usage_stats: bool = False

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


# Most choices one request may ask for (prompts x n): each is an engine request of its own.
MAX_CHOICES = 128


# Request fields of the OpenAI API and vLLM's documented extensions that Moray does not implement (the
# README's field table lists these with the rest). A field not in the request models nor here is refused
# by name ("unknown field"), as nested ones are.
#
# Accepted with any value and ignored: (field -> why).
IGNORED_FIELDS: dict[str, str] = {
    "store": "OpenAI's stored completions: a platform feature; nothing is stored",
    "metadata": "OpenAI's tags for stored completions: nothing is stored",
    "service_tier": "OpenAI's processing tiers: one tier here",
    "request_id": "vLLM's client request id: Moray makes its own ids (gRPC clients may choose theirs)",
    "priority": "vLLM's priority scheduling: Moray schedules first come, first served",
    "guided_decoding_backend": "one structured-output backend (llguidance)",
    "guided_whitespace_pattern": "the backend's own whitespace rules apply",
}
# Accepted only with a value that asks for nothing (what a client sends by default); anything else is
# refused by name: (field -> the no-op values).
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (False,),
    "length_penalty": (1.0, 1),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "logits_processors": (None,),
    "prompt_embeds": (None,),
    "mm_processor_kwargs": (None,),
    "documents": (None,),
    "chat_template": (None,),
    "continue_final_message": (False,),
    "reasoning_effort": (None,),
    "include_reasoning": (True,),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    # SGLang's fields, which sglang-router adds to every request it forwards (at these values).
    "no_stop_trim": (False,),
    "return_hidden_states": (False,),
    "separate_reasoning": (True,),  # reasoning is split out (cluster/reasoning.py)
    "stream_reasoning": (True,),
}
# add_special_tokens: the default of each endpoint (a completions prompt gets the BOS/EOS the tokenizer
# adds; a chat prompt's come from its template).
_ADD_SPECIAL_TOKENS_DEFAULT = {"CompletionRequest": True, "ChatCompletionRequest": False}


class _Common(BaseModel):
    # Every known field is type-checked, strictly: "16", true or 16.0 are not a max_tokens, "yes" is not a
    # stream flag. Other keys are kept to be checked against the documented lists (`unsupported`).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # vLLM-style extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM: the logprobs of each prompt token given the ones before it (and the top N at each position).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Any = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's logit_bias ({"token id": bias}) and vLLM's allowed_token_ids and bad_words.
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Moray: token offsets in the prompt where a prefix other prompts share ends (the chat path adds the
    # end of the system prompt and tools, and of the conversation before its last message); a hybrid
    # model keeps its linear-attention state there so those prompts resume from it.
    prefix_boundaries: list[int] | None = None
    # Tool calling (chat only; see ChatCompletionRequest.tool_spec).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Not implemented (yet): accepted only with a value that asks for nothing, see `unsupported`.
    functions: Any = None
    function_call: Any = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, message) for every unknown field and every unimplemented feature this request asks for."""
        out = []
        given = {name: getattr(self, name) for name in type(self).model_fields if name in _NO_OP_VALUES}
        given.update(self.model_extra or {})
        for name, value in given.items():
            if name in IGNORED_FIELDS:
                continue
            if name == "add_special_tokens":
                if value != _ADD_SPECIAL_TOKENS_DEFAULT[type(self).__name__]:
                    out.append((name, f"add_special_tokens={value!r} is not supported on this endpoint"))
                continue
            no_ops = _NO_OP_VALUES.get(name)
            if no_ops is None:
                out.append((name, f"unknown field {name!r}"))
            elif not any(value == v and type(value) is type(v) for v in no_ops):
                out.append((name, f"{name} is not supported" + (" (only best_of=1)" if name == "best_of" else "")))
        return out

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, from whichever field carries it; APIError 400 on a malformed
        one or on more than one."""
        given = []
        if self.response_format is not None and self.response_format != {"type": "text"}:
            given.append(("response_format", lambda: _response_format(self.response_format)))
        if self.structured_outputs is not None:
            given.append(("structured_outputs", lambda: _structured_outputs(self.structured_outputs)))
        guided = {"json_schema": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice, "grammar": self.guided_grammar}
        for name, value in guided.items():
            if value is not None:
                field = "guided_" + name.removesuffix("_schema")
                given.append((field, lambda name=name, value=value: StructuredOutputs.from_fields(**{name: value})))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise APIError(400, f"only one structured output constraint may be given, got {names}", param=given[1][0])
        name, build = given[0]
        try:
            return build()
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None

    def sampling_fields(self, logprobs: int | None) -> dict[str, Any]:
        """The SamplingParams fields this request sets (max_tokens is the validator's business)."""
        # n > 1: the front end runs n engine requests (`validation.Checked`), each with n = 1.
        fields: dict[str, Any] = {"stop": self.stop, "seed": self.seed, "ignore_eos": self.ignore_eos, "logprobs": logprobs}
        fields["structured"] = self.structured()
        for name in (
            "temperature",
            "top_p",
            "presence_penalty",
            "frequency_penalty",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "stop_token_ids",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "prefix_boundaries",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        return fields


def _response_format(value: Any) -> StructuredOutputs | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError('must be an object with a "type": "text", "json_object" or "json_schema"')
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise ValueError(f"unknown key {extra[0]!r}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs.from_fields(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError('"json_schema" must be an object with a "schema"')
        return StructuredOutputs.from_fields(json_schema=spec["schema"])
    raise ValueError(f'unknown type {kind!r}; expected "text", "json_object" or "json_schema"')


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _structured_outputs(value: dict[str, Any]) -> StructuredOutputs | None:
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS) - {"backend", "disable_any_whitespace"})
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; expected one of {', '.join(_STRUCTURED_KEYS)}")
    return StructuredOutputs.from_fields(**{_STRUCTURED_KEYS[k]: v for k, v in value.items() if k in _STRUCTURED_KEYS and v is not None})


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: Any = None
    best_of: Any = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], (str, list)):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} prompts per request")
            bad = next((i for i, p in enumerate(v) if not p), None)
            if bad is not None:
                raise ValueError(f"prompt[{bad}] must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, a batch of one for a single prompt (a string or a list of token ids)."""
        p = self.prompt
        if isinstance(p, list) and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients an object


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Extra keys (e.g. reasoning_content) go to the chat template as they are; the known ones are typed.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM: the last message echoed in the reply (refused: see validation.check_openai)
    # vLLM: variables for the chat template, e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def tool_spec(self) -> tuple[list[dict[str, Any]] | None, str | dict]:
        """(tools or None, tool_choice) checked: function tools with a name and an object schema; a
        choice of "none", "auto", "required" or a named function among the tools. APIError 400 otherwise."""
        tools, choice = self.tools, self.tool_choice
        if tools in (None, []):
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None, "none"
        if not isinstance(tools, list):
            raise APIError(400, "tools must be a list", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
            if not isinstance(fn.get("parameters", {}), dict):
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names = [t["function"]["name"] for t in tools]
        if choice is None:
            choice = "auto"
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in names:
                raise APIError(400, f"tool_choice names a function that is not in tools: {name!r}", param="tool_choice")
        elif choice not in ("none", "auto", "required"):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', param="tool_choice")
        return tools, choice

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            fields = m.model_dump(exclude={"role", "content"}, exclude_none=True)
            out.append({**fields, "role": role, "content": m.text()})
        return out


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def chat_messages(self) -> list[dict[str, Any]]:
        return ChatCompletionRequest.template_messages(self)  # same message rules as chat completions


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


class RebalanceExpertsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    wait: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(tokens: list[str], entries: list[dict[int, float] | None], chosen: list[int], decode, offset: int = 0) -> dict:
    """The legacy completions logprobs object. `entries[i]` is None where a token has no logprob (the first
    prompt token under echo); `offset` is where the first token's text starts in the choice's text (its
    `text_offset`: each token's start, counted in characters of the token texts)."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [e.get(t) if e is not None else None for e, t in zip(entries, chosen)],
        "top_logprobs": [{decode(k): v for k, v in e.items()} if e is not None else None for e in entries],
        "text_offset": offsets,
    }


def prompt_logprob_entries(prompt_logprobs: list | None, k: int) -> list[dict[int, float] | None]:
    """The engine's prompt logprobs (per position: None at 0, else {token id: Logprob}, the prompt's token
    first, then the top k) as completion-logprobs entries: the prompt token plus the top k."""
    out: list[dict[int, float] | None] = []
    for entry in prompt_logprobs or []:
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())
        kept = dict(items[:1])
        kept.update(sorted(((t, lp) for t, lp in items[1:]), key=lambda kv: kv[1].rank)[:k])
        out.append({t: float(lp.logprob) for t, lp in kept.items()})
    return out


def vllm_prompt_logprobs(prompt_logprobs: list | None, decode) -> list | None:
    """vLLM's `prompt_logprobs` response field: per prompt position None (the first) or
    {token id (as a string): {"logprob", "rank", "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {str(t): {"logprob": float(lp.logprob), "rank": int(lp.rank), "decoded_token": decode(t)} for t, lp in entry.items()}
        for entry in prompt_logprobs
    ]


def chat_logprobs(chosen: list[int], entries: list[dict[int, float]], top_n: int, decode) -> dict:
    content = []
    for token, entry in zip(chosen, entries):
        text = decode(token)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": text,
                "logprob": entry.get(token),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": decode(k), "logprob": v, "bytes": list(decode(k).encode())} for k, v in top],
            }
        )
    return {"content": content}


def created() -> int:
    return int(time.time())
