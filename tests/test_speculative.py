"""Speculative decoding (workers/engine/speculative.py): verification is exact. Greedy output with drafts
equals greedy output without, token for token, for attention-only, hybrid (Gated DeltaNet: the state is
restored when a draft is rejected) and MLA models, alone and in mixed batches, colocated, disaggregated
and over data-parallel ranks; seeded sampling gives the same tokens with speculation on or off; at
temperature 1 the token distribution is the target's; rejected drafts leave no blocks, events or state.

Random-weight models accept few n-gram drafts, so besides the real n-gram proposer the tests plug in an
oracle that proposes the reference continuation with every third proposal's last token wrong: both the
accept path (whole runs of drafts) and the reject path run on every model."""

from __future__ import annotations

import json
import random
import statistics

import jsonschema
import numpy as np
import pytest
from engine_harness import ENGINE_ARGS, kv_handoff, prompts

from bench import scratch_dir
from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams, StructuredOutputs
from workers.engine.kv_events import KVEventKind
from workers.engine.speculative import NgramProposer, accepted_length, ngram_propose
from workers.models.make_model import make_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
# The speed gate (speculate only where it measured faster) is timing-driven: off where counts are checked.
SPEC = {"num_speculative_tokens": 3, "adaptive": False}
# One persistent XLA cache for the module: its later engines load the programs its first ones compiled.
ARGS = {**ENGINE_ARGS, "compilation_cache_dir": scratch_dir("moray-spec-xla-")}


class Oracle:
    """Proposes what the request would generate (from a run without speculation), spoiling the last
    token of every third proposal so that runs of drafts are also rejected part-way."""

    def __init__(self, prompts_, outputs, vocab: int, spoil_every: int = 3):
        self.ref = {tuple(p): list(o) for p, o in zip(prompts_, outputs)}
        self.vocab, self.spoil_every, self.calls = vocab, spoil_every, 0

    def propose(self, request, limit):
        ref = self.ref.get(tuple(request.prompt_token_ids), [])
        drafts = ref[len(request.output_token_ids) : len(request.output_token_ids) + limit]
        self.calls += 1
        if drafts and self.spoil_every and self.calls % self.spoil_every == 0:
            drafts[-1] = (drafts[-1] + 1) % self.vocab
        return drafts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {arch: make_model(root / arch, arch, "tiny", seed=3) for arch in ("qwen3_moe", "qwen3_next", "deepseek_v3")}


def spec_llm(model, proposer=None, **kw) -> LLM:
    llm = LLM(str(model), speculative=SPEC, **{**ARGS, **kw})
    if proposer is not None:
        llm.engine.speculator.proposer = proposer
    return llm


def assert_nothing_left(engine: EngineCore) -> None:
    """Every block is back in the pool, and (hybrid) every state slot is free or a snapshot."""
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    slots = getattr(engine.kv, "slots", None)
    if slots is not None:
        assert not slots.working and len(slots.free) + len(slots.snapshots) == slots.num_slots


def stored_hashes(engine: EngineCore, ps, outputs) -> set[int]:
    """The hashes of every full block of the requests' real tokens (prompt + output)."""
    from workers.engine.block_hash import block_hashes

    valid = set()
    for p, o in zip(ps, outputs):
        valid |= set(block_hashes(p + list(o), engine.kv.block_size, engine.config.model_name))
    return valid


# ------------------------------------------------------------------------------------------ units


def test_ngram_lookup_takes_the_longest_suffix_and_its_earliest_occurrence():
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_propose(tokens, 2, 1, 3) == [9, 2]  # [1, 2, 3] first at 0
    assert ngram_propose(tokens, 5, 1, 2) == [9, 2, 3, 7, 8]  # [2, 3] earliest at 1
    assert ngram_propose([5, 6, 7], 3, 1, 4) == []  # nothing repeats
    assert ngram_propose([4, 4], 3, 1, 1) == [4]  # a match right before the suffix proposes what follows it
    assert ngram_propose([1, 2, 3, 1, 2], 3, 3, 4) == []  # only suffixes of 3-4 tokens count


