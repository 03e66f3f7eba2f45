"""Step programs shared by the engines of one process (workers/engine/program_cache.py)."""

from __future__ import annotations

import threading
import time

import pytest
from engine_harness import ENGINE_ARGS, prompts, run_to_end

from workers.engine import EngineConfig, EngineCore, SamplingParams
from workers.engine.program_cache import STEP_PROGRAMS, StepProgramCache
from workers.models.make_model import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "m", "qwen3_moe", "tiny", seed=3)


def _engine(path, warmup: bool = True) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), warmup=warmup, background_compile=False, **ENGINE_ARGS), show_progress=False)


def _tokens(engine: EngineCore) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts(6, seed=21, lo=2, hi=60)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True))
    outputs: dict = {}
    run_to_end(engine, "r0", outputs)
    return {rid: out.token_ids for rid, out in outputs.items()}


def test_a_second_engine_with_the_same_settings_runs_the_first_ones_programs(tiny, tmp_path):
    first = _engine(tiny)
    second = _engine(tiny)
    shapes = second.runner.compiled_shapes()
    assert shapes and second.runner.num_traces == 0 and second.runner.num_shared_programs == len(shapes)
    assert all(second.runner.program(s) is first.runner.program(s) for s in shapes)
    # Each engine still runs on its own KV pages: the same requests, the same tokens, one after the other.
    assert _tokens(second) == _tokens(first)

    # The weights are the programs' arguments, not constants in them: another checkpoint of the same
    # shapes runs the shared programs and gets what its own programs give.
    other = make_model(tmp_path / "other", "qwen3_moe", "tiny", seed=4)
    shared = _engine(other)
    assert shared.runner.num_traces == 0
    capacity = STEP_PROGRAMS.capacity
    STEP_PROGRAMS.capacity = 0
    try:
        own = _engine(other)
    finally:
        STEP_PROGRAMS.capacity = capacity
    assert own.runner.num_traces == len(shapes)
    assert _tokens(shared) == _tokens(own) != _tokens(first)


def test_what_the_trace_reads_keeps_runners_apart(tiny, monkeypatch):
    key = _engine(tiny, warmup=False).runner.program_key()
    assert key == _engine(tiny, warmup=False).runner.program_key()
    # A kernel's implementation switch is read while tracing.
    monkeypatch.setenv("MORAY_ATTENTION_IMPL", "jnp")
    assert _engine(tiny, warmup=False).runner.program_key() != key
    monkeypatch.delenv("MORAY_ATTENTION_IMPL")
    more = EngineCore(EngineConfig(model=str(tiny), warmup=False, **{**ENGINE_ARGS, "max_num_seqs": 4}), show_progress=False)
    assert more.runner.program_key() != key


def test_the_cache_builds_a_key_once_forgets_a_failure_and_keeps_its_capacity():
    cache = StepProgramCache(capacity=2)
    started, release, built = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(10)
        built.append(1)
        return "program"

    results = []
    first = threading.Thread(target=lambda: results.append(cache.get_or_build("a", slow)))
    first.start()
    assert started.wait(10)
    waiter = threading.Thread(target=lambda: results.append(cache.get_or_build("a", lambda: pytest.fail("built twice"))))
    waiter.start()
    time.sleep(0.05)  # the waiter is now blocked on the first build (or about to be): either way it must not build
    release.set()
    first.join(10), waiter.join(10)
    assert sorted(results, key=lambda r: r[1]) == [("program", False), ("program", True)] and built == [1]

    def broken():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        cache.get_or_build("b", broken)
    assert cache.get_or_build("b", lambda: "fixed") == ("fixed", True)  # the failure was not kept
    cache.get_or_build("c", lambda: "c")
    assert len(cache) == 2 and cache.get_or_build("a", lambda: "again") == ("again", True)  # "a" was the oldest

    off = StepProgramCache(capacity=0)
    assert off.get_or_build("a", lambda: 1) == (1, True) and off.get_or_build("a", lambda: 2) == (2, True)
