"""The engine end to end on CPU: greedy parity with transformers, batching invariance, prefix caching,
preemption, aborts that never leak blocks, seeded sampling, compile counting, and input validation."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import torch
import transformers
from engine_harness import BUCKETED_ENGINE_ARGS, ENGINE_ARGS, prompts, run_to_end
from hf_checkpoints import save_hf_checkpoint
from process_harness import without_suite_xla_cache

from workers.engine import LLM, EngineConfig, EngineCore, SamplingParams
from workers.engine.block_hash import block_hashes
from workers.engine.kv_events import KVEventKind
from workers.models.make_model import make_model

ROOT = Path(__file__).resolve().parent.parent

FAMILIES = {
    "qwen3_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1], num_hidden_layers=3, head_dim=24
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=48),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=48, norm_topk_prob=True
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "m", "qwen3_moe", "tiny", seed=3)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(str(tiny), **ENGINE_ARGS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_equals_transformers(family, tmp_path):
    d = save_hf_checkpoint(tmp_path / family, family, **FAMILIES[family])
    llm = LLM(str(d), **ENGINE_ARGS)
    batch = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45, 1, 90, 33], list(range(1, 30))]
    ours = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for prompt, out in zip(batch, ours):
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_prompt_logprobs_equal_transformers_log_softmax(family, tmp_path):
    """prompt_logprobs (echo's and vLLM's field): each prompt token's logprob given the ones before it
    equals transformers' log-softmax to 1e-4, for prompts whose forward is padded to a power of two (5 ->
    16, 23 -> 32 positions: one compile per bucket) and one exactly a power of two long."""
    d = save_hf_checkpoint(tmp_path / family, family, **FAMILIES[family])
    llm = LLM(str(d), **ENGINE_ARGS)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for prompt in ([3, 17, 42, 5, 88], list(range(1, 24)), list(range(2, 34))):
        out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, t in enumerate(prompt[1:], start=1):
            assert abs(out.prompt_logprobs[i][t].logprob - float(ref[i - 1, t])) < 1e-4, (i, t)
            top = sorted(out.prompt_logprobs[i].items(), key=lambda kv: kv[1].rank)
            assert top[0][1].rank == 1 and abs(top[0][1].logprob - float(ref[i - 1].max())) < 1e-4


def test_prompt_logprobs_come_from_the_batched_prefill_steps(tmp_path, monkeypatch):
    """A prompt's logprobs are computed by the steps that prefill it, beside other requests: no forward of
    their own (it would fail here), chunked prefill (a 99-token prompt over 64-token steps), a prefix-cached
    prompt computed again (its cached positions have no logits otherwise); transformers' log-softmax to 1e-4,
    and the request without them gets its tokens as if alone."""
    import workers.models

    d = save_hf_checkpoint(tmp_path / "q", "qwen3_moe", **FAMILIES["qwen3_moe"])
    llm = LLM(str(d), **ENGINE_ARGS)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    free = [9, 8, 7, 6, 5, 4, 3]
    alone = llm.generate([free], GREEDY)[0].token_ids

    def no_separate_forward(*args, **kwargs):
        raise AssertionError("prompt logprobs took a forward of their own")

    monkeypatch.setattr(workers.models, "prompt_logits", no_separate_forward)
    long, short = [(7 * i) % 90 + 2 for i in range(99)], [3, 17, 42, 5, 88]
    wants = SamplingParams(max_tokens=2, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([long, free, short], [wants, GREEDY, wants])
    again = llm.generate([long], wants)[0]  # its blocks are cached now: computed again all the same
    assert outs[1].token_ids == alone and outs[1].prompt_logprobs is None
    for prompt, out in [(long, outs[0]), (short, outs[2]), (long, again)]:
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, t in enumerate(prompt[1:], start=1):
            assert abs(out.prompt_logprobs[i][t].logprob - float(ref[i - 1, t])) < 1e-4, (len(prompt), i, t)
        assert out.token_ids[0] == int(ref[-1].argmax())


def test_sliding_window_generation_matches_transformers_forward(tmp_path):
    """With a sliding window, transformers' own `generate` drifts from its full forward once the
    sequence is past the window (its sliding cache); the model definition is the full forward, so the
    engine's greedy tokens must be the argmax of transformers' logits over the generated sequence."""
    d = save_hf_checkpoint(tmp_path / "sw", "mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=48, sliding_window=12)
    llm = LLM(str(d), **ENGINE_ARGS)
    batch = [list(range(1, 30)), [8, 2, 77, 45, 1, 90, 33]]
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    for prompt, out in zip(batch, llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].numpy()
        assert out.token_ids == logits.argmax(-1).tolist()


def test_concurrent_requests_equal_alone(llm):
    batch = prompts(16, seed=1)
    together = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch[:6], together[:6]):
        alone = llm.generate([prompt], GREEDY)[0]
        assert alone.token_ids == out.token_ids
    assert len({tuple(o.token_ids) for o in together}) > 1


def test_chunked_prefill_matches_a_single_chunk(tiny):
    """A 100-token prompt over a 64-token step budget is prefilled in two chunks."""
    prompt = prompts(1, seed=2, lo=100, hi=101)[0]
    chunked = LLM(str(tiny), **ENGINE_ARGS).generate([prompt], GREEDY)[0]
    whole = LLM(str(tiny), **{**ENGINE_ARGS, "max_num_batched_tokens": 128, "token_buckets": [8, 128]}).generate([prompt], GREEDY)[0]
    assert chunked.token_ids == whole.token_ids


def test_prefix_cache_hit_reports_cached_tokens(llm):
    prompt = prompts(1, seed=3, lo=37, hi=38)[0]  # 4 full blocks of 8 + 5 tokens
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids
    # A prompt that is entirely cached (a multiple of the block size) recomputes only its last
    # token, into a copy of the shared last block.
    exact = prompts(1, seed=4, lo=24, hi=25)[0]
    a = llm.generate([exact], GREEDY)[0]
    b = llm.generate([exact], GREEDY)[0]
    assert b.num_cached_tokens == 23 and b.token_ids == a.token_ids


def test_requests_sharing_a_new_prefix_together_compute_it_once(llm):
    # Three prompts opening with the same 4 blocks (32 tokens), none of it cached, submitted at once: the
    # first computes the prefix, the others wait a step for it instead of computing it again.
    rng = random.Random(11)
    shared = [rng.randrange(3, 500) for _ in range(32)]
    batch = [shared + [rng.randrange(3, 500) for _ in range(5 + i)] for i in range(3)]
    waits = llm.engine.scheduler.num_prefix_waits
    together = llm.generate(batch, GREEDY)
    assert [o.num_cached_tokens for o in together] == [0, 32, 32]
    assert llm.engine.scheduler.num_prefix_waits > waits
    llm.engine.kv.clear_prefix_cache()  # alone: each computes the prefix itself
    alone = [llm.generate([p], GREEDY)[0] for p in batch]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_preemption_with_tiny_kv_pool_gives_identical_outputs(tiny, llm):
    batch = prompts(8, seed=5, lo=20, hi=50)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = llm.generate(batch, params)
    small = LLM(str(tiny), **{**ENGINE_ARGS, "num_kv_blocks": 20, "enable_prefix_caching": False})
    got = small.generate(batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert small.engine.preemptions > 0
    assert small.engine.kv.num_free_blocks == 20


def test_random_requests_and_aborts_never_leak_blocks(tiny):
    engine = EngineCore(EngineConfig(model=str(tiny), num_kv_blocks=48, **ENGINE_ARGS), show_progress=False)
    rng = random.Random(7)
    live: list[str] = []
    for i, prompt in enumerate(prompts(200, seed=8, lo=1, hi=70)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 20), seed=i))
        live.append(f"r{i}")
        for _ in range(rng.randrange(0, 3)):
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert all(c == 0 for c in engine.kv.pool.ref_cnt)


def test_seeded_sampling_reproducible_alone_or_in_a_batch(llm):
    batch = prompts(5, seed=9)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(5)]
    together = llm.generate(batch, params)
    alone = llm.generate([batch[2]], params[2])[0]
    assert alone.token_ids == together[2].token_ids
    assert llm.generate([batch[2]], params[2])[0].text == alone.text
    other_seed = llm.generate([batch[2]], params[2].model_copy(update={"seed": 5}))[0]
    assert other_seed.token_ids != alone.token_ids


def test_logprobs_and_stop_strings(llm):
    prompt = prompts(1, seed=10)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 8
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) in (3, 4)
        assert lp[token] == pytest.approx(max(lp.values()))  # greedy picks the most likely token
    stop_at = out.text[2:4]
    if stop_at:
        stopped = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, stop=[stop_at], ignore_eos=True))[0]
        assert stopped.finish_reason == "stop" and stop_at not in stopped.text
        assert out.text.startswith(stopped.text)


def _mixed_run(engine) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts(12, seed=11, lo=1, hi=100)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=10))
    outputs: dict = {}
    run_to_end(engine, "r0", outputs)
    return {rid: o.token_ids for rid, o in outputs.items()}


def test_no_recompilation_after_warmup(tiny):
    engine = EngineCore(EngineConfig(model=str(tiny), warmup=True, background_compile=False, **BUCKETED_ENGINE_ARGS), show_progress=False)
    # 2 token buckets x 2 page buckets, each traced once here or taken from the process's (program_cache.py)
    assert len(engine.runner.compiled_shapes()) == engine.runner.num_traces + engine.runner.num_shared_programs == 4
    traced = engine.runner.num_traces
    _mixed_run(engine)
    assert engine.runner.num_traces == traced


def test_nothing_compiles_after_warmup_when_requests_arrive_mid_decode(tiny, real_compiles):
    """Not a step program, nor the asynchronous step's token merge, nor the expert-load sum: each compiled the
    first time a served engine met it, ~30-100 ms in the middle of decoding (the merge's warm-up placed the
    previous step's tokens on one device, where a step's sampled tokens lie on the mesh: another program)."""
    engine = EngineCore(EngineConfig(model=str(tiny), warmup=True, background_compile=False, **BUCKETED_ENGINE_ARGS), show_progress=False)
    compiled = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12)
        rng = random.Random(5)
        for i, prompt in enumerate(prompts(10, seed=12, lo=2, hi=80)):  # up to 2 prefill chunks, decode buckets 8 and 64
            engine.add_request(f"r{i}", prompt, greedy)
            for _ in range(rng.randrange(0, 4)):  # arrivals between decode steps, as a server's
                engine.step()
        while engine.has_unfinished():
            engine.step()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == []


def test_background_compilation_serves_first_and_ends_with_every_program(tiny):
    """Only the smallest program is compiled before serving; steps needing others compile them (or wait
    for the background thread's); once it is done nothing compiles again, and the tokens are the same."""
    engine = EngineCore(EngineConfig(model=str(tiny), warmup=True, background_compile=True, **BUCKETED_ENGINE_ARGS), show_progress=False)
    assert (8, 4, False, engine.runner.logits_rows_for(8)) in engine.runner._programs  # the smallest, compiled first
    first = _mixed_run(engine)
    assert engine.runner.wait_compiled(timeout=600)
    assert len(engine.runner.compiled_shapes()) == engine.runner.num_traces + engine.runner.num_shared_programs == 4
    traced = engine.runner.num_traces
    foreground = EngineCore(
        EngineConfig(model=str(tiny), warmup=True, background_compile=False, **BUCKETED_ENGINE_ARGS), show_progress=False
    )
    assert first == _mixed_run(foreground)
    _mixed_run(engine)
    assert engine.runner.num_traces == traced


def test_a_process_exiting_while_programs_compile_in_the_background_exits_cleanly(tiny, tmp_path):
    """XLA compiling on the daemon thread while the interpreter tore down crashed 2 of 3 short scripts
    (segfault, or an LLVM abort); the compiler is now stopped at exit."""
    script = (
        "import sys\n"
        "from workers.engine import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1], compilation_cache_dir=sys.argv[2])\n"
        "print(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids)\n"
        "assert llm.engine.runner._background.is_alive(), 'the test needs the compiler still running'\n"
    )
    for attempt in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", script, str(tiny), str(tmp_path / str(attempt))],
            cwd=ROOT,
            env=without_suite_xla_cache(os.environ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_shape_locked_by_another_engine_is_left_for_later(tiny, tmp_path):
    """Engines on one host share compilations: a shape whose lock another holds is skipped by the
    background pass (compiled later, from the persistent cache), and compiled once the lock is free."""
    import fcntl
    import hashlib

    engine = EngineCore(
        EngineConfig(model=str(tiny), **{**ENGINE_ARGS, "warmup": False, "compilation_cache_dir": str(tmp_path)}), show_progress=False
    )
    runner = engine.runner
    shape = (64, 16, False, runner.logits_rows_for(64))
    key = hashlib.sha256(f"{runner._model_key}|{shape}".encode()).hexdigest()[:24]
    (tmp_path / "moray-locks").mkdir(exist_ok=True)
    fd = os.open(tmp_path / "moray-locks" / key, os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert not runner._compile_unless_locked(shape, wait=False)
        assert shape not in runner._programs and shape not in runner._compiling  # nothing claimed
    finally:
        os.close(fd)
    assert runner._compile_unless_locked(shape, wait=False) and shape in runner._programs


def test_kv_events_describe_the_cache(tiny):
    engine = EngineCore(
        EngineConfig(model=str(tiny), num_kv_blocks=17, enable_prefix_caching=True, **{**ENGINE_ARGS, "warmup": False}), show_progress=False
    )
    sub = engine.events.subscribe()
    prompt = prompts(1, seed=12, lo=40, hi=41)[0]
    engine.add_request("a", prompt, GREEDY)
    while engine.has_unfinished():
        engine.step()
    events = sub.drain()
    stored = [e.block_hash for e in events if e.kind is KVEventKind.STORED]
    # The router computes the same hashes from the prompt alone.
    assert stored[:5] == block_hashes(prompt, 8, engine.config.model_name)
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[1].parent_hash == events[0].block_hash
    # Another long request evicts cached blocks: REMOVED events follow, sequence stays gap-free.
    engine.add_request("b", prompts(1, seed=13, lo=120, hi=121)[0], SamplingParams(max_tokens=4, temperature=0))
    while engine.has_unfinished():
        engine.step()
    more = sub.drain()
    assert any(e.kind is KVEventKind.REMOVED for e in more)
    assert [e.seq for e in events + more] == list(range(len(events) + len(more)))
    engine.kv.clear_prefix_cache()
    assert sub.drain()[-1].kind is KVEventKind.CLEARED


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=5), "stop"),
    ],
)
def test_bad_sampling_parameters_raise_value_error(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)