def test_ngram_lookup_equals_a_plain_search_on_random_sequences():
    def reference(tokens, k, lo, hi):
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            for start in range(len(tokens) - n):  # windows followed by at least one token, earliest first
                if tokens[start : start + n] == tokens[len(tokens) - n :]:
                    return tokens[start + n : start + n + k]
        return []

    rng = np.random.default_rng(3)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(1, 40))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 6)), int(rng.integers(1, 5))
        assert ngram_propose(tokens, k, lo, hi) == reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_the_ngram_proposers_token_array_follows_the_request_as_it_grows():
    from workers.engine import SamplingParams
    from workers.engine.request import Request

    request = Request("r", list(range(50)), SamplingParams(max_tokens=500))
    first = NgramProposer.token_array(request)
    assert first.tolist() == list(range(50))
    for t in range(200):  # past its capacity several times
        request.output_token_ids.append(t % 7)
        assert NgramProposer.token_array(request).tolist() == request.all_token_ids
    assert NgramProposer(1, 4).propose(request, 3) == ngram_propose(request.all_token_ids, 3, 1, 4) != []


def test_accepted_length_stops_at_the_first_mismatch():
    assert accepted_length([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_length([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_length([4], [3, 4]) == 0


def test_config_names_and_checks():
    cfg = EngineConfig(model="m", speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5})
    assert cfg.speculative.num_speculative_tokens == 4 and cfg.speculative.prompt_lookup_min == 1
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(model="m", speculative={"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError):
        EngineConfig(model="m", speculative={"method": "eagle"})


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next", "deepseek_v3"])
def test_greedy_output_is_unchanged_and_nothing_is_left_behind(models, arch):
    """A mixed batch (prompts of several lengths, one seeded sampled request, prefill chunks beside
    verify steps) with the oracle's drafts, then with real n-gram drafts: the tokens without speculation,
    the same KV events (no block of a rejected token is ever published), and an empty pool at the end."""
    model = models[arch]
    ps = [p * 2 for p in prompts(4, seed=1, lo=3, hi=14)] + prompts(2, seed=2, lo=40, hi=60)
    params = [GREEDY] * 5 + [SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)]
    base = LLM(str(model), **ARGS)
    base_sub = base.engine.events.subscribe()
    ref = [o.token_ids for o in base.generate(ps, params)]
    base_events = {(e.kind, e.block_hash) for e in base_sub.drain()}

    oracle = Oracle(ps, ref, base.engine.cfg.vocab_size)
    spec = spec_llm(model, oracle)
    sub = spec.engine.events.subscribe()
    assert [o.token_ids for o in spec.generate(ps, params)] == ref
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 20 and stats.num_draft_tokens > stats.num_accepted_tokens  # both paths ran
    assert stats.accepted_per_pos[2] > 0  # whole runs of 3 were accepted
    events = {(e.kind, e.block_hash) for e in sub.drain()}
    if not spec.engine.cfg.is_hybrid:
        assert events == base_events
    else:  # snapshots sit where steps end, which drafts move: every one names accepted tokens
        assert {h for kind, h in events if kind == KVEventKind.STORED} <= stored_hashes(spec.engine, ps, ref)
    assert_nothing_left(spec.engine)

    if arch != "qwen3_moe":
        return  # the proposer does not depend on the model: one family runs it
    spec.engine.speculator.proposer = NgramProposer(1, 4)
    before = stats.num_drafts
    assert [o.token_ids for o in spec.generate(ps, params)] == ref
    assert stats.num_drafts > before  # the n-gram proposer found repeats in the doubled prompts
    assert_nothing_left(spec.engine)


def test_seeded_sampling_is_the_same_with_speculation_on_or_off_alone_or_batched(models):
    model = models["qwen3_moe"]
    ps = prompts(4, seed=3, lo=5, hi=20)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=25, ignore_eos=True) for i in range(4)]
    base = LLM(str(model), **ARGS)
    ref = [o.token_ids for o in base.generate(ps, params)]
    spec = spec_llm(model, Oracle(ps, ref, base.engine.cfg.vocab_size))
    assert [o.token_ids for o in spec.generate(ps, params)] == ref
    assert [spec.generate([ps[1]], [params[1]])[0].token_ids] == [ref[1]]  # alone
    assert spec.engine.speculator.stats.num_accepted_tokens > 10


def test_penalties_logprobs_and_stop_strings_follow_the_drafts(models):
    """Penalties count accepted drafts as output, logprobs are the target's for every token, and a stop
    token inside an accepted run ends the request there."""
    model = models["qwen3_moe"]
    ps = prompts(3, seed=4, lo=5, hi=20)
    base = LLM(str(model), **ARGS)
    pen = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2)
    ref = base.generate(ps, pen)
    stop_at = ref[0].token_ids[10]
    stopping = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_at])
    ref_stop = base.generate([ps[0]], stopping)[0]
    spec = spec_llm(model, Oracle(ps, [o.token_ids for o in ref], base.engine.cfg.vocab_size))
    out = spec.generate(ps, pen)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for a, b in zip(out, ref):
        assert len(a.logprobs) == len(a.token_ids)
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and np.allclose(list(la.values()), list(lb.values()), atol=1e-4)
    assert spec.generate([ps[0]], stopping)[0].token_ids == ref_stop.token_ids
    assert spec.engine.speculator.stats.num_accepted_tokens > 10


