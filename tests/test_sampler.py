"""SamplingParams validation, the batched sampler (filters, penalties, rng, logprobs) and stop checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pydantic import ValidationError

from workers.engine.sampler import (
    SamplerOutput,
    apply_penalties,
    argmax_rows,
    build_sampling_batch,
    check_stop,
    filter_logits,
    prompt_logprobs,
    sample,
)
from workers.engine.sampling_params import SamplingParams, SamplingParamsError

EOS = 2


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _sample(params_list, logits, *, generated=None, bucket=None, num_logprobs=0, **kwargs):
    """Builds a batch for `params_list` (padded to `bucket`) and samples `logits` (one row each)."""
    logits = np.asarray(logits, np.float32)
    n, vocab = len(params_list), logits.shape[-1]
    bucket = bucket or n
    padded = np.zeros((bucket, vocab), np.float32)
    padded[:n] = logits
    batch = build_sampling_batch(params_list, generated if generated is not None else [0] * n, bucket, vocab, **kwargs)
    out = sample(jnp.asarray(padded), batch, num_logprobs=num_logprobs)
    return jax.tree.map(lambda a: np.asarray(a)[:n], out)


def _empirical(params, probs, rows=4000):
    """Token frequencies over `rows` independent draws (one seed per row) from `probs`."""
    logits = np.tile(np.log(np.asarray(probs, np.float32)), (rows, 1))
    params_list = [params.model_copy(update={"seed": s}) for s in range(rows)]
    tokens = _sample(params_list, logits).token_ids
    return np.bincount(tokens, minlength=len(probs)) / rows


# ================================================================================ SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"foo": 1}, "foo"),
        ({"n": 2}, "n"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_params_raise_value_error_naming_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SamplingParamsError)
    assert f"{field}:" in str(info.value)
    assert [name for name, _ in info.value.errors] == [field]


def test_invalid_params_via_model_validate_and_cross_field():
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams.model_validate({"top_p": 0})
    with pytest.raises(SamplingParamsError, match=r"min_tokens \(20\) must be <= max_tokens \(16\)"):
        SamplingParams(min_tokens=20)
    with pytest.raises(SamplingParamsError, match="only n=1"):
        SamplingParams(n=3)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, (), ())
    assert p.skip_special_tokens and not p.ignore_eos and p.logprobs is None
    assert not p.is_greedy and not p.uses_penalties
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[7, 9]).stop_token_ids == (7, 9)
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(logprobs=0).logprobs == 0
    g = SamplingParams.greedy(max_tokens=4)
    assert g.is_greedy and g.temperature == 0.0 and g.max_tokens == 4
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    # Frozen and hashable (usable as a dict key / static jit argument).
    assert hash(SamplingParams(stop="x")) == hash(SamplingParams(stop=["x"]))
    with pytest.raises(ValidationError):
        p.temperature = 0.5


# ================================================================================ batch building


def test_build_batch_flags_and_padding():
    vocab = 32
    batch = build_sampling_batch([SamplingParams.greedy()] * 2, [0, 0], 4, vocab)
    assert batch.all_greedy and not batch.use_penalties
    assert not (batch.use_top_k or batch.use_top_p or batch.use_min_p)
    assert batch.token_counts is None and batch.prompt_mask is None and batch.banned_token_ids is None
    assert batch.temperature.shape == (4,) and batch.rng_words.shape == (4, 4)

    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5, seed=3), SamplingParams.greedy(min_p=0.5)]
    batch = build_sampling_batch(params, [0, 0, 0], 4, vocab, step_seed=0)
    assert not batch.all_greedy and batch.use_top_k and batch.use_top_p
    # min_p of a greedy row is irrelevant, so no min-p stage is compiled.
    assert not batch.use_min_p
    np.testing.assert_array_equal(np.asarray(batch.top_k), [5, vocab, vocab, vocab])
    np.testing.assert_array_equal(np.asarray(batch.temperature), [1, 1, 0, 0])


def test_build_batch_errors():
    with pytest.raises(ValueError, match="do not fit"):
        build_sampling_batch([SamplingParams()] * 3, [0] * 3, 2, 16)
    with pytest.raises(ValueError, match="prompt_token_ids_list and output_token_ids_list"):
        build_sampling_batch([SamplingParams(presence_penalty=1.0)], [0], 1, 16)
    with pytest.raises(ValueError, match="out of range"):
        build_sampling_batch([SamplingParams(frequency_penalty=1.0)], [1], 1, 16, [[1]], [[99]])


# ================================================================================ greedy / rng


def test_greedy_equals_argmax_with_padding():
    logits = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32)
    out = _sample([SamplingParams.greedy()] * 5, logits, bucket=8)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == np.int32


def test_mixed_batch_greedy_rows_take_argmax():
    logits = np.random.default_rng(1).normal(size=(4, 300)).astype(np.float32)
    params = [SamplingParams.greedy(), SamplingParams(seed=1), SamplingParams.greedy(), SamplingParams()]
    out = _sample(params, logits, step_seed=5)
    np.testing.assert_array_equal(out.token_ids[[0, 2]], logits[[0, 2]].argmax(-1))


def test_top_k_one_equals_greedy():
    logits = np.random.default_rng(2).normal(size=(6, 500)).astype(np.float32)
    params = [SamplingParams(top_k=1, temperature=1.5, seed=s) for s in range(6)]
    out = _sample(params, logits)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_seeded_sampling_independent_of_batch_position_and_composition():
    rng = np.random.default_rng(3)
    vocab, steps = 512, 20
    target = SamplingParams(seed=1234, temperature=0.9, top_k=100, top_p=0.95, min_p=0.01)
    others = [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=99, top_p=0.5)]
    alone, batched, repeat = [], [], []
    for step in range(steps):
        row = rng.normal(size=vocab).astype(np.float32) * 2
        noise = rng.normal(size=(3, vocab)).astype(np.float32)
        alone.append(_sample([target], row[None], generated=[step], step_seed=step).token_ids[0])
        repeat.append(_sample([target], row[None], generated=[step], step_seed=999).token_ids[0])
        # Row 2 of a batch of 4 (bucket 8), next to other seeded/unseeded requests at other lengths.
        logits = np.stack([noise[0], noise[1], row, noise[2]])
        params = [others[0], others[1], target, others[2]]
        out = _sample(params, logits, generated=[5, 0, step, 40], bucket=8, step_seed=step + 100)
        batched.append(out.token_ids[2])
    assert alone == batched == repeat
    assert len(set(alone)) > 5  # genuinely random, not a constant


def test_different_seeds_give_different_tokens():
    logits = np.zeros((1, 1000), np.float32)  # uniform: any two streams almost surely differ
    seq = {seed: [_sample([SamplingParams(seed=seed)], logits, generated=[t]).token_ids[0] for t in range(20)] for seed in (1, 2)}
    assert seq[1] != seq[2]
    # The step counter advances the stream: a seeded request does not repeat one token.
    assert len(set(seq[1])) > 10


def test_unseeded_rows_follow_step_seed():
    logits = np.zeros((4, 1000), np.float32)
    params = [SamplingParams()] * 4
    a = _sample(params, logits, step_seed=1).token_ids
    b = _sample(params, logits, step_seed=1).token_ids
    c = _sample(params, logits, step_seed=2).token_ids
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(set(a.tolist())) > 1  # rows of one step get different keys
    # An unseeded row does not replay the seeded stream with the same number.
    seeded = _sample([SamplingParams(seed=1)] * 4, logits, generated=[0, 1, 2, 3]).token_ids
    assert not np.array_equal(a, seeded)


# ================================================================================ filters


PROBS = [0.5, 0.3, 0.15, 0.05]


def _filtered(params, probs):
    logits = jnp.asarray(np.log(np.asarray(probs, np.float32))[None])
    batch = build_sampling_batch([params], [0], 1, len(probs), step_seed=0)
    return np.asarray(filter_logits(logits, batch))[0]


def test_top_p_keeps_only_the_nucleus():
    # Mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 (dropped).
    assert np.isfinite(_filtered(SamplingParams(top_p=0.7), PROBS)).tolist() == [True, True, False, False]
    assert np.isfinite(_filtered(SamplingParams(top_p=0.85), PROBS)).tolist() == [True, True, True, False]
    assert np.isfinite(_filtered(SamplingParams(top_p=0.1), PROBS)).tolist() == [True, False, False, False]
    assert np.isfinite(_filtered(SamplingParams(top_p=1.0), PROBS)).all()
    freq = _empirical(SamplingParams(top_p=0.7), PROBS)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.04  # renormalised nucleus; 4 sigma at 4000 draws


def test_top_k_then_top_p_on_renormalised_distribution():
    # top_k=3 renormalises to [0.526, 0.316, 0.158]; top_p=0.8 then keeps tokens 0 and 1 only.
    kept = np.isfinite(_filtered(SamplingParams(top_k=3, top_p=0.8), PROBS))
    assert kept.tolist() == [True, True, False, False]
    kept = np.isfinite(_filtered(SamplingParams(top_k=2), PROBS))
    assert kept.tolist() == [True, True, False, False]


def test_top_k_top_p_on_large_vocab_matches_sort_reference():
    rng = np.random.default_rng(4)
    vocab = 4096
    logits = (rng.normal(size=(3, vocab)) * 3).astype(np.float32)
    params = [
        SamplingParams(top_k=200, seed=0),
        SamplingParams(top_p=0.9, seed=1),
        SamplingParams(top_k=300, top_p=0.6, temperature=0.7, seed=2),
    ]
    batch = build_sampling_batch(params, [0, 0, 0], 3, vocab)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), batch)))
    for row, p in enumerate(params):
        scaled = logits[row] / p.temperature
        order = np.argsort(-scaled, kind="stable")
        k = p.top_k if p.top_k > 0 else vocab
        probs = np.exp(_log_softmax(scaled[order[:k]]))
        mass_before = np.cumsum(probs) - probs
        keep = int(np.sum(mass_before < p.top_p)) if p.top_p < 1 else k
        expected = np.zeros(vocab, bool)
        expected[order[:keep]] = True
        np.testing.assert_array_equal(got[row], expected)


def test_min_p_excludes_low_probability_tokens():
    # min_p=0.2 -> cut-off 0.2 * 0.5 = 0.1: token 3 (0.05) is dropped.
    kept = np.isfinite(_filtered(SamplingParams(min_p=0.2), PROBS))
    assert kept.tolist() == [True, True, True, False]
    freq = _empirical(SamplingParams(min_p=0.2), PROBS)
    assert freq[3] == 0
    assert abs(freq[2] - 0.15 / 0.95) < 0.03


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_empirical_distribution(temperature):
    probs = np.array([0.6, 0.3, 0.1])
    expected = probs ** (1 / temperature)
    expected /= expected.sum()
    rows = 4000
    freq = _empirical(SamplingParams(temperature=temperature), probs, rows=rows)
    sigma = np.sqrt(expected * (1 - expected) / rows)
    assert np.all(np.abs(freq - expected) < 4 * sigma + 1e-3), (freq, expected)


# ================================================================================ penalties


def _penalty_reference(logits, prompt, output, rep, presence, frequency):
    out = logits.astype(np.float64).copy()
    counts = np.bincount(output, minlength=logits.shape[-1])
    seen = counts > 0
    seen[prompt] = True
    out[seen] = np.where(out[seen] > 0, out[seen] / rep, out[seen] * rep)
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(5)
    vocab = 50
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [10, 11], [6]]
    outputs = [[3, 7, 7, 7, 20], [5, 5, 30], [], [6, 6]]
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
        SamplingParams(repetition_penalty=0.8, temperature=0.0),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5),
        SamplingParams(),  # no penalties: must stay untouched even in a penalised batch
    ]
    batch = build_sampling_batch(params, [len(o) for o in outputs], 4, vocab, prompts, outputs, step_seed=0)
    assert batch.use_penalties
    got = np.asarray(apply_penalties(jnp.asarray(logits), batch))
    for row, p in enumerate(params):
        expected = _penalty_reference(
            logits[row],
            prompts[row],
            np.asarray(outputs[row], np.int64),
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        np.testing.assert_allclose(got[row], expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])


def test_greedy_with_penalties_picks_argmax_of_penalised_logits():
    vocab = 10
    logits = np.zeros((1, vocab), np.float32)
    logits[0, 4], logits[0, 6] = 3.0, 2.0
    params = [SamplingParams.greedy(repetition_penalty=2.0)]
    # Token 4 occurs in the prompt: 3.0 / 2 = 1.5 < 2.0, so token 6 wins.
    out = _sample(params, logits, generated=[0], prompt_token_ids_list=[[4]], output_token_ids_list=[[]])
    assert out.token_ids[0] == 6
    # Frequency penalty over the output: 3.0 - 3 * 0.5 = 1.5 < 2.0.
    params = [SamplingParams.greedy(frequency_penalty=0.5)]
    out = _sample(params, logits, generated=[3], prompt_token_ids_list=[[]], output_token_ids_list=[[4, 4, 4]])
    assert out.token_ids[0] == 6


def test_repetition_penalty_matches_transformers():
    torch = pytest.importorskip("torch")
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(6)
    vocab = 64
    logits = rng.normal(size=(2, vocab)).astype(np.float32) * 4
    prompts = [[1, 5, 9, 9, 12], [0, 2, 7, 8, 8]]  # equal lengths for one HF tensor
    outputs = [[12, 40, 41], [2, 2, 63]]
    penalty = 1.35
    params = [SamplingParams(repetition_penalty=penalty)] * 2
    batch = build_sampling_batch(params, [3, 3], 2, vocab, prompts, outputs, step_seed=0)
    got = np.asarray(apply_penalties(jnp.asarray(logits), batch))

    processor = logits_process.RepetitionPenaltyLogitsProcessor(penalty=penalty)
    input_ids = torch.tensor([p + o for p, o in zip(prompts, outputs)])
    expected = processor(input_ids, torch.tensor(logits)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, logits)


# ================================================================================ min_tokens ban


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    vocab = 16
    logits = np.zeros((1, vocab), np.float32)
    logits[0, EOS], logits[0, 9], logits[0, 5] = 5.0, 4.0, 3.0
    params = [SamplingParams.greedy(min_tokens=3, stop_token_ids=[9])]
    early = _sample(params, logits, generated=[1], eos_token_ids=[EOS])
    assert early.token_ids[0] == 5
    # The ban does not touch the logprobs, which come from the raw logits.
    assert early.top_logprob_ids.shape == (1, 0)
    late = _sample(params, logits, generated=[3], eos_token_ids=[EOS])
    assert late.token_ids[0] == EOS
    # ignore_eos: EOS is not a stop token, so it is not banned either; stop ids still are.
    ignoring = [SamplingParams.greedy(min_tokens=3, stop_token_ids=[9], ignore_eos=True)]
    assert _sample(ignoring, logits, generated=[1], eos_token_ids=[EOS]).token_ids[0] == EOS
    logits[0, EOS] = 0.0
    assert _sample(ignoring, logits, generated=[1], eos_token_ids=[EOS]).token_ids[0] == 5


# ================================================================================ logprobs


def test_logprobs_are_raw_log_softmax_and_top_n_are_largest():
    rng = np.random.default_rng(7)
    vocab = 300
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 2
    outputs = [[1, 1], [], [5]]
    params = [
        SamplingParams(temperature=0.5, top_k=10, seed=1, repetition_penalty=1.5, logprobs=5),
        SamplingParams.greedy(logprobs=5),
        SamplingParams(seed=3, logprobs=2),
    ]
    out = _sample(
        params,
        logits,
        generated=[2, 0, 1],
        bucket=4,
        num_logprobs=5,
        prompt_token_ids_list=[[1, 2], [3], [4]],
        output_token_ids_list=outputs,
    )
    assert isinstance(out, SamplerOutput)
    reference = _log_softmax(logits)
    assert out.top_logprob_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    for row in range(3):
        np.testing.assert_array_equal(out.top_logprob_ids[row], np.argsort(-reference[row])[:5])
        np.testing.assert_allclose(out.top_logprobs[row], np.sort(reference[row])[::-1][:5], atol=1e-5)
        np.testing.assert_allclose(out.token_logprob[row], reference[row, out.token_ids[row]], atol=1e-5)
    assert out.token_ids[1] == logits[1].argmax()


def test_prompt_logprobs():
    rng = np.random.default_rng(8)
    vocab = 40
    prompt = [3, 17, 5, 5]
    logits = rng.normal(size=(len(prompt), vocab)).astype(np.float32)
    result = prompt_logprobs(jnp.asarray(logits), prompt, 3)
    assert len(result) == 4 and result[0] is None
    reference = _log_softmax(logits)
    for pos in range(1, 4):
        row = reference[pos - 1]
        entry = result[pos]
        token = prompt[pos]
        assert next(iter(entry)) == token  # the prompt token comes first
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-5)
        assert entry[token].rank == 1 + int(np.sum(row > row[token]))
        top = np.argsort(-row)[:3]
        assert set(entry) == {token, *top.tolist()}
        for rank, tok in enumerate(top, start=1):
            assert entry[int(tok)].rank == rank
            assert entry[int(tok)].logprob == pytest.approx(row[tok], abs=1e-5)
    assert prompt_logprobs(jnp.asarray(logits), [3], 2) == [None]
    only_prompt = prompt_logprobs(jnp.asarray(logits), prompt, 0)
    assert all(len(e) == 1 for e in only_prompt[1:])


# ================================================================================ stop checks


def test_stop_string_is_trimmed_with_text_after_it():
    p = SamplingParams(stop=["world"], max_tokens=100)
    # The stop string spans the previous and the new text.
    assert check_stop([10, 11], "Hello wor", "ld!", p, [EOS]) == (True, "stop", "Hello ", "world")
    p = SamplingParams(stop=["STOP", "x"], max_tokens=100)
    # The earliest match wins; everything from it on is dropped.
    assert check_stop([10, 11], "ab", "cSTOPx yz", p, [EOS]) == (True, "stop", "abc", "STOP")
    p = SamplingParams(stop="STOP", include_stop_str_in_output=True, max_tokens=100)
    assert check_stop([10, 11], "ab", "cSTOPxyz", p, [EOS]) == (True, "stop", "abcSTOP", "STOP")
    # No match: the full text, not finished.
    assert check_stop([10], "ab", "c", SamplingParams(stop="zz"), [EOS]) == (False, None, "abc", None)


def test_eos_stop_token_ids_and_length():
    p = SamplingParams(max_tokens=5, stop_token_ids=[42])
    assert check_stop([1, EOS], "hi", "</s>", p, [EOS]) == (True, "stop", "hi", None)
    assert check_stop([1, EOS], "hi", "", p, EOS) == (True, "stop", "hi", None)  # single int accepted
    assert check_stop([1, 42], "hi", "!", p, [EOS]) == (True, "stop", "hi", 42)
    # The stop token's text is kept with include_stop_str_in_output.
    keep = SamplingParams(stop_token_ids=[42], include_stop_str_in_output=True)
    assert check_stop([1, 42], "hi", "!", keep, [EOS]) == (True, "stop", "hi!", 42)
    assert check_stop([1, 2, 3, 4, 5], "abcd", "e", p, [EOS]) == (True, "length", "abcde", None)
    assert check_stop([1, 2, 3, 4], "abc", "d", p, [EOS]) == (False, None, "abcd", None)


def test_ignore_eos_continues_past_eos():
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    assert check_stop([1, EOS], "hi", "", p, [EOS]) == (False, None, "hi", None)
    assert check_stop([1, EOS, 3, EOS, 4], "hi", "x", p, [EOS]) == (True, "length", "hix", None)


def test_min_tokens_suppresses_eos_and_stop_strings():
    p = SamplingParams(min_tokens=3, max_tokens=10, stop=["."], stop_token_ids=[42])
    assert check_stop([EOS], "", "", p, [EOS]) == (False, None, "", None)
    assert check_stop([1, 42], "a", "b", p, [EOS]) == (False, None, "ab", None)
    assert check_stop([1, 2], "a", ".", p, [EOS]) == (False, None, "a.", None)
    # From the third token on, stop conditions apply again (only new text is searched).
    assert check_stop([1, 2, EOS], "a.", "", p, [EOS]) == (True, "stop", "a.", None)
    assert check_stop([1, 2, 3], "a.b", ".c", p, [EOS]) == (True, "stop", "a.b", ".")


def test_argmax_rows_is_jnp_argmax():
    """The sampler's argmax (a max and a min: XLA:CPU's argmax reduction is ~10x slower) picks what
    jnp.argmax picks: the first of tied maxima, a NaN over any number, index 0 of an all -inf row."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 37)).astype(np.float32)
    x[1, [3, 20]] = 50.0  # a tie: the first wins
    x[2] = -np.inf  # everything banned
    x[3, 5] = np.inf
    x[4, [7, 30]] = np.nan  # NaN is the maximum, the first one
    x[5, :] = 1.0  # all equal
    x[6] = np.round(x[6])  # many ties at the maximum
    got = jax.jit(argmax_rows)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert list(np.asarray(got)[1:6]) == [3, 0, 5, 7, 0]


def test_no_softmax_pass_when_no_row_wants_logprobs():
    """Without logprobs the greedy sampler is a max over the vocabulary, no exp/log pass (the engine asks
    for token logprobs only when a request has logprobs set); the tokens are the same either way."""
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((4, 50)).astype(np.float32))
    batch = build_sampling_batch([SamplingParams(temperature=0.0)] * 4, [0] * 4, 4, 50, step_seed=0)
    lean = sample.lower(logits, batch, 0, token_logprobs=False).as_text()
    full = sample.lower(logits, batch, 0).as_text()
    assert "exponential" not in lean and "exponential" in full
    with_lp, without = sample(logits, batch, 0), sample(logits, batch, 0, token_logprobs=False)
    np.testing.assert_array_equal(np.asarray(with_lp.token_ids), np.asarray(without.token_ids))
    np.testing.assert_array_equal(np.asarray(without.token_ids), np.argmax(np.asarray(logits), axis=-1))
