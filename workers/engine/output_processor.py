"""Output processing: a step's sampled tokens -> the step's `TokenDelta`s.

The engine's step is schedule -> run -> post-process (nano-vllm's shape); this is the post-process half
that is not scheduling: detokenise (incrementally: O(1) per token), check stops (EOS, stop tokens, stop
strings, max_tokens, max_model_len), advance each constrained request's grammar, gather logprobs. It owns
every request's output-side state and never touches the scheduler: it tells the engine which requests a
token finished, and the engine finishes them there.

`RequestOutput` is the offline API's whole-request result (`LLM.generate`), accumulated from deltas.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

from workers.messages import TokenDelta

from .detokenizer import IncrementalDetokenizer
from .request import Request
from .sampler import check_stop
from .sampling_params import SamplingParams
from .structured import GrammarCompiler, GrammarState

log = logging.getLogger("moray.engine")


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer
    logprobs: bool  # the request asked for logprobs
    prompt_logprobs: list | None = None  # sent with the request's first delta, then dropped
    grammar: GrammarState | None = None  # structured outputs: where the output is in its grammar
    bad_words: list[list[int]] = field(default_factory=list)  # token ids of each bad word (both spellings)
    sent: int = 0  # characters of the detokenizer's text already sent in deltas


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], grammars: GrammarCompiler, max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars
        self.max_model_len = max_model_len
        self._states: dict[str, _OutputState] = {}

    # ---------------------------------------------------------------- requests

    def add(self, request_id: str, params: SamplingParams, prompt_logprobs: list | None = None) -> None:
        self._states[request_id] = _OutputState(
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            params.logprobs is not None,
            prompt_logprobs,
            grammar=self.grammars.new_state(params.structured) if params.structured is not None else None,
            bad_words=self._bad_word_ids(params.bad_words),
        )

    def fill_prompt_logprobs(self, request_id: str, first: int, entries: list) -> None:
        """Prompt logprobs computed by a step: positions [first, first + len(entries)) of the request's list
        (made with `add`; None at position 0). Once its first delta took the list, later fills (a preempted
        request computing its prompt again) change nothing."""
        state = self._states.get(request_id)
        if state is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs[first : first + len(entries)] = entries

    def continue_from(self, request: Request, tokens: list[int]) -> None:
        """A request whose first output `tokens` were sampled (and streamed) elsewhere under the same
        parameters: the prefill side of a handoff (its first token), or a decode replica that died mid-stream
        (every token it sent). The output state takes them as its own: the text so far (so new text, stop
        strings across the boundary and held-back partial characters continue exactly) and the grammar."""
        state = self._states[request.request_id]
        state.detokenizer.update(request.output_token_ids)
        state.sent = _sendable(state.detokenizer.num_chars, request.sampling_params, final=False)  # as the sender did
        if state.grammar is not None:
            for t in tokens:
                state.grammar.accept(t)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def grammar(self, request_id: str) -> GrammarState | None:
        state = self._states.get(request_id)
        return state.grammar if state else None

    # ---------------------------------------------------------------- per token

    def append(self, request: Request, token: int, logprobs: dict[int, float] | None) -> TokenDelta:
        """The delta of `token`, just appended to `request.output_token_ids`; its `finish_reason` is set when
        the token ends the request (the engine then finishes it in the scheduler)."""
        state = self._states[request.request_id]
        params = request.sampling_params
        # Stop strings are matched over the new text and the few characters before it that a match ending in
        # it could start in: the output so far is never copied per token.
        before = state.detokenizer.tail(params.max_stop_len)
        text = state.detokenizer.update(request.output_token_ids)
        stop = check_stop(request.output_token_ids, before, text, params, self.eos_token_ids)
        reason = stop.reason if stop.finished else None
        if state.grammar is not None and reason is None and _grammar_done(state.grammar, token):
            reason = "stop"
        if reason is None and request.num_tokens >= self.max_model_len:
            reason = "length"
        if stop.finished:  # stop.text is what the window (before + text) becomes
            state.detokenizer.replace_tail(len(before) + len(text), stop.text)
        if reason == "stop" and state.grammar is not None and self.grammars.violation(params.structured, state.detokenizer.text):
            reason = "schema_violation"  # a relaxed (coerce_one_of) schema let through what the schema as sent refuses
        text = self._text_to_send(state, params, final=reason is not None)
        delta = TokenDelta(
            request.request_id,
            [token],
            text,
            len(request.output_token_ids),
            max(request.num_cached_tokens, 0),
            reason,
            [logprobs] if state.logprobs and logprobs is not None else None,
            state.prompt_logprobs,
            _queue_s(request) if len(request.output_token_ids) == 1 else None,
        )
        state.prompt_logprobs = None
        if reason is not None:
            del self._states[request.request_id]
        return delta

    @staticmethod
    def _text_to_send(state: _OutputState, params: SamplingParams, final: bool) -> str:
        """The text a delta carries: what is new since the last delta, less the end a stop string may still
        start in (vLLM's stop buffer), so that streamed text never holds what a stop string later cuts."""
        detok = state.detokenizer
        upto = _sendable(detok.num_chars, params, final)
        if upto <= state.sent:
            return ""
        text = detok.tail(detok.num_chars - state.sent)[: upto - state.sent]
        state.sent = upto
        return text

    def aborted(self, request: Request) -> TokenDelta:
        """The last delta of a request stopped from outside (abort): no new token, the text held back for
        stop strings (if any), reason "abort"."""
        state = self._states.pop(request.request_id, None)
        text = self._text_to_send(state, request.sampling_params, final=True) if state is not None else ""
        return TokenDelta(request.request_id, [], text, len(request.output_token_ids), max(request.num_cached_tokens, 0), "abort")

    # ---------------------------------------------------------------- what the sampler needs

    def bad_word_bans(self, requests: Sequence[Request]) -> dict[int, list[int]] | None:
        """Per row: the last token of each bad word whose other tokens end the output so far."""
        bans = {}
        for j, request in enumerate(requests):
            state = self._states.get(request.request_id)
            if state is None or not state.bad_words:
                continue
            out = request.output_token_ids
            ids = [w[-1] for w in state.bad_words if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1 :] == w[:-1])]
            if ids:
                bans[j] = ids
        return bans or None

    def _bad_word_ids(self, words: tuple[str, ...]) -> list[list[int]]:
        """Each bad word's token ids, as written and after a space (vLLM bans both spellings)."""
        out = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


