"""Per-request sampling parameters, validated once when a request enters the engine.

The fields and their meaning follow vLLM's `SamplingParams` (and through it the OpenAI API), so
the API layer can map request bodies onto it field by field. Every invalid value raises
`SamplingParamsError` (a `ValueError`) whose message names the offending field, so a frontend can
return it verbatim as a 400.

Scalars are validated strictly: `max_tokens=True` or `temperature="hot"` are rejected rather than
coerced, because a silently coerced sampling parameter is much harder to debug than a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Temperatures below this are treated as greedy decoding (vLLM uses the same threshold): dividing
# logits by ~0 would overflow, and the result would be argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

MAX_LOGPROBS = 20
MAX_PREFIX_BOUNDARIES = 16

_StrictInt = Annotated[int, Field(strict=True)]
_StrictFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_StrictBool = Annotated[bool, Field(strict=True)]


class SamplingParamsError(ValueError):
    """Invalid sampling parameters. `errors` holds (field, message) pairs ("" for cross-field
    checks, whose message names the fields); `str()` lists them all."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        detail = "; ".join(f"{field}: {msg}" if field else msg for field, msg in errors)
        super().__init__(f"invalid sampling parameters: {detail}")

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> "SamplingParamsError":
        errors = []
        for err in exc.errors():
            # Model-level checks have an empty loc; their messages name the fields themselves.
            field = ".".join(str(part) for part in err["loc"])
            if err["type"] == "extra_forbidden":
                message = "unknown sampling parameter"
            else:
                # Our own validators raise ValueError, which pydantic prefixes with "Value error, ".
                message = err["msg"].removeprefix("Value error, ")
                if err["type"] != "value_error":
                    message += f" (got {err['input']!r})"
            errors.append((field, message))
        return cls(errors)


