"""Incremental detokenisation: streamed deltas add up to the full decode, never split a character, and each
token decodes a short window, not the whole output."""

from __future__ import annotations

import random

import pytest

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.models.make_model import make_model
from workers.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(str(make_model(tmp_path_factory.mktemp("detok") / "m", "qwen3_moe", "tiny", seed=3)))


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.update(ids[: i + 1]) for i in range(len(ids))]


def test_deltas_add_up_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    words = ["héllo", " wörld", " 日本語", " 🙂🙂", " plain", "\n", " ü"]
    for trial in range(20):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text)
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text, trial
        assert all("\ufffd" not in d for d in deltas)  # an incomplete character is held back, never sent


def test_random_ids_never_emit_a_broken_character_and_end_equal(tokenizer):
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
        deltas = stream(tokenizer, ids)
        full = tokenizer.decode(ids)
        assert full.startswith("".join(deltas))  # at most a trailing incomplete character still held back
        assert len(full) - len("".join(deltas)) <= 1 or full.endswith("\ufffd")


def test_cost_per_token_does_not_grow_with_the_output(tokenizer):
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" word" * 2000)
    detok = IncrementalDetokenizer(counting)
    for i in range(len(ids)):
        detok.update(ids[: i + 1])
    assert detok.text == tokenizer.decode(ids)
    assert counting.decoded < 8 * len(ids)  # a few tokens of window per token (the full decode: n^2 / 2)


def test_all_token_ids_grows_in_place():
    r = Request("r", [1, 2, 3], SamplingParams())
    first = r.all_token_ids
    assert first == [1, 2, 3]
    r.output_token_ids.append(4)
    assert r.all_token_ids is first and first == [1, 2, 3, 4]
    r.output_token_ids += [5, 6]
    assert r.all_token_ids == [1, 2, 3, 4, 5, 6] and r.num_tokens == 6


@pytest.mark.parametrize("keep", [False, True])
def test_stop_strings_match_on_a_window_not_the_whole_output(tokenizer, monkeypatch, keep):
    """A long output's stop check reads the new text and at most the longest stop string's length of text
    before it (the output so far is not copied per token), and still stops where a whole-text search would:
    at a stop string spanning several tokens, with the text cut (or kept) exactly as vLLM does."""
    from workers.engine import output_processor
    from workers.engine.structured import GrammarCompiler

    seen = []
    real = output_processor.check_stop
    monkeypatch.setattr(output_processor, "check_stop", lambda ids, before, *a: seen.append(len(before)) or real(ids, before, *a))
    stops = ("END-OF-IT", "never")
    body = " word" * 1500 + " and END-OF-IT trailing"
    ids = tokenizer.encode(body)
    params = SamplingParams(stop=list(stops), include_stop_str_in_output=keep, max_tokens=len(ids) + 5)
    outputs = output_processor.OutputProcessor(tokenizer, (), GrammarCompiler(tokenizer, tokenizer.vocab_size, ()), 10**6)
    outputs.add("r", params)
    request = Request("r", [1], params)
    streamed, reason = [], None
    for token in ids:
        request.output_token_ids.append(token)
        delta = outputs.append(request, token, None)
        streamed.append(delta.text)
        if delta.finish_reason is not None:
            reason = delta.finish_reason
            break
    want = body[: body.index("END-OF-IT") + (len("END-OF-IT") if keep else 0)]
    assert reason == "stop" and "".join(streamed) == want
    assert len(seen) > 1000 and max(seen) <= max(map(len, stops))