def test_temperature_one_distribution_is_the_targets(models):
    """Three allowed tokens, three output tokens, 600 unseeded requests with and without speculation; the
    oracle always proposes the same token. A rule that accepted drafts too often (or never resampled)
    shifts the distribution of the drafted positions far past the chi-square bound."""
    model = models["qwen3_moe"]
    allowed = [11, 12, 13]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, allowed_token_ids=allowed)
    n = 600

    class Always:
        def propose(self, request, limit):
            return [12] * limit

    def histogram(llm):
        outs = llm.generate([[5, 6, 7, 8]] * n, params)
        counts = np.zeros((2, 3))
        for o in outs:
            for pos in (1, 2):  # the drafted positions
                counts[pos - 1, allowed.index(o.token_ids[pos])] += 1
        return counts

    base = histogram(LLM(str(model), **ARGS))
    spec_engine = spec_llm(model, Always(), seed=1)
    spec = histogram(spec_engine)
    assert spec_engine.engine.speculator.stats.num_drafts > n / 2
    for row_a, row_b in zip(base, spec):  # two-sample chi-square, 2 degrees of freedom
        total = row_a + row_b
        expected_a, expected_b = total * n / (2 * n), total * n / (2 * n)
        chi2 = (((row_a - expected_a) ** 2 / np.maximum(expected_a, 1)) + ((row_b - expected_b) ** 2 / np.maximum(expected_b, 1))).sum()
        assert chi2 < 16.0, (row_a, row_b)  # p < 0.0004 under the null
    # The target's own distribution is not the oracle's: an always-accept rule would give ~all 12.
    assert base[0, 1] < 0.9 * n


def test_a_json_schema_request_with_drafts_gives_valid_json(models, tmp_path):
    """Drafts the grammar refuses are cut before they are verified; accepted ones advance the matcher
    exactly as sampled tokens do: the same JSON as without speculation."""
    model = make_model(tmp_path / "tok", "qwen3_moe", "tiny", seed=0)  # with a tokenizer
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    spec_fields = StructuredOutputs.from_fields(json_schema=schema)
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured=spec_fields)] * 3
    ps = [[5 + i, 17, 33, 99] for i in range(3)]
    kw = dict(max_model_len=256, page_buckets=[4, 32])
    base = LLM(str(model), **{**ARGS, **kw})
    ref = base.generate(ps, params)

    class Spoiled(Oracle):  # half the proposals end in a token the grammar refuses inside JSON
        def propose(self, request, limit):
            drafts = super().propose(request, limit)
            return drafts + [0] if len(drafts) < limit and self.calls % 2 else drafts

    oracle = Spoiled(ps, [o.token_ids for o in ref], base.engine.cfg.vocab_size)
    spec = spec_llm(model, oracle, **kw)
    out = spec.generate(ps, params)
    for a, b in zip(out, ref):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason == "stop"
        jsonschema.validate(json.loads(a.text), schema)
    assert spec.engine.speculator.stats.num_accepted_tokens > 10
    assert_nothing_left(spec.engine)


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_disaggregated_decode_speculates_exactly(models, arch):
    """Prefill on one engine, KV handoff, decode with drafts on another: the colocated tokens."""
    model = models[arch]
    ps = [p * 2 for p in prompts(3, seed=6, lo=4, hi=12)]
    base = LLM(str(model), **ARGS)
    ref = [o.token_ids for o in base.generate(ps, GREEDY)]
    prefill = EngineCore(EngineConfig(model=str(model), worker_id="p", **ARGS), show_progress=False)
    decode = EngineCore(EngineConfig(model=str(model), worker_id="d", speculative=SPEC, **ARGS), show_progress=False)
    decode.speculator.proposer = Oracle(ps, ref, base.engine.cfg.vocab_size)
    for i, p in enumerate(ps):
        _, whole, _ = kv_handoff(prefill, decode, f"r{i}", p, GREEDY)
        assert whole[0].token_ids == ref[i]
    assert decode.speculator.stats.num_accepted_tokens > 10
    assert_nothing_left(decode)