def _grammar_done(grammar: GrammarState, token: int) -> bool:
    """Advances the grammar past `token`; True once it is complete (only EOS could follow), so the request
    ends there instead of spending a step on the EOS. A token the grammar rejects cannot be sampled under
    its mask; were it to happen, the request ends rather than leave its grammar."""
    if not grammar.accept(token):
        log.warning("a sampled token broke its request's grammar: %s", grammar.matcher.get_error())
        return True
    return grammar.finished


@dataclass
class RequestOutput:
    """One request's whole output (the offline API's result), accumulated from its deltas."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the whole output text, once the request has finished
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None  # per output token: {token id: logprob}, top-N + chosen
    prompt_logprobs: list | None = None  # per prompt position (None at 0): {token id: Logprob}
    _text_parts: list[str] = field(default_factory=list, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: TokenDelta) -> RequestOutput:
        """Takes one delta in, at a cost that does not grow with the output: the text's pieces are joined
        into `text` once the request finishes."""
        self.token_ids += delta.token_ids
        self._text_parts.append(delta.text)
        self.num_cached_tokens = delta.num_cached_tokens
        self.finish_reason = delta.finish_reason
        if delta.finish_reason is not None:
            self.text = "".join(self._text_parts)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return self


def _sendable(num_chars: int, params: SamplingParams, final: bool) -> int:
    """How much of an output's `num_chars` characters its deltas may have carried: all once it ends; before
    that, all but the last (longest stop string - 1), which a stop string completed later could begin in."""
    return num_chars if final else max(0, num_chars - max(params.max_stop_len - 1, 0))


def _queue_s(request: Request) -> float | None:
    """How long the request waited for its first step (vLLM's queue time), sent with its first token."""
    if request.scheduled_time is None:
        return None
    return max(0.0, request.scheduled_time - request.arrival_time)
