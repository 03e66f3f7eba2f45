"""Structured outputs: a grammar constrains which tokens a request may sample next.

The grammar engine is llguidance (PyPI `llguidance`, the `guidance` backend of vLLM and one of
SGLang's). Chosen over xgrammar (the other engine vLLM and SGLang ship) because it needs nothing else:
xgrammar's wheel requires torch, transformers and triton, which a serving install of Moray does not
otherwise carry; llguidance is one self-contained Rust extension, compiles a JSON schema lazily (no
ahead-of-time vocabulary pass, so a new schema costs milliseconds) and computes a token mask in tens of
microseconds.

Flow per step (workers/engine/engine.py): the step's program is dispatched, then while the device runs
it the host fills one bitmask row per constrained request (`fill_bitmask`, in parallel threads); the
sampler applies the mask on device before picking the token. The sampled token then advances the
request's matcher (`GrammarState.accept`). Compiled grammars are cached by their spec.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .json_schema import Unenforceable, enforceable, refused_keyword
from .sampling_params import StructuredOutputs

_CACHE_SIZE = 256  # compiled grammars kept (by spec)
# Compact JSON (no whitespace between tokens): with flexible whitespace a weak or random model can pad
# an object with blanks until max_tokens and never close it (seen on the tiny test models); vLLM offers
# the same choice as `disable_any_whitespace`.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot compile (an HTTP 400)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id of the logits."""
    return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=1024)
def ids_bitmask(ids: tuple[int, ...], width: int) -> np.ndarray:
    """One bitmask row allowing exactly `ids` (allowed_token_ids); cached, so a request pays once."""
    bits = np.zeros(width * 32, np.uint8)
    bits[list(ids)] = 1
    row = np.packbits(bits.reshape(width, 32), axis=1, bitorder="little").view(np.int32).reshape(width)
    row.flags.writeable = False
    return row


@dataclass
class GrammarState:
    """One request's position in its grammar."""

    matcher: object  # llguidance.LLMatcher

    def accept(self, token: int) -> bool:
        """Advances past a sampled token; False when the grammar rejects it (a matcher error)."""
        return bool(self.matcher.consume_token(int(token)))

    @property
    def finished(self) -> bool:
        """The grammar is complete and accepts nothing but EOS."""
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Turns `StructuredOutputs` specs into matchers for one tokenizer and logits width."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], coerce_one_of: bool = False):
        self._tokenizer_source = tokenizer
        self.coerce_one_of = coerce_one_of
        self.relaxed: set[StructuredOutputs] = set()  # specs compiled only with coerce_one_of: outputs need a check
        self.vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size]
        self._ll_tokenizer = None
        self._executor = None
        self._grammars: OrderedDict[StructuredOutputs, str] = OrderedDict()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- set-up (lazy: first constrained request)

    def _llguidance(self):
        try:
            import llguidance
        except ImportError as e:  # a dependency of the package; only a broken install lacks it
            raise GrammarError(f"structured outputs need the llguidance package ({e})") from None
        return llguidance

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            if self._tokenizer_source is None:
                raise GrammarError("structured outputs need the model's tokenizer (tokenizer.json); this model has none")
            llg = self._llguidance()
            self._ll_tokenizer = llg.LLTokenizer(
                self._tokenizer_source.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos or None
            )
            self._executor = llg.LLExecutor(num_threads=2)
        return self._ll_tokenizer

    # ---------------------------------------------------------------- compile

    def grammar(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of `spec`, validated against the tokenizer; cached by spec."""
        with self._lock:
            if spec in self._grammars:
                self._grammars.move_to_end(spec)
                return self._grammars[spec]
        llg = self._llguidance()
        tokenizer = self._tokenizer()
        grammar = _grammar_text(llg, spec)
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and spec.kind == "json" and refused_keyword(error) == "oneOf":
            # A oneOf neither side proved disjoint: pruned where the schema lets it go, and tried again.
            grammar = _grammar_text(llg, spec, prune_one_of=True)
            error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and spec.kind == "json" and refused_keyword(error) == "oneOf" and self.coerce_one_of:
            grammar = _grammar_text(llg, spec, coerce_one_of=True)  # not sound: `violation` checks the outputs
            error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
            if not error:
                with self._lock:
                    self.relaxed.add(spec)
        if error:
            keyword = refused_keyword(error) if spec.kind == "json" else None
            if keyword:
                raise GrammarError(f"json_schema: {keyword} cannot be enforced exactly ({error.strip().splitlines()[0]})")
            raise GrammarError(f"{spec.kind} cannot be compiled: {error}")
        with self._lock:
            self._grammars[spec] = grammar
            while len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def violation(self, spec: StructuredOutputs | None, text: str) -> str | None:
        """For an output finished under a relaxed (coerce_one_of) schema: why it does not validate against
        the schema as sent, or None when it does (and for every other spec, which is enforced exactly)."""
        if spec is None or spec not in self.relaxed:
            return None
        import jsonschema

        try:
            instance = json.loads(text)
        except ValueError as e:
            return f"the output is not JSON ({e})"
        schema = json.loads(spec.value)
        error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(instance))
        return None if error is None else f"the output does not match the schema: {error.message[:300]}"

    def new_state(self, spec: StructuredOutputs) -> GrammarState:
        llg = self._llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind} cannot be compiled: {matcher.get_error()}")
        return GrammarState(matcher)

    # ---------------------------------------------------------------- per step

    def fill_bitmask(self, states: list[tuple[int, GrammarState]], rows: int) -> np.ndarray:
        """int32 [rows, width]: all ones (every token allowed) except the rows of `states`, (row, state)
        pairs, which get their grammar's mask for the next token."""
        width = bitmask_width(self.vocab_size)
        mask = np.full((rows, width), -1, np.int32)
        if states:
            pairs = [(state.matcher, row) for row, state in states]
            self._executor.unsafe_compute_mask_ptr(pairs, mask.ctypes.data, width * 4, rows)
        return mask


def _grammar_text(llg, spec: StructuredOutputs, prune_one_of: bool = False, coerce_one_of: bool = False) -> str:
    try:
        if spec.kind == "json":
            try:
                schema = enforceable(json.loads(spec.value), prune_one_of)
            except Unenforceable as e:
                raise GrammarError(f"json_schema cannot be enforced exactly: {e}") from None
            options = {**_JSON_OPTIONS, "coerce_one_of": True} if coerce_one_of else _JSON_OPTIONS
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
        if spec.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if spec.kind == "grammar":
            return llg.grammar_from("grammar", spec.value)  # Lark, or GBNF converted to Lark
        if spec.kind == "lark":  # llguidance's Lark, e.g. with embedded %json schemas (forced tool calls)
            return llg.LLMatcher.grammar_from_lark(spec.value)
    except (ValueError, RuntimeError, TypeError) as e:
        raise GrammarError(f"{spec.kind} cannot be compiled: {e}") from None
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")