def test_data_parallel_ranks_speculate_exactly(models):
    model = models["qwen3_moe"]
    ps = prompts(4, seed=8, lo=4, hi=30)
    base = LLM(str(model), **ARGS)
    ref = [o.token_ids for o in base.generate(ps, GREEDY)]
    spec = spec_llm(model, Oracle(ps, ref, base.engine.cfg.vocab_size), parallel={"mesh": "2x4", "dp": 2, "tp": 4})
    assert [o.token_ids for o in spec.generate(ps, GREEDY)] == ref
    assert spec.engine.speculator.stats.num_accepted_tokens > 10
    assert_nothing_left(spec.engine)


def test_poor_acceptance_backs_off_to_one_draft(models):
    """A request whose drafts keep failing proposes one token at a time; past disable_by_batch_size no
    request proposes anything."""
    model = models["qwen3_moe"]

    class Wrong:
        def propose(self, request, limit):
            return [1] * limit

    ps = prompts(2, seed=9, lo=5, hi=10)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, allowed_token_ids=list(range(2, 60)))
    spec = spec_llm(model, Wrong())
    spec.generate(ps, params)
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens == 0
    assert stats.num_draft_tokens < 1.6 * stats.num_drafts  # mostly single drafts after the first few
    off = LLM(str(model), speculative={**SPEC, "disable_by_batch_size": 2}, **ARGS)
    off.engine.speculator.proposer = Wrong()
    off.generate(ps, params)
    assert off.engine.speculator.stats.num_drafts == 0


def test_events_of_a_run_with_drafts_name_only_accepted_tokens(models):
    """Every STORED block of a speculative run hashes the tokens the request really has."""
    model = models["qwen3_moe"]
    ps = [p * 3 for p in prompts(3, seed=10, lo=3, hi=8)]
    base = LLM(str(model), **ARGS)
    ref = base.generate(ps, GREEDY)
    spec = spec_llm(model, Oracle(ps, [o.token_ids for o in ref], base.engine.cfg.vocab_size, spoil_every=2))
    sub = spec.engine.events.subscribe()
    out = spec.generate(ps, GREEDY)
    valid = stored_hashes(spec.engine, ps, [o.token_ids for o in out])
    stored = {e.block_hash for e in sub.drain() if e.kind == KVEventKind.STORED}
    assert stored and stored <= valid


# ------------------------------------------------------------------------------------------ draft model


def test_a_draft_model_equal_to_the_target_is_always_right_and_a_different_one_stays_exact(models, tmp_path):
    """The draft shares the target's block ids (its own smaller pages): with the target itself as draft
    every greedy draft is accepted; another model's drafts are mostly rejected, and the output is still
    the target's. A hybrid target takes an attention-only draft."""
    target = models["qwen3_moe"]
    ps = prompts(3, seed=12, lo=3, hi=40)
    ref = [o.token_ids for o in LLM(str(target), **ARGS).generate(ps, GREEDY)]
    same = LLM(str(target), speculative={"method": "draft", "model": str(target), "num_speculative_tokens": 3, "adaptive": False}, **ARGS)
    assert [o.token_ids for o in same.generate(ps, GREEDY)] == ref
    stats = same.engine.speculator.stats
    assert stats.num_draft_tokens > 20 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_nothing_left(same.engine)

    other = make_model(tmp_path / "other", "qwen3_moe", "tiny", seed=9)  # same tokenizer, other weights
    hybrid = models["qwen3_next"]
    ref_h = [o.token_ids for o in LLM(str(hybrid), **ARGS).generate(ps, GREEDY)]
    for model, expected in ((target, ref), (hybrid, ref_h)):
        llm = LLM(
            str(model), speculative={"method": "draft_model", "model": str(other), "num_speculative_tokens": 1, "adaptive": False}, **ARGS
        )
        assert [o.token_ids for o in llm.generate(ps, GREEDY)] == expected
        assert llm.engine.speculator.stats.num_draft_tokens > 15
        assert_nothing_left(llm.engine)