def test_bad_prompts_raise_value_error(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 128], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 512]], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    assert not llm.engine.has_unfinished()  # nothing half-added


def test_generate_cli(tiny):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "cluster.cli", "generate", "--model", str(tiny), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    ok = run("--prompt", "Hello there", "--max-tokens", "5", "--temperature", "0", "--json", "--ignore-eos")
    assert ok.returncode == 0, ok.stderr
    import json

    result = json.loads(ok.stdout)
    assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
    for bad, word in [(["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"), (["--max-tokens", "0"], "max_tokens")]:
        proc = run("--prompt", "hi", *bad)
        assert proc.returncode == 2 and word in proc.stderr and "Traceback" not in proc.stderr
    proc = run("--token-ids", "1,2,99999")
    assert proc.returncode == 2 and "outside the vocabulary" in proc.stderr


def test_token_logprobs_computed_only_when_a_request_wants_them(llm, monkeypatch):
    """The sampler's softmax normaliser over the vocabulary runs only in steps where some request has
    `logprobs` set (0 included: the chosen token's logprob); the logprobs asked for still come back."""
    from workers.engine import engine as engine_module

    calls, real = [], engine_module.sample
    monkeypatch.setattr(engine_module, "sample", lambda *a, **k: calls.append(k["token_logprobs"]) or real(*a, **k))
    prompt = prompts(1, seed=12)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert calls and not any(calls)
    calls.clear()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True))[0]
    assert calls and all(calls)
    assert [list(lp) for lp in out.logprobs] == [[t] for t in out.token_ids] and all(
        lp[t] <= 0 for lp, t in zip(out.logprobs, out.token_ids)
    )
