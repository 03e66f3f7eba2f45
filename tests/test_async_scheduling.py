"""Asynchronous scheduling: the host schedules and prepares step N+1 and turns step N's tokens into outputs
while the device runs; the outputs are the same as when every step is waited for."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine_harness import prompts, run_to_end, small_engine_args
from workers.engine import EngineConfig, SamplingParams
from workers.engine.engine import EngineCore
from workers.engine.output_processor import RequestOutput
from workers.models.make_model import make_model

ARGS = small_engine_args("async")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("async") / "m", "qwen3_moe", "tiny", seed=5)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("async-hybrid") / "m", "qwen3_5_moe", "tiny", seed=6)


def engine(model, async_scheduling: bool, **overrides) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), async_scheduling=async_scheduling, **{**ARGS, **overrides}), show_progress=False)


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]], abort: dict[str, int] | None = None) -> dict:
    """Runs the requests to the end; `abort`: request -> the step at which to abort it. Returns each
    request's final (token ids, text, finish reason, logprobs) and checks the streamed deltas add up."""
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    streamed: dict[str, list[int]] = {rid: [] for rid in requests}
    final = {}
    outputs: dict[str, RequestOutput] = {}
    step = 0
    while core.has_unfinished():
        for rid, at in (abort or {}).items():
            if at == step:
                core.abort(rid)
        for out in core.step():
            assert out.request_id not in final, "a delta after the request's last one"
            streamed[out.request_id] += out.token_ids
            whole = outputs.setdefault(out.request_id, RequestOutput(out.request_id, [])).add(out)
            if out.finished:
                final[out.request_id] = (whole.token_ids, whole.text, whole.finish_reason, whole.logprobs)
        step += 1
    assert set(final) == set(requests)
    for rid, (tokens, *_) in final.items():
        assert streamed[rid] == tokens, rid
    return final


