"""Structured outputs in the engine (llguidance masks applied in the sampler): JSON schema, regex, choice
and Lark grammars on a random-weight model, mixed with free requests in one batch, with asynchronous
scheduling on and off. The grammar is what makes the outputs valid."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from workers.engine import LLM, SamplingParams, StructuredOutputs
from workers.engine.structured import GrammarCompiler, GrammarError
from workers.models.make_model import make_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma"]
ENGINE = dict(dtype="float32", warmup=False, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("structured") / "tiny", "qwen3_moe", "tiny", seed=0)


def specs() -> list[StructuredOutputs | None]:
    return [
        StructuredOutputs.from_fields(json_schema=SCHEMA),
        StructuredOutputs.from_fields(regex=REGEX),
        StructuredOutputs.from_fields(choice=CHOICES),
        StructuredOutputs.from_fields(grammar='start: "(" NUMBER ("," NUMBER)* ")"\nNUMBER: /[0-9]{1,3}/'),
        StructuredOutputs.from_fields(json_object=True),
        None,
    ]


def check(spec: StructuredOutputs | None, text: str, finish_reason: str) -> None:
    if spec is None:
        return
    if spec.kind == "json_object":  # unbounded strings: a random model may run out of tokens inside one
        assert text.startswith("{") and (finish_reason == "length" or isinstance(json.loads(text), dict)), text
        return
    assert finish_reason == "stop", (spec.kind, text)  # every other grammar here is bounded
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif spec.kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", text), text


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_and_free_requests_in_one_batch(tiny, async_scheduling):
    """Every constrained output parses and follows its grammar, ending as soon as the grammar is complete
    ("stop"); the free requests in the same batch get exactly the tokens they get alone."""
    llm = LLM(model=str(tiny), async_scheduling=async_scheduling, **ENGINE)
    kinds = specs()
    prompts = [[5 + i, 17, 33, 99 + i] for i in range(12)]
    params = [SamplingParams(max_tokens=300, temperature=0.8, seed=i, structured=kinds[i % len(kinds)]) for i in range(12)]
    outs = llm.generate(prompts, params)
    for p, out in zip(params, outs):
        check(p.structured, out.text, out.finish_reason)
    free = [i for i, p in enumerate(params) if p.structured is None]
    alone = llm.generate([prompts[i] for i in free], [params[i] for i in free])
    assert [o.token_ids for o in alone] == [outs[i].token_ids for i in free]


def test_twenty_json_schema_requests_all_validate(tiny):
    llm = LLM(model=str(tiny), **ENGINE)
    spec = StructuredOutputs.from_fields(json_schema=SCHEMA)
    outs = llm.generate(
        [[7, i, 9] for i in range(20)], [SamplingParams(max_tokens=300, temperature=1.0, seed=i, structured=spec) for i in range(20)]
    )
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # the grammar constrains, the model still chooses


def test_bad_specs_fail_at_add_request(tiny):
    llm = LLM(model=str(tiny), **ENGINE)
    for spec in (StructuredOutputs(kind="regex", value="(unclosed"), StructuredOutputs(kind="grammar", value="start: nope")):
        with pytest.raises(ValueError, match="cannot be compiled"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured=spec))
    assert not llm.engine.has_unfinished()


def test_bitmask_rows_and_cache(tiny):
    from workers.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny)
    compiler = GrammarCompiler(tok, 512, tok.eos_token_ids)
    spec = StructuredOutputs.from_fields(choice=["ab", "cd"])
    assert compiler.grammar(spec) is compiler.grammar(StructuredOutputs.from_fields(choice=["ab", "cd"]))  # cached by spec
    state = compiler.new_state(spec)
    mask = compiler.fill_bitmask([(1, state)], rows=3)
    assert mask.shape == (3, 16) and (mask[0] == -1).all() and (mask[2] == -1).all()
    allowed = {t for t in range(512) if mask[1][t // 32] >> (t % 32) & 1}
    assert allowed and all(tok.decode([t]) and ("ab".startswith(tok.decode([t])) or "cd".startswith(tok.decode([t]))) for t in allowed)
    with pytest.raises(GrammarError):
        compiler.grammar(StructuredOutputs(kind="regex", value="["))
    assert np.count_nonzero(mask[1]) < 16


def test_logit_bias_and_allowed_token_ids(tiny):
    llm = LLM(model=str(tiny), **ENGINE)
    prompt = [5, 17, 33, 99]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].token_ids
    forced = llm.generate([prompt], greedy.model_copy(update={"logit_bias": ((42, 100.0),)}))[0].token_ids
    assert forced == [42] * 6
    banned = llm.generate([prompt], greedy.model_copy(update={"logit_bias": ((free[0], -100.0),)}))[0].token_ids
    assert banned[0] != free[0]
    allowed = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True, allowed_token_ids=[10, 20, 300])
    outs = llm.generate([prompt, prompt], [allowed, greedy])  # one restricted row beside a free one
    assert set(outs[0].token_ids) <= {10, 20, 300} and outs[1].token_ids == free
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([prompt], SamplingParams(max_tokens=2, allowed_token_ids=[100000]))


def test_bad_words(tiny):
    """A bad word's last token is banned wherever the output ends with the rest of it (vLLM's rule)."""
    llm = LLM(model=str(tiny), **ENGINE)
    tok = llm.engine.tokenizer
    prompt = [5, 17, 33, 99]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    free = llm.generate([prompt], greedy)[0].token_ids

    def spans(n):  # positions whose n tokens are exactly what their text encodes to
        return [i for i in range(len(free) - n) if tok.encode(tok.decode(free[i : i + n]), add_special_tokens=False) == free[i : i + n]]

    for n in (1, 2):
        i = spans(n)[0]
        word = tok.decode(free[i : i + n])
        out = llm.generate([prompt], greedy.model_copy(update={"bad_words": (word,)}))[0].token_ids
        first = i + n - 1  # the word's last token, where the free output first completes it
        assert out[:first] == free[:first] and out[first] != free[first], (n, word, free, out)
        assert not any(out[j : j + n] == free[i : i + n] for j in range(len(out))), (word, out)