def test_a_draft_with_another_tokenizer_fails_at_load(models, tmp_path):
    from workers.models.make_model import Preset

    small_vocab = make_model(tmp_path / "v", "qwen3_moe", Preset(384, 32, 1, 2, 1, 16, 2, 1, 32, 64, 0.02, 1 << 30))
    with pytest.raises(ValueError, match="vocab_size 384 differs"):
        LLM(str(models["qwen3_moe"]), speculative={"method": "draft", "model": str(small_vocab)}, **ARGS)
    with pytest.raises(ValueError, match="needs `model`"):
        EngineConfig(model="m", speculative={"method": "draft"})


# ------------------------------------------------------------------------------------------ speed gate


def drive_gate(gate, steps: int, rate, batch: int = 4, switch_seconds: float = 1.0) -> list[bool]:
    """Runs `steps` decode steps the way the engine does: a call launches a step in the gate's mode, then
    reports the step launched before it with the mode that followed. `rate(mode)` gives a steady step's
    tokens (per second); a plain step next to a speculating one takes `switch_seconds` instead of 1 (it
    runs synchronously: a speculating step is planned from its tokens)."""
    modes, previous, launched = [], None, None
    for _ in range(steps):
        mode = gate.wants(batch)
        if launched is not None:
            seconds = 1.0 if launched or previous == launched == mode else switch_seconds
            gate.observe(batch, launched, rate(launched), seconds, mode)
            previous = launched
        launched = mode
        modes.append(mode)
    return modes