def mixed_requests(reference: dict) -> dict[str, tuple[list[int], SamplingParams]]:
    """Greedy, seeded sampling, penalties, logprobs, min_tokens, stop strings and stop tokens (taken from
    a greedy run's output, so that they do fire), short and long."""
    ps = prompts(10, seed=21, lo=20, hi=70)
    text, tokens = reference["g0"][1], reference["g0"][0]
    return {
        "g0": (ps[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
        "g1": (ps[1], SamplingParams(temperature=0, max_tokens=3)),
        "seed": (ps[2], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)),
        "pen": (ps[3], SamplingParams(temperature=0, repetition_penalty=1.4, presence_penalty=0.6, max_tokens=20, ignore_eos=True)),
        "lp": (ps[4], SamplingParams(temperature=0, logprobs=3, max_tokens=12, ignore_eos=True)),
        "min": (ps[5], SamplingParams(temperature=0, min_tokens=6, max_tokens=9)),
        "stop_str": (
            ps[0],
            SamplingParams(temperature=0, stop=[text[len(text) // 2 : len(text) // 2 + 3]], max_tokens=24, ignore_eos=True),
        ),
        "stop_tok": (ps[0], SamplingParams(temperature=0, stop_token_ids=[tokens[9]], max_tokens=24, ignore_eos=True)),
        "one": (ps[6], SamplingParams(temperature=0, max_tokens=1)),
        "long": (ps[7], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)),
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        (ta, xa, ra, la), (tb, xb, rb, lb) = a[rid], b[rid]
        assert (ta, xa, ra) == (tb, xb, rb), rid
        if la is not None:
            assert [sorted(d) for d in la] == [sorted(d) for d in lb], rid
            assert np.allclose([v for d in la for v in d.values()], [v for d in lb for v in d.values()], atol=1e-5), rid


def test_async_outputs_equal_sync_under_preemption(tiny):
    """Every sampling feature, with a KV pool small enough to preempt: the same tokens, text, finish
    reasons and logprobs; steps launched ahead for requests that then stopped add nothing."""
    reference = run(
        engine(tiny, False), {"g0": (prompts(10, seed=21, lo=20, hi=70)[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))}
    )
    requests = mixed_requests(reference)
    sync_core, async_core = engine(tiny, False, num_kv_blocks=24), engine(tiny, True, num_kv_blocks=24)
    sync, asynchronous = run(sync_core, requests), run(async_core, requests)
    assert_same(sync, asynchronous)
    assert asynchronous["stop_str"][2] == "stop" and asynchronous["stop_tok"][2] == "stop"
    assert len(asynchronous["stop_tok"][0]) == 10  # nothing after the stop token, though a step ran ahead
    assert async_core.preemptions > 0, "the pool was meant to be small enough to preempt"
    for core in (sync_core, async_core):
        assert core.kv.num_free_blocks == core.kv.pool.num_blocks  # nothing leaked
        assert not core.has_unfinished()


def test_abort_while_a_step_is_in_flight(tiny):
    """An abort between launch and read: the request ends with "abort", its in-flight token is dropped,
    the others are unaffected and no block leaks."""
    ps = prompts(3, seed=31, lo=10, hi=40)
    requests = {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for i, p in enumerate(ps)}
    alone = run(engine(tiny, False), {k: v for k, v in requests.items() if k != "r1"})
    core = engine(tiny, True)
    out = run(core, requests, abort={"r1": 4})
    assert out["r1"][2] == "abort" and len(out["r1"][0]) < 16
    assert_same({k: v for k, v in out.items() if k != "r1"}, alone)
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_hybrid_async_keeps_snapshots_at_decode_boundaries(hybrid):
    """Qwen3.5 (linear-attention state): the same outputs both ways, and a follow-up turn whose prompt
    continues the first one's output reuses the state snapshotted while it decoded (the block boundary
    inside the output needs the token a step in flight samples: that step waits for it)."""
    p = prompts(1, seed=41, lo=21, hi=22)[0]
    first = {"t1": (p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))}
    results = []
    for mode in (False, True):
        core = engine(hybrid, mode, enable_prefix_caching=True)
        out1 = run(core, first)
        follow = {"t2": (p + out1["t1"][0] + [7, 8, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))}
        core.add_request("t2", *follow["t2"])
        second = run_to_end(core, "t2")
        cached, out2 = second.num_cached_tokens, second.token_ids
        results.append((out1, out2, cached))
    (s1, s2, sc), (a1, a2, ac) = results
    assert_same(s1, a1)
    assert s2 == a2
    assert ac == sc and ac >= 40, "the follow-up turn should reuse the snapshot at a block boundary inside the first output"


def _burner(seconds: float):
    """A jitted computation that takes about `seconds` on this machine and passes its input through:
    appended to each step, it makes a slow device step that the host does not wait for at dispatch.
    Returns it with the time it was measured to take (the calibration is only approximate)."""
    m = jnp.full((192, 192), 1e-3, jnp.float32)

    def build(n):
        @jax.jit
        def burn(logits):
            acc = jax.lax.fori_loop(0, n, lambda _, a: jnp.tanh(a @ m), m)
            return jnp.where(acc[0, 0] == -123.0, logits + 1.0, logits)  # depends on acc: not optimised away

        return burn

    probe = build(64)
    x = jnp.zeros((4,), jnp.float32)
    probe(x).block_until_ready()
    start = time.perf_counter()
    probe(x).block_until_ready()
    per_iter = (time.perf_counter() - start) / 64
    burn = build(max(1, int(seconds / per_iter)))
    burn(x).block_until_ready()
    took = []
    for _ in range(3):
        start = time.perf_counter()
        burn(x).block_until_ready()
        took.append(time.perf_counter() - start)
    return burn, statistics.median(took)


def test_next_step_preparation_overlaps_the_device_step(tiny):
    """A slow device step (D) and slow host preparation (H, in the scheduler): waiting for every step
    costs D + H per step; asynchronous scheduling hides the host behind the device, about max(D, H).

    Whether the host's work overlaps the device's is read from the device itself: an asynchronous step
    returns, and the next one's preparation begins, while the program it launched is still running. The
    step times only confirm the premise: compared across the two runs, they once failed under the suite's
    other test worker (a burst of load during the asynchronous run made it as slow as the synchronous one)."""
    device_s, host_s = 0.15, 0.08
    burn, device_s = _burner(device_s)
    timings = {}
    outputs = {}
    running_on_return = {}  # mode -> per step: was its program still running when `step` returned?
    for mode in (False, True):
        launched = []
        core = engine(tiny, mode, max_num_seqs=4)
        real_program, real_schedule = core.runner.program, core.scheduler.schedule

        def slow_program(shape, _real=real_program, _launched=launched):
            program = _real(shape)

            def slow_step(*args):
                logits, *cache_and_loads = program(*args)
                _launched.append(burn(logits))
                return _launched[-1], *cache_and_loads

            return slow_step

        def slow_schedule(_real=real_schedule):
            time.sleep(host_s)
            return _real()

        core.add_request("r", prompts(1, seed=51, lo=12, hi=13)[0], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        core.step()  # compiles outside the timed part
        core.runner.program, core.scheduler.schedule = slow_program, slow_schedule
        durations, tokens, running = [], [], []
        while core.has_unfinished():
            start = time.perf_counter()
            before = len(launched)
            for out in core.step():
                tokens += out.token_ids
            durations.append(time.perf_counter() - start)
            if len(launched) > before:
                running.append(not launched[-1].is_ready())
        timings[mode] = statistics.median(durations[1:-1])
        outputs[mode] = tokens
        running_on_return[mode] = running
    assert outputs[True][-13:] == outputs[False][-13:]
    # The premise: waited for, the fake device step is slow (its time varies by ~15% from the calibration).
    assert timings[False] >= host_s + 0.5 * device_s, timings
    assert not any(running_on_return[False])  # waited for: each step's program has finished when it returns
    # Asynchronous: every step returns with its program still running (the next step's host work overlaps it).
    assert len(running_on_return[True]) >= 10 and all(running_on_return[True]), running_on_return