class StructuredOutputs(BaseModel):
    """A grammar the output must follow (vLLM's `structured_outputs`); compiled by the engine
    (workers/engine/structured.py). `value` is canonical text so equal specs hash alike and share one
    compiled grammar: a JSON schema serialised with sorted keys, a regex, a JSON list of choices, or a
    Lark/GBNF grammar; "" for json_object (any JSON object)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "lark"]  # lark: llguidance's own dialect
    value: str = ""

    @classmethod
    def from_fields(
        cls,
        json_schema: Any = None,
        regex: str | None = None,
        choice: list[str] | None = None,
        grammar: str | None = None,
        json_object: bool = False,
    ) -> "StructuredOutputs | None":
        """The one constraint among the fields (None when none is set); more than one is a ValueError."""
        given = {
            "json": json_schema is not None,
            "regex": regex is not None,
            "choice": choice is not None,
            "grammar": grammar is not None,
            "json_object": bool(json_object),
        }
        kinds = [k for k, v in given.items() if v]
        if not kinds:
            return None
        if len(kinds) > 1:
            raise ValueError(f"only one structured output constraint may be given, got {', '.join(kinds)}")
        kind = kinds[0]
        if kind == "json":
            if isinstance(json_schema, str):
                try:
                    json_schema = json.loads(json_schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(json_schema, (dict, bool)):
                raise ValueError("the JSON schema must be an object")
            return cls(kind="json", value=json.dumps(json_schema, sort_keys=True))
        if kind == "regex":
            if not isinstance(regex, str) or not regex:
                raise ValueError("the regex must be a non-empty string")
            return cls(kind="regex", value=regex)
        if kind == "choice":
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return cls(kind="choice", value=json.dumps(list(choice)))
        if kind == "grammar":
            if not isinstance(grammar, str) or not grammar.strip():
                raise ValueError("the grammar must be a non-empty string")
            return cls(kind="grammar", value=grammar)
        return cls(kind="json_object")


def _token_ids(ids: Any) -> tuple[int, ...]:
    """A list of non-negative token ids as a tuple; ValueError otherwise."""
    # bool is an int subclass; reject it explicitly.
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"must be a list of non-negative token ids (got {ids!r})")
    return tuple(ids)


class SamplingParams(BaseModel):
    """How to pick each generated token and when to stop. Immutable and hashable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Number of completions per request. Only 1 is supported: the engine has no parallel sampling.
    n: _StrictInt = 1
    # 0 (or anything below GREEDY_TEMPERATURE_EPS) means greedy; top_k/top_p/min_p are then ignored.
    temperature: _StrictFloat = Field(default=1.0, ge=0)
    top_p: _StrictFloat = Field(default=1.0, gt=0, le=1)
    # -1 or 0 disable top-k.
    top_k: _StrictInt = 0
    min_p: _StrictFloat = Field(default=0.0, ge=0, le=1)
    # HF/vLLM repetition penalty over prompt + output tokens; 1 disables it.
    repetition_penalty: _StrictFloat = Field(default=1.0, gt=0)
    # OpenAI penalties over output tokens only; 0 disables them.
    presence_penalty: _StrictFloat = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: _StrictFloat = Field(default=0.0, ge=-2, le=2)
    # Makes sampling reproducible per request, independent of batching (see sampler.py).
    seed: _StrictInt | None = None
    # Accepts str | list[str] | None; always stored as a tuple of non-empty strings.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: _StrictInt = Field(default=16, ge=1)
    # EOS, stop tokens and stop strings are ignored (and EOS/stop tokens banned) before this many
    # tokens have been generated.
    min_tokens: _StrictInt = Field(default=0, ge=0)
    ignore_eos: _StrictBool = False
    # Number of top logprobs to return per generated token (the chosen token's is always returned
    # when this is not None); None returns no logprobs.
    logprobs: _StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: _StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    skip_special_tokens: _StrictBool = True
    # vLLM's default drops the matched stop string / stop token text from the output.
    include_stop_str_in_output: _StrictBool = False
    # A grammar the output follows (JSON schema, regex, choice, Lark/GBNF); None: free text.
    structured: StructuredOutputs | None = None
    # OpenAI logit_bias: added to a token's logit before sampling, (token id, bias in [-100, 100]) pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM: only these token ids may be sampled (empty: any).
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM: words never generated (a word's last token is banned where the output ends with the rest).
    bad_words: tuple[str, ...] = ()
    # Token offsets in the prompt where a prefix other prompts are likely to share ends (the system prompt
    # and tools, the conversation before its last message): a hybrid model keeps its linear-attention state
    # at the block boundary at or before each, so those prompts can resume from it. Not sampling, but it
    # travels with the request to whichever worker prefills it. Attention-only models ignore it.
    prefix_boundaries: tuple[int, ...] = ()

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SamplingParamsError.from_validation_error(exc) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> "SamplingParams":
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise SamplingParamsError.from_validation_error(exc) from None

    @classmethod
    def greedy(cls, **overrides: Any) -> "SamplingParams":
        """Deterministic argmax decoding; other fields may be overridden."""
        return cls(**{"temperature": 0.0, **overrides})

    # ----------------------------------------------------------------------------- validators

    @field_validator("n")
    @classmethod
    def _only_one_completion(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (got {n}); send separate requests instead")
        return n

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, k: int) -> int:
        if k < -1:
            raise ValueError(f"must be -1 or 0 (disabled) or >= 1 (got {k})")
        return k

    @field_validator("stop", mode="before")
    @classmethod
    def _normalise_stop(cls, stop: Any) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"must be a string or a list of strings (got {stop!r})")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        return tuple(stop)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _normalise_stop_token_ids(cls, ids: Any) -> tuple[int, ...]:
        return () if ids is None else _token_ids(ids)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _normalise_logit_bias(cls, bias: Any) -> tuple[tuple[int, float], ...]:
        if bias is None:
            return ()
        if isinstance(bias, dict):
            bias = list(bias.items())
        if not isinstance(bias, (list, tuple)):
            raise ValueError(f"must map token ids to biases (got {bias!r})")
        out = {}
        for pair in bias:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"must map token ids to biases (got {pair!r})")
            token, value = pair
            try:
                token = int(token) if not isinstance(token, bool) else None
            except (TypeError, ValueError):
                token = None
            if token is None or token < 0:
                raise ValueError(f"keys must be token ids (got {pair[0]!r})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"biases must be numbers in [-100, 100] (got {value!r} for token {token})")
            out[token] = float(value)
        return tuple(sorted(out.items()))

    @field_validator("bad_words", mode="before")
    @classmethod
    def _normalise_bad_words(cls, words: Any) -> tuple[str, ...]:
        if words is None:
            return ()
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise ValueError(f"must be a list of non-empty strings (got {words!r})")
        return tuple(words)

    @field_validator("allowed_token_ids", mode="before")
    @classmethod
    def _normalise_allowed_token_ids(cls, ids: Any) -> tuple[int, ...]:
        if ids is None:
            return ()
        ids = _token_ids(ids)
        if not ids:
            raise ValueError("must not be empty (leave it out to allow every token)")
        return tuple(sorted(set(ids)))

    @field_validator("prefix_boundaries", mode="before")
    @classmethod
    def _normalise_prefix_boundaries(cls, offsets: Any) -> tuple[int, ...]:
        if offsets is None:
            return ()
        if not isinstance(offsets, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in offsets):
            raise ValueError(f"must be a list of positive token offsets into the prompt (got {offsets!r})")
        if len(offsets) > MAX_PREFIX_BOUNDARIES:
            raise ValueError(f"at most {MAX_PREFIX_BOUNDARIES} offsets (got {len(offsets)})")
        return tuple(sorted(set(offsets)))

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    # ----------------------------------------------------------------------------- derived

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def token_ids_named(self) -> tuple[int, ...]:
        """Every token id the request names (stop tokens, logit_bias keys, allowed ids): checked against
        the vocabulary by the engine and the ingress."""
        return (*self.stop_token_ids, *(t for t, _ in self.logit_bias), *self.allowed_token_ids)

    @property
    def max_stop_len(self) -> int:
        """The longest stop string's length (0 without any): how much earlier text a match can reach back into."""
        return max(map(len, self.stop), default=0)

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