def test_speed_gate_keeps_the_faster_mode_per_batch_bucket_and_probes_the_other_less_often_while_it_holds():
    from workers.engine.speculative import SpeedGate

    gate = SpeedGate(probe_every=16, probe_len=4, max_probe_every=128)
    assert gate.wants(3)  # nothing measured: speculate first
    modes = drive_gate(gate, 1000, lambda spec: 8 if spec else 4)
    assert not all(modes[:20])  # then measure without
    assert modes[100:].count(False) >= 4  # the other mode is probed...
    # ...every 128 steps once the choice held (give or take the jitter that keeps probes out of step with
    # a periodic workload)
    assert modes[500:].count(False) <= 4 * (500 // int(128 * (1 - SpeedGate._JITTER)) + 1)
    assert gate.rate(4, True) == 8 and gate.rate(4, False) == 4
    assert gate.wants(1)  # another bucket starts over
    # Speculating gets slower: the gate leaves it once its own figure falls below the other's (within its
    # window of steps' tokens), and goes on probing it, less often while that holds.
    modes = drive_gate(gate, 700, lambda spec: 3 if spec else 4)
    assert 4 <= modes[gate.yield_window :].count(True) <= 4 * 8  # past its window: probes only
    assert modes[400:].count(True) <= 4 * (300 // int(128 * (1 - SpeedGate._JITTER)) + 1)


def test_speed_gate_does_not_take_a_switchs_cost_for_the_speed_of_the_mode_it_switched_to():
    """A plain step between speculating ones cannot overlap the host's work with the device's (the next plan
    needs its tokens): measured as the plain mode's speed, it made speculating look faster where it was
    not (bench spec: 0.6x at batch 16 with the gate on)."""
    from workers.engine.speculative import SpeedGate

    gate = SpeedGate()
    modes = drive_gate(gate, 600, lambda spec: 6 if spec else 8, switch_seconds=2.0)
    assert modes[200:].count(True) <= 20
    assert gate.rate(4, False) == 8 and gate.rate(4, True) == 6


def test_speed_gate_counts_what_its_switches_cost_and_does_not_switch_on_noise():
    """A step beside a switch costs more than a steady one: it cannot overlap the host with the device,
    and a draft model or an MTP head catches up on the tokens it missed. Near break-even, the gate that
    counted steady steps only probed as often as if switches were free and flipped modes on noise: with
    switches costing 3 steps, equal modes ran at 0.89 of either. It measures the switches now, spaces
    its probes by their cost and holds a mode unless the other is faster by more than the noise."""
    from workers.engine.speculative import SpeedGate

    def drive(spec_tokens, seed, steps=3000, switch_extra=3.0, plain_tokens=8, batch=4):
        gate, rng = SpeedGate(seed=seed), random.Random(seed)
        previous, launched, tokens, seconds = None, None, 0.0, 0.0
        for _ in range(steps):
            mode = gate.wants(batch)
            if launched is not None:
                s = rng.uniform(0.9, 1.1) + (0.0 if previous == launched == mode else switch_extra)
                t = spec_tokens if launched else plain_tokens
                gate.observe(batch, launched, t, s, mode)
                tokens, seconds, previous = tokens + t, seconds + s, launched
            launched = mode
        return gate, tokens / seconds / max(spec_tokens, plain_tokens)

    for spec_tokens in (7.8, 8, 8.2, 6, 10):  # near break-even either way, and clearly slower or faster
        runs = [drive(spec_tokens, seed) for seed in range(6)]
        assert statistics.median(rate for _, rate in runs) > 0.96, spec_tokens  # the old gate: 0.89-0.97
        assert all(g._switch_s[4] == pytest.approx(3.0, abs=0.3) for g, _ in runs)  # measured, not guessed


def drive_gate_on_text(gate, stretches, drafted: int = 4, spec_s: float = 1.3, steps: int = 6000) -> tuple[float, float]:
    """A batch of one over text whose stretches the drafts do or do not predict (`stretches(step)`: True in
    a predictable one): a speculating step takes `spec_s` and yields `drafted` tokens there and 1
    elsewhere; a plain step yields 1 in 1 s (1.6 s next to a speculating one). Returns the share of steps
    speculated and the tokens per second."""
    previous, launched, speculated, tokens, seconds = None, None, 0, 0, 0.0
    for i in range(steps):
        mode = gate.wants(1)
        if launched is not None:
            predictable = stretches(i)  # the text goes on whichever mode runs
            t = (drafted if predictable else 1) if launched else 1
            s = spec_s if launched else (1.0 if previous is not True and mode is False else 1.6)
            gate.observe(1, launched, t, s, mode)
            tokens, seconds, previous = tokens + t, seconds + s, launched
        launched = mode
        speculated += mode
    return speculated / steps, tokens / seconds


def test_speed_gate_keeps_speculating_where_drafts_pay_in_stretches():
    """What a speculating step yields comes in stretches. With the tokens of its last few probes only, the
    gate kept n-gram drafts off at batch 1 where they ran 1.5x faster (bench spec, code, k=3: 927 tok/s
    measured for speculating against 1,587 always on); a benchmark repeating one request met every probe
    at the same place. Here speculating yields 2.5 tokens per 1.3 s on average, 1.9x plain decoding."""
    from workers.engine.speculative import SpeedGate

    for period in (64, 66):  # a benchmark's passes: half of each predictable
        share, rate = drive_gate_on_text(SpeedGate(), lambda i, p=period: i % p < p // 2)
        assert share > 0.9 and rate > 1.8

    def random_stretches(seed):
        rng, state = random.Random(seed), {"good": True, "left": 0}

        def stretches(_):
            if state["left"] == 0:
                state["good"], state["left"] = not state["good"], rng.randint(10, 60)
            state["left"] -= 1
            return state["good"]

        return stretches

    shares = [drive_gate_on_text(SpeedGate(), random_stretches(seed))[0] for seed in range(8)]
    assert statistics.median(shares) > 0.8  # the old gate: 0.06-0.15
    # Where speculating does not pay (2 tokens in predictable stretches, 1.8 s a step), it stays off.
    share, rate = drive_gate_on_text(SpeedGate(), random_stretches(1), drafted=2, spec_s=1.8)
    assert share < 0.03 and rate > 0.98


def test_switching_between_speculating_and_plain_asynchronous_steps_stays_exact(models):
    """The gate may turn speculation off at any step (the engine then schedules asynchronously again) and
    back on: a step launched with drafts is always read before the next one is planned.

    A plain step reads one logits row per sequence: a speculating engine's plain steps read k + 1 (the LM
    head and the sampler over rows nobody reads: 0.83-0.92x the engine without speculation at batch 16,
    speculation off). Warm-up compiles both row counts: switching compiles nothing."""
    model = models["qwen3_moe"]
    ps = prompts(5, seed=13, lo=3, hi=30)
    ref = [o.token_ids for o in LLM(str(model), **ARGS).generate(ps, GREEDY)]
    llm = spec_llm(model, Oracle(ps, ref, 512), async_scheduling=True, warmup=True, background_compile=False)
    runner = llm.engine.runner
    warm, steps, prepare = set(runner.compiled_shapes()), [], runner.prepare

    def recording_prepare(out, prev=None):
        inputs = prepare(out, prev)
        drafts = any(item.num_spec for item in out.scheduled)
        steps.append((drafts, inputs.tokens.shape[-1], len(inputs.logits_indices), bool(inputs.prompt_rows)))
        return inputs

    runner.prepare = recording_prepare

    class Every:
        def __init__(self):
            self.calls = 0

        def wants(self, batch):
            self.calls += 1
            return (self.calls // 3) % 2 == 0  # the engine asks a few times a step: runs of on and off

        def observe(self, *args):
            pass

    llm.engine.speculator.gate = Every()
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == ref
    assert llm.engine.speculator.stats.num_accepted_tokens > 5
    assert_nothing_left(llm.engine)
    k, seqs = SPEC["num_speculative_tokens"], ARGS["max_num_seqs"]
    rows = {(drafts, n, r) for drafts, n, r, prompt in steps if not prompt}
    assert {d for d, _, _ in rows} == {False, True}  # both kinds of step ran
    assert all(r == min(n, seqs * (k + 1 if drafts else 1)) for drafts, n, r in rows), rows
    assert set(runner.compiled_shapes()) == warm


# ------------------------------------------------------------------------------------------ trained models


def test_a_test_sized_model_trains_deterministically_is_cached_and_predicts_code(tmp_path):
    """`train_tiny`'s test-sized target: trained in seconds (loss falls by more than a nat), cached under its
    digest (the second call trains nothing), and a model n-gram speculation gains on: on held-out code
    the target accepts a good share of the drafts, where a random model accepts almost none."""
    import time as _time

    from workers.models.tokenizer import Tokenizer
    from workers.models.train_tiny import TEST_TARGET, trained_model

    path = trained_model(TEST_TARGET, tmp_path, show_progress=False)
    record = json.loads((path / "trained.json").read_text())
    assert record["loss"][-1][1] < record["loss"][0][1] - 1.0
    t = _time.perf_counter()
    assert trained_model(TEST_TARGET, tmp_path) == path and _time.perf_counter() - t < 1.0

    from bench.spec import workload_prompts

    ps = workload_prompts(Tokenizer.from_dir(path), "code", 4, 48)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(str(path), speculative={"num_speculative_tokens": 3, "adaptive": False}, **{**ARGS, "max_model_len": 128})
    llm.generate(ps, params)
    assert llm.engine.speculator.stats.acceptance_rate > 0.2


def test_bench_spec_times_a_run_for_its_minimum_window_and_pairs_each_run_with_its_baseline(models):
    """`bench spec` figures: a timed run decodes its batch again until its steps took `min_s` (one pass at
    batch 1 is tens of milliseconds here), summing tokens, time and draft counters; a speed-up is the median
    of each run over the baseline run beside it, so drift between runs does not enter it."""
    from bench.spec import decode_run, paired_speedup, timed_run

    engine = spec_llm(models["qwen3_moe"]).engine
    ps = prompts(2, seed=4, lo=5, hi=6)
    one = decode_run(engine, ps, 8)
    assert one["tokens"] == 2 * 7 and one["seconds"] > 0  # every token after each request's first
    run = timed_run(engine, ps, 8, min_s=3 * one["seconds"])
    assert run["passes"] >= 3 and run["seconds"] >= 3 * one["seconds"]
    assert run["tokens"] == run["passes"] * 2 * 7
    assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["seconds"])
    assert run["draft_tokens"] >= run["accepted"] >= 0 and run["drafts"] > 0  # the counters of every pass
    assert timed_run(engine, ps, 8)["passes"] == 1  # no window asked: one pass

    # The machine got 3x faster between the second baseline run and the run beside it: the ratio of the
    # medians says 3.3x, each run over its own baseline 1.1x (and the odd pair is outvoted).
    base = [{"tokens_per_s": t} for t in (100.0, 100.0, 300.0)]
    spec = [{"tokens_per_s": t} for t in (110.0, 330.0, 330.0)]
    assert paired_speedup(spec, base) == pytest.approx(1.1)
