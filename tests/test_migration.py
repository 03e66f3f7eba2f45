"""Mid-stream migration: a request resumed on another engine with the tokens the client already has
continues exactly as if uninterrupted (greedy and seeded, penalties, stop strings across the boundary),
sending nothing twice."""

from __future__ import annotations

import pytest
from engine_harness import ENGINE_ARGS, prompts

from workers.engine import EngineConfig, EngineCore, SamplingParams
from workers.engine.sampling_params import StructuredOutputs
from workers.models.make_model import make_model

ARGS = {**ENGINE_ARGS, "warmup": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("migration") / "m", "mixtral", "tiny", seed=5)


@pytest.fixture(scope="module")
def engines(model_dir):
    return [EngineCore(EngineConfig(model=str(model_dir), worker_id=w, **ARGS), show_progress=False) for w in ("a", "b")]


def deltas_of(engine, request_id, prompt, params, **kw) -> list:
    engine.add_request(request_id, prompt, params, **kw)
    out = []
    while engine.has_unfinished():
        out += [d for d in engine.step() if d.request_id == request_id]
    return out


def tokens_and_text(deltas) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, seed=11, max_tokens=14, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, frequency_penalty=1.5, repetition_penalty=1.3),
    # The grammar state is rebuilt from the resumed tokens: the rest still follows it, to the same end.
    "structured": SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, structured=StructuredOutputs.from_fields(regex=r"[a-z]{3,6}-[0-9]{4,8}-[A-Z]{2}")
    ),
}


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("split", [1, 6])
def test_a_resumed_request_continues_as_if_uninterrupted(engines, kind, split):
    a, b = engines
    params = PARAMS[kind]
    prompt = prompts(1, seed=40, lo=20, hi=21)[0]
    whole = deltas_of(a, f"w-{kind}-{split}", prompt, params)
    tokens, text = tokens_and_text(whole)
    sent = whole[:split]  # one delta per step here: what the client had when the first engine died
    sent_tokens, sent_text = tokens_and_text(sent)
    rest = deltas_of(b, f"r-{kind}-{split}", prompt, params, resume=sent_tokens)
    rest_tokens, rest_text = tokens_and_text(rest)
    assert sent_tokens + rest_tokens == tokens
    assert sent_text + rest_text == text  # nothing sent twice, nothing missing
    assert rest[0].num_output_tokens == split + 1 and rest[-1].num_output_tokens == len(tokens)
    assert rest[-1].finish_reason == whole[-1].finish_reason == ("stop" if kind == "structured" else "length")


def test_a_stop_string_across_the_migration_point_still_stops(engines):
    a, b = engines
    prompt = prompts(1, seed=41, lo=20, hi=21)[0]
    free = deltas_of(a, "free", prompt, PARAMS["greedy"])
    # A stop string made of the end of one token's text and the start of the next (the split between
    # them), at the first such pair that is not blank and does not occur earlier.
    texts = [d.text for d in free]
    split = next(
        (
            k
            for k in range(2, len(texts))
            if texts[k - 1].strip() and texts[k].strip() and (texts[k - 1][-1] + texts[k][0]) not in "".join(texts[: k - 1])
        ),
        None,
    )
    assert split is not None, texts
    stop = texts[split - 1][-1] + texts[split][0]
    params = PARAMS["greedy"].model_copy(update={"stop": (stop,)})
    whole = deltas_of(a, "whole", prompt, params)
    assert whole[-1].finish_reason == "stop"
    tokens, text = tokens_and_text(whole)
    assert len(whole) == split + 1  # it stopped at the token after the split
    sent_tokens, sent_text = tokens_and_text(whole[:split])
    rest = deltas_of(b, "rest", prompt, params, resume=sent_tokens)
    assert sent_text + tokens_and_text(rest)[1] == text and rest[-1].finish_reason == "stop"


def test_bad_resumes_are_refused_with_a_clear_error(engines):
    a, _ = engines
    prompt = prompts(1, seed=42, lo=20, hi=21)[0]
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="leave nothing to generate"):
        a.add_request("x", prompt, params, resume=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        a.add_request("x", prompt, params, resume=[10**9])
    with pytest.raises(ValueError, match="max_model_len"):
        a.add_request("x", prompt, SamplingParams(max_tokens=500), resume=[1] * (ARGS["max_model_len"] - len(prompt)))
    assert not a.has_unfinished()
