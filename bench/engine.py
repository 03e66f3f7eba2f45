"""`moray bench engine`: the engine's decode and prefill throughput, its roofline ratio, and transformers
`generate` side by side on the same checkpoint.

What is measured (all greedy, float32 by default, every figure a median over `--runs` runs):
- decode tokens/s at each `--batches` size: B requests with `--prompt-len`-token prompts are prefilled
  (untimed), then `--decode-steps` engine steps are timed, each producing one token per request. The time
  is the wall time of `EngineCore.step()`, i.e. scheduler, input preparation, the device step, sampling
  and output handling: what a serving loop sees.
- prefill tokens/s: one `--prefill-len`-token prompt computed in a single step.
- roofline ratio = measured decode step time / (bytes the step must read / memory bandwidth). The bytes
  are the attention, norm, router and dense-MLP weights, the LM head, one embedding row per token, the
  experts actually selected in each MoE layer (the union over the batch, from the real routing: the
  router is re-run, through the family's own forward, on the hidden states of the generated sequences)
  and the KV read by attention. Hybrid models (Qwen3.5, Qwen3-Next) add their Gated DeltaNet weights
  ("linear_attention") and the per-sequence linear-attention state, read and written once per step
  ("state"); their KV is that of the full-attention layers only. The bandwidth is a large jitted
  reduction, sampled before every decode run because it drifts with the machine's load; each run's
  ratio uses the sample taken just before it.
- sizes: KV bytes per token (full-attention layers, the engine's KV dtype) and linear-attention state
  bytes per sequence, in the JSON of every run; `--sizes-only` prints them for a `config.json`
  (`--config FILE`, `--model DIR`, or `--preset qwen3.5-397b`) without loading any weights.
- peers, on the same checkpoint and prompts with the same thread count, runs alternating with ours
  (`--compare-batches`); decode time is taken between the logits of the first and the last generated
  token:
  - transformers: `generate`;
  - llama.cpp (through llama-cpp-python): the checkpoint written as a float32 GGUF file
    (bench/gguf_export.py, Qwen3-MoE only), the batch's sequences decoded together in one `llama_decode`
    per step, greedy.

Progress goes to stderr; `--json OUT` gets every figure plus the raw samples. The peers' packages are
optional (transformers/torch in the test extras, llama-cpp-python and gguf in the bench extras): they are
imported lazily, and when one is missing its comparison is skipped and the JSON says why. This module imports no jax at import time (it is registered in `cluster.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from bench.report import add_report_argument, int_list, report_if_asked
from bench.sizes import PRESET_CONFIGS

# Targets from the issue, recorded in the JSON next to the measurements.
ROOFLINE_TARGETS = {1: 1.3, 16: 1.6}  # other batches: the largest of these
PEER_TARGETS = {"transformers": {1: 2.0, 16: 2.5}, "llama_cpp": {1: 1.0, 16: 1.2}}  # decode tok/s, ours / theirs
# The bandwidth reduction sums an array into this many partial sums: XLA:CPU runs a reduction to a single
# scalar on one thread (~22 GB/s here), while a few dozen independent row sums use every core (~35 GB/s).
_BANDWIDTH_ROWS = 64


_FILL_STEPS = 8  # at most this many untimed steps fill the asynchronous pipeline before a timed decode run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="checkpoint directory (e.g. make-model --preset bench); required")
    p.add_argument("--json", type=Path, help="where to write the results; required unless --sizes-only")
    p.add_argument("--batches", type=int_list, default=[1, 8, 16, 32], help="decode batch sizes (default 1,8,16,32)")
    p.add_argument("--roofline-batches", type=int_list, default=[1, 16], help="batches with a roofline ratio (default 1,16)")
    p.add_argument("--compare-batches", type=int_list, default=[1, 16], help="batches run with transformers too (default 1,16)")
    p.add_argument("--runs", type=int, default=5, help="alternating timed runs per measurement (default 5)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per run (default 32)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt length for the decode runs (default 64)")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt length for the prefill runs (default 512)")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="array size of the bandwidth reduction (default 1024)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="model and KV dtype (default float32; with --sizes-only the KV dtype, default bfloat16)",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp comparison")
    p.add_argument(
        "--overhead-batches", type=int_list, default=[1, 16, 64], help="batches whose host time per step is measured (default 1,16,64)"
    )
    p.add_argument(
        "--startup",
        action="store_true",
        help="also time engine start-up (default config) in fresh processes: cold (empty compilation cache) and warm",
    )
    p.add_argument("--seed", type=int, default=0)
    add_report_argument(p)
    sizes = p.add_argument_group("sizes only (no weights loaded, nothing timed)")
    sizes.add_argument(
        "--sizes-only",
        action="store_true",
        help="print the KV bytes per token and state bytes per sequence of --model, --config or --preset as JSON",
    )
    sizes.add_argument("--config", type=Path, help="a config.json file (with --sizes-only)")
    sizes.add_argument("--preset", choices=sorted(PRESET_CONFIGS), help="a built-in real model config (with --sizes-only)")


def _log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def rate(nbytes: float, ms: float) -> float:
    """GB/s to three significant digits: a tiny model's parts read well under 0.1 GB/s on a loaded machine,
    where two decimals lost a fifth of the figure."""
    return float(f"{nbytes / ms / 1e6:.3g}")


def _median(xs):
    return statistics.median(xs) if xs else None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(args: argparse.Namespace) -> int:
    if args.sizes_only:
        return run_sizes(args)
    if args.config is not None or args.preset is not None:
        raise ValueError("--config and --preset go with --sizes-only")
    if args.model is None or args.json is None:
        raise ValueError("--model and --json are required (unless --sizes-only)")
    args.dtype = args.dtype or "float32"
    for name in ("runs", "decode_steps", "prompt_len", "prefill_len", "bandwidth_mib"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    missing = sorted(set(args.roofline_batches + args.compare_batches) - set(args.batches))
    if missing:
        raise ValueError(f"--roofline-batches/--compare-batches {missing} must also be in --batches")
    return _Bench(args).run()


def run_sizes(args: argparse.Namespace) -> int:
    """`--sizes-only`: KV and state sizes from a config alone, JSON on stdout (and in --json if given)."""
    from bench.sizes import sizes_from_config

    sources = [x for x in (args.model, args.config, args.preset) if x is not None]
    if len(sources) != 1:
        raise ValueError("--sizes-only takes exactly one of --model, --config, --preset")
    if args.preset is not None:
        raw, source = PRESET_CONFIGS[args.preset], f"preset {args.preset}"
    else:
        from workers.models.config import ModelLoadError

        path = args.config if args.config is not None else args.model / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        source = str(path)
    result = {"source": source, **sizes_from_config(raw, args.dtype or "bfloat16")}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    report_if_asked(args, "engine", result)
    return 0


class _Bench:
    def __init__(self, args: argparse.Namespace):
        import jax
        import numpy as np

        from bench import sizes
        from workers.engine import EngineConfig, EngineCore

        self.args = args
        self.np = np
        self.jax = jax
        self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        max_batch = max(args.batches + args.overhead_batches)
        max_tokens = max(args.prefill_len, max_batch)
        block_size = 16
        # A decode run's sequences grow by the timed steps plus the steps its prefill took (see ours_decode).
        prefill_steps = -(-max_batch * args.prompt_len // max_tokens)
        # (+ the untimed steps that fill the asynchronous pipeline, see ours_decode)
        max_len = max(args.prefill_len, args.prompt_len + args.decode_steps + prefill_steps + 3 + _FILL_STEPS) + block_size
        config = EngineConfig(
            model=str(args.model),
            dtype=args.dtype,
            block_size=block_size,
            max_num_seqs=max_batch,
            max_num_batched_tokens=max_tokens,
            max_model_len=max_len,
            # One bucket per decode batch plus the prefill step; pages use the default powers of two.
            token_buckets=sorted(set(args.batches) | set(args.overhead_batches) | {max_tokens}),
            # Pages for every sequence of the largest batch plus one prefill, with headroom.
            num_kv_blocks=(max_batch + 2) * -(-max_len // block_size) + 8,
            warmup=False,  # programs compile on first use: the untimed first round reports that time
            compilation_cache_dir=None,
        )
        _log(f"loading {args.model} ({args.dtype})")
        start = time.perf_counter()
        self.engine = EngineCore(config, show_progress=False)
        self.load_s = time.perf_counter() - start
        self.model = self.engine.model
        self.cfg = self.model.cfg
        # The engine's KV pages are in the model dtype; state pools are float32 (workers/engine/runner.py).
        self.kv_dtype = jax.numpy.dtype(self.model.dtype).name
        self.kv_bytes_per_token = sizes.kv_bytes_per_token(self.cfg, jax.numpy.dtype(self.model.dtype).itemsize)
        self.state_bytes_per_sequence = sizes.state_bytes_per_sequence(self.cfg)
        runner = self.engine.runner
        if (self.kv_bytes_per_token * runner.block_size, self.state_bytes_per_sequence) != (
            runner.kv_bytes_per_block,
            runner.state_bytes_per_slot,
        ):
            raise RuntimeError(
                f"bench sizes disagree with the engine's: KV {self.kv_bytes_per_token} B/token x {runner.block_size} "
                f"vs {runner.kv_bytes_per_block} B/block, state {self.state_bytes_per_sequence} vs "
                f"{runner.state_bytes_per_slot} B/slot"
            )
        self.rng = np.random.default_rng(args.seed)
        self._ids = 0
        self._bandwidth_fn = None
        self._routing_fn = None

    # ------------------------------------------------------------------ prompts and our engine

    def prompts(self, batch: int, length: int) -> list[list[int]]:
        # Token ids 3.. avoid the usual special ids; every prompt is new, so the prefix cache never hits.
        high = self.cfg.vocab_size
        return self.rng.integers(min(3, high - 1), high, (batch, length)).tolist()

    def ours_decode(self, prompts: list[list[int]], steps: int) -> dict:
        """Prefills `prompts`, then times `steps` engine steps that each decode one token per request.

        A batch whose prompts need several prefill steps starts decoding unevenly (continuous batching),
        so requests get enough max_tokens to all still be running through the timed steps, and whatever
        is left is aborted afterwards. Records, per timed step, each sequence's position (the router replay
        for the roofline needs it) and the keys attention reads.
        """
        from workers.engine import SamplingParams

        budget = self.engine.config.max_num_batched_tokens
        prefill_steps = -(-sum(len(p) for p in prompts) // budget)
        params = SamplingParams(temperature=0.0, max_tokens=steps + prefill_steps + 2 + _FILL_STEPS, ignore_eos=True)
        ids = []
        for p in prompts:
            self._ids += 1
            ids.append(f"bench-{self._ids}")
            self.engine.add_request(ids[-1], p, params)
        requests = [self.engine.scheduler.requests[rid] for rid in ids]
        outputs = {rid: [] for rid in ids}
        # Prefill (untimed): step until every request has its first token.
        while any(not toks for toks in outputs.values()):
            for out in self.engine.step():
                outputs[out.request_id].extend(out.token_ids)
        # With asynchronous scheduling a step's tokens come back from the next call: step until one call
        # returns a token for every request (the pipeline full), so that each timed step is a whole batch.
        for _ in range(_FILL_STEPS):
            outs = self.engine.step()
            for out in outs:
                outputs[out.request_id].extend(out.token_ids)
            if sum(len(o.token_ids) for o in outs) == len(prompts):
                break
        step_s, positions, keys = [], [], []
        for _ in range(steps):
            # Each request feeds its newest token (position num_tokens - 1) and attends over num_tokens keys
            # (counting the token a step in flight is sampling, with asynchronous scheduling).
            positions.append([r.num_scheduled_tokens - 1 for r in requests])
            keys.append(sum(r.num_scheduled_tokens for r in requests))
            start = time.perf_counter()
            outs = self.engine.step()
            step_s.append(time.perf_counter() - start)
            new = 0
            for out in outs:
                outputs[out.request_id].extend(out.token_ids)
                new += len(out.token_ids)
            if new != len(prompts):
                raise RuntimeError(
                    f"a timed decode step produced {new} tokens for a batch of {len(prompts)} (preemptions {self.engine.preemptions}, running {len(self.engine.scheduler.running)}, waiting {len(self.engine.scheduler.waiting)}, free {self.engine.kv.num_free_blocks})"
                )
        for rid in ids:
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()
        return {
            "tokens_per_s": len(prompts) * steps / sum(step_s),
            "step_ms": 1e3 * sum(step_s) / len(step_s),
            "step_ms_samples": [round(1e3 * s, 3) for s in step_s],
            "outputs": [outputs[rid] for rid in ids],
            "positions": positions,  # [steps][batch]
            "mean_keys": sum(keys) / len(keys),  # per step, summed over the batch
        }

    def ours_prefill(self, prompt: list[int]) -> float:
        from workers.engine import SamplingParams

        self._ids += 1
        start = time.perf_counter()
        self.engine.add_request(f"bench-{self._ids}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while self.engine.has_unfinished():
            self.engine.step()
        return len(prompt) / (time.perf_counter() - start)

    def step_split(self, batch: int) -> dict:
        """Host time per decode step: the step with asynchronous scheduling (the default), the step waiting
        for each device step (sync), and the device step alone (timed to completion in the sync run).
        host_ms: the host's whole work per step; host_not_hidden_ms: what of it the async step still adds.
        --runs pairs of an asynchronous and a synchronous run, alternating which goes first; each figure is
        the median over the pairs (one pair measured the machine's drift: at batch 64 an asynchronous run
        came out 76 ms a step slower than the synchronous one beside it with 6.5 ms of host work; five pairs
        of a later run ranged from 68 ms faster to 25 ms slower)."""
        runner, config = self.engine.runner, self.engine.config
        original = runner.run
        device_s = []

        def timed_run(inputs):
            start = time.perf_counter()
            logits = self.jax.block_until_ready(original(inputs))
            device_s.append(time.perf_counter() - start)
            return logits

        def decode(asynchronous: bool) -> dict:
            if not asynchronous:
                runner.run, config.async_scheduling = timed_run, False
            try:
                return self.ours_decode(self.prompts(batch, self.args.prompt_len), self.args.decode_steps)
            finally:
                runner.run, config.async_scheduling = original, True

        pairs = []
        for r in range(max(1, self.args.runs)):
            runs = {}
            for asynchronous in (True, False) if r % 2 == 0 else (False, True):
                runs[asynchronous] = _median(decode(asynchronous)["step_ms_samples"])
            device_ms = 1e3 * _median(device_s[-self.args.decode_steps :])
            pairs.append({"step_ms": runs[True], "sync_step_ms": runs[False], "device_ms": device_ms})
        step_ms, sync_ms, device_ms = (_median([p[k] for p in pairs]) for k in ("step_ms", "sync_step_ms", "device_ms"))
        return {
            "step_ms": round(step_ms, 3),
            "sync_step_ms": round(sync_ms, 3),
            "device_ms": round(device_ms, 3),
            "host_ms": round(sync_ms - device_ms, 3),
            "host_not_hidden_ms": round(_median([max(0.0, p["step_ms"] - p["device_ms"]) for p in pairs]), 3),
            "pairs": [{k: round(v, 3) for k, v in p.items()} for p in pairs],
        }

    def startup(self) -> dict:
        """Seconds from a fresh process to an engine ready to serve (the default warm-up: the smallest step
        program, the rest in the background) and to every program compiled: cold (empty compilation
        cache), then warm (the cache the cold run filled)."""
        import subprocess
        import sys
        import tempfile

        script = (
            "import json, sys, time; t0 = time.perf_counter()\n"
            "from workers.engine import EngineConfig, EngineCore\n"
            "core = EngineCore(EngineConfig(model=sys.argv[1], dtype=sys.argv[2], compilation_cache_dir=sys.argv[3]), show_progress=False)\n"
            "ready = time.perf_counter() - t0; core.runner.wait_compiled()\n"
            "print(json.dumps({'ready_s': round(ready, 2), 'all_compiled_s': round(time.perf_counter() - t0, 2), "
            "'programs': len(core.runner.step_shapes())}))\n"
        )
        out = {}
        with tempfile.TemporaryDirectory(prefix="moray-startup-") as cache:
            for kind in ("cold", "warm"):
                _log(f"start-up ({kind})")
                proc = subprocess.run(
                    [sys.executable, "-c", script, str(self.args.model), self.args.dtype, cache],
                    capture_output=True,
                    text=True,
                    cwd=Path(__file__).resolve().parent.parent,
                )
                if proc.returncode:
                    raise RuntimeError(f"start-up run failed: {proc.stderr[-2000:]}")
                out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
                _log(f"start-up ({kind}): {out[kind]}")
        return out

    # ------------------------------------------------------------------ bandwidth

    def bandwidth(self) -> float:
        """GB/s of a jitted reduction over --bandwidth-mib MiB (median of 3 calls)."""
        jax, jnp = self.jax, self.jax.numpy
        if self._bandwidth_fn is None:
            n = (self.args.bandwidth_mib << 20) // 4
            n -= n % _BANDWIDTH_ROWS
            self._bandwidth_x = jnp.ones((n,), jnp.float32)
            self._bandwidth_fn = jax.jit(lambda a: jnp.sum(a.reshape(_BANDWIDTH_ROWS, -1), axis=1))
            self._bandwidth_fn(self._bandwidth_x).block_until_ready()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            self._bandwidth_fn(self._bandwidth_x).block_until_ready()
            times.append(time.perf_counter() - start)
        return self._bandwidth_x.nbytes / statistics.median(times) / 1e9

    def parts(self, batch: int) -> dict:
        """The decode step's weight reads part by part, each timed alone over every layer (so the weights
        come from memory, as in a step) with the kernels the engine selects and with XLA alone, alternating:
        {part: {bytes, ms, gb_per_s, xla_ms, xla_gb_per_s}} (medians of --runs x 5 calls). The experts get
        a random top-k routing of `batch` tokens; "attention" is the q/k/v and output projections."""
        import jax
        import jax.numpy as jnp

        from kernels import dense, moe
        from workers.models.layers import MoEWeights

        cfg, weights, rng = self.cfg, self.model.weights, self.np.random.default_rng(self.args.seed)
        h = cfg.hidden_size
        x = jnp.asarray(rng.standard_normal((batch, h), self.np.float32) * 0.1, self.model.dtype)
        head = weights.embed if weights.lm_head is None else weights.lm_head
        attn = [lw.attn for lw in weights.layers if hasattr(lw.attn, "qkv") and hasattr(lw.attn, "o")]
        moes = [lw.mlp for lw in weights.layers if isinstance(lw.mlp, MoEWeights)]
        k = cfg.num_experts_per_tok
        logits = rng.standard_normal((batch, max(1, cfg.num_experts)), self.np.float32)
        ids = jnp.asarray(self.np.argsort(-logits, axis=-1)[:, :k], jnp.int32)
        routing = jnp.full((batch, k), 1.0 / max(1, k), jnp.float32)
        used = len(set(self.np.asarray(ids).ravel().tolist()))

        def lm_head(x, head):
            return dense.matmul(x, head)

        def attention(x, attn):
            out = x
            for a in attn:  # each layer's q/k/v, then the output projection of a q-sized input
                qkv = dense.matmul(out, a.qkv)
                out = out + dense.matmul(qkv[:, : a.o.shape[1]].astype(x.dtype), a.o).astype(x.dtype)
            return out

        def experts(x, ids, routing, moes, impl):
            out = x
            for m in moes:
                out = out + moe.routed_experts(out, ids, routing, m.gate_up, m.down, impl=impl)
            return out

        def nbytes(tree):
            return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

        cases = {"lm_head": (lm_head, (x, head), nbytes(head))}
        if attn:
            cases["attention"] = (attention, (x, attn), nbytes([(a.qkv, a.o) for a in attn]))
        if moes:
            per_expert = nbytes((moes[0].gate_up, moes[0].down)) / moes[0].gate_up.shape[0]
            cases["experts"] = (
                lambda x, ids, routing, moes, impl: experts(x, ids, routing, moes, impl),
                (x, ids, routing, moes),
                int(per_expert * used * len(moes)),
            )

        def program(name, fn, kernels: bool):
            if name == "experts":  # the engine's own choice (None) against the portable `gather` loop
                impl = None if kernels else "gather"
                return jax.jit(lambda *a: fn(*a, impl))

            def scoped(*a):
                with dense.single_device(kernels):
                    return fn(*a)

            return jax.jit(scoped)

        def timed(f, args) -> float:
            times = []
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(f(*args))
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        out = {}
        for name, (fn, args, size) in cases.items():
            ours, xla = program(name, fn, True), program(name, fn, False)
            jax.block_until_ready((ours(*args), xla(*args)))  # compiles
            samples = {"ours": [], "xla": []}
            for r in range(self.args.runs):
                order = (("ours", ours), ("xla", xla)) if r % 2 == 0 else (("xla", xla), ("ours", ours))
                for key, f in order:
                    samples[key].append(timed(f, args))
            ms, xla_ms = 1e3 * _median(samples["ours"]), 1e3 * _median(samples["xla"])
            out[name] = {
                **({"impl": moe.chosen_impl(x, ids, moes[0].gate_up)} if name == "experts" else {}),
                "bytes": int(size),
                "ms": round(ms, 4),
                "gb_per_s": rate(size, ms),
                "xla_ms": round(xla_ms, 4),
                "xla_gb_per_s": rate(size, xla_ms),
            }
        return out

    # ------------------------------------------------------------------ bytes a decode step must read

    def routed_experts_per_layer(self, prompts, decode: dict) -> list[float]:
        """Mean over the timed decode steps of the number of distinct experts the batch selects, per MoE layer.

        The router is re-run on the real hidden states: a contiguous forward over each prompt and its
        generated tokens records every MoE layer's top-k ids, read at the position each sequence fed in
        each timed step. The forward is the family's own (its routing, and for hybrid models its
        linear-attention layers over the contiguous cache's state), with an `experts` executor that
        records the ids it is handed before running the experts as usual.
        """
        jax, jnp, np = self.jax, self.jax.numpy, self.np
        from kernels.moe import routed_experts

        cfg = self.cfg
        if not any(cfg.moe_layers):
            return []
        positions = np.asarray(decode["positions"])  # [steps, B]
        length = int(positions.max()) + 1
        seqs = np.zeros((len(prompts), length), np.int32)  # padding after a sequence's end is never read
        for i, (p, o) in enumerate(zip(prompts, decode["outputs"])):
            tokens = (p + o)[:length]
            seqs[i, : len(tokens)] = tokens
        pos = np.broadcast_to(np.arange(length, dtype=np.int32), seqs.shape)

        if self._routing_fn is None:  # one jitted function: it compiles once per (batch, length)
            family, inner = self.model.family, self.model.experts or routed_experts

            def forward(weights, tokens, positions, cache):
                recorded = []

                def experts(x, ids, *args, **kwargs):  # x [B*T, hidden], ids [B*T, k], in layer order
                    recorded.append(ids.reshape(*tokens.shape, -1))
                    return inner(x, ids, *args, **kwargs)

                family.forward(weights, cfg, tokens, positions, cache, experts=experts)
                return jnp.stack(recorded)  # [moe layers, B, T, k]

            self._routing_fn = jax.jit(forward)
        cache = self.model.new_cache(seqs.shape[0], seqs.shape[1])
        ids = np.asarray(self._routing_fn(self.model.weights, seqs, pos, cache))
        rows = np.arange(len(prompts))
        return [float(np.mean([len(np.unique(layer[rows, step_pos])) for step_pos in positions])) for layer in ids]

    def step_bytes(self, batch: int, experts_per_layer: list[float], mean_keys: float) -> dict:
        """Bytes one decode step of `batch` sequences must move, by kind (experts from the real routing):
        everything it reads, plus the linear-attention state it writes back."""
        import jax

        from workers.models.layers import MoEWeights

        cfg, weights = self.cfg, self.model.weights
        nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
        kinds = ("attention", "linear_attention", "norms", "dense_mlp", "router", "shared_expert", "experts")
        out = dict.fromkeys(kinds, 0)
        moe_index = 0
        for layer, lw in enumerate(weights.layers):
            # The token mixer: Gated DeltaNet on a hybrid model's linear layers, else attention.
            out["linear_attention" if cfg.is_linear_layer(layer) else "attention"] += nbytes(lw.attn)
            out["norms"] += nbytes((lw.input_norm, lw.post_attn_norm))
            if isinstance(lw.mlp, MoEWeights):
                mlp = lw.mlp
                out["router"] += nbytes(mlp.router)
                out["shared_expert"] += nbytes((mlp.shared, mlp.shared_gate))
                per_expert = (nbytes(mlp.gate_up) + nbytes(mlp.down)) / mlp.gate_up.shape[0]
                out["experts"] += experts_per_layer[moe_index] * per_expert
                moe_index += 1
            else:
                out["dense_mlp"] += nbytes(lw.mlp)
        out["norms"] += nbytes(weights.final_norm)
        head = weights.embed if weights.lm_head is None else weights.lm_head
        out["lm_head"] = nbytes(head)
        out["embedding"] = batch * cfg.hidden_size * weights.embed.dtype.itemsize
        # Attention reads every key of every sequence (mean_keys: summed over the batch, per step), in
        # the full-attention layers only: a hybrid model's linear layers keep no KV.
        out["kv"] = mean_keys * self.kv_bytes_per_token
        # Linear-attention layers: each sequence's conv and recurrent state (float32) is read and then
        # overwritten in place, every step: the delta rule (S <- g S; S <- S + k (beta (v - S^T k))^T per
        # value head) needs all of S and produces a whole new S, and the conv window shifts by one token.
        # Unlike weights and KV, which a decode step only reads, the state costs its size twice.
        # (A snapshot for prefix caching, written when a sequence crosses a block boundary, adds one more
        # write per block_size steps; that is left out.)
        out["state"] = 2 * self.state_bytes_per_sequence * batch
        out = {k: int(round(v)) for k, v in out.items()}
        out["total"] = sum(out.values())
        return out

    # ------------------------------------------------------------------ the whole benchmark

    def expert_loads(self) -> dict | None:
        """Tokens routed per expert over the whole run (every step the bench ran), as the engine counts them:
        per MoE layer the busiest expert and EP rank against the mean (experts split contiguously over the
        ranks); None for a dense model."""
        import numpy as np

        from workers.engine.runner import rank_imbalance

        if not any(self.engine.cfg.moe_layers):
            return None
        loads = self.engine.runner.read_expert_loads()
        ep = getattr(self.engine.model.experts, "ep_size", 1)
        per_rank = loads.reshape(loads.shape[0], ep, -1).sum(-1)
        mean = lambda a: np.maximum(a.mean(1), 1e-9)  # noqa: E731
        return {
            "routed_tokens": int(loads.sum()),
            "ep_size": ep,
            "rank_max_over_mean": rank_imbalance(loads, ep),
            "per_layer": {
                "expert_max_over_mean": (loads.max(1) / mean(loads)).round(3).tolist(),
                "rank_max_over_mean": (per_rank.max(1) / mean(per_rank)).round(3).tolist(),
            },
        }

    def run(self) -> int:
        args = self.args

        peers, peer_status = self.load_peers()
        load_start = _loadavg()
        decode = {b: [] for b in args.batches}
        peer_decode = {name: {b: [] for b in args.compare_batches} for name in peers}
        ratio_samples = {b: [] for b in args.roofline_batches}
        experts = {b: [] for b in args.roofline_batches}
        bytes_by_batch = {}
        bandwidth, prefill, warmup_s = [], [], {}
        peer_prefill = []  # llama.cpp's prefill tokens/s, beside ours

        _log(f"warm-up round (compiles the step programs; {self.threads} threads)")
        for b in args.batches:
            start = time.perf_counter()
            self.ours_decode(self.prompts(b, args.prompt_len), min(args.decode_steps, 2))
            warmup_s[b] = round(time.perf_counter() - start, 2)
            for peer in peers.values() if b in args.compare_batches else ():
                peer.decode(self.prompts(b, args.prompt_len), min(args.decode_steps, 2))
        start = time.perf_counter()
        self.ours_prefill(self.prompts(1, args.prefill_len)[0])
        warmup_s["prefill"] = round(time.perf_counter() - start, 2)
        bandwidth_first = self.bandwidth()
        _log(f"warm-up took {warmup_s}; bandwidth {bandwidth_first:.1f} GB/s")

        for r in range(args.runs):
            for b in args.batches:
                prompts = self.prompts(b, args.prompt_len)
                bw = self.bandwidth()
                bandwidth.append(bw)
                # Alternate which engine goes first so that slow drifts hit all equally.
                compared = peers if b in args.compare_batches else {}
                peer_res = {}
                if r % 2:
                    peer_res = {name: peer.decode(prompts, args.decode_steps) for name, peer in compared.items()}
                res = self.ours_decode(prompts, args.decode_steps)
                if not r % 2:
                    peer_res = {name: peer.decode(prompts, args.decode_steps) for name, peer in compared.items()}
                decode[b].append(res)
                msg = f"run {r + 1}/{args.runs} B={b}: ours {res['tokens_per_s']:.1f} tok/s ({res['step_ms']:.1f} ms/step)"
                for name, pres in peer_res.items():
                    peer_decode[name][b].append(pres)
                    msg += f", {name} {pres['tokens_per_s']:.1f} tok/s"
                if b in args.roofline_batches:
                    per_layer = self.routed_experts_per_layer(prompts, res)
                    experts[b].append(per_layer)
                    step_bytes = self.step_bytes(b, per_layer, res["mean_keys"])
                    bytes_by_batch.setdefault(b, []).append(step_bytes)
                    ratio = res["step_ms"] / 1e3 / (step_bytes["total"] / (bw * 1e9))
                    ratio_samples[b].append(ratio)
                    msg += f", roofline ratio {ratio:.2f} ({step_bytes['total'] / 2**20:.0f} MiB at {bw:.1f} GB/s)"
                _log(msg)
            prompt = self.prompts(1, args.prefill_len)[0]
            prefill.append(self.ours_prefill(prompt))
            msg = f"run {r + 1}/{args.runs} prefill {args.prefill_len} tokens: {prefill[-1]:.1f} tok/s"
            if "llama_cpp" in peers:  # the same prompt, one llama_decode over all of it
                peer_prefill.append(peers["llama_cpp"].prefill(prompt))
                msg += f", llama_cpp {peer_prefill[-1]:.1f} tok/s"
            _log(msg)

        parts = {}
        for b in args.roofline_batches:
            parts[str(b)] = self.parts(b)
            _log(
                f"B={b} parts (ours vs XLA alone): "
                + ", ".join(
                    f"{k}{' (' + v['impl'] + ')' if 'impl' in v else ''} {v['gb_per_s']:.1f} vs {v['xla_gb_per_s']:.1f} GB/s"
                    for k, v in parts[str(b)].items()
                )
            )

        split = {}
        for b in sorted(set(args.roofline_batches) | set(args.overhead_batches)):
            split[b] = self.step_split(b)
            _log(f"B={b} step split: {split[b]}")

        for peer in peers.values():
            peer.close()
        result = self._result(decode, peer_decode, peer_status, ratio_samples, experts, bytes_by_batch, bandwidth, prefill, warmup_s, split)
        result["host_overhead"] = {str(b): split[b] for b in sorted(split)}
        result["parts"] = parts
        if peer_prefill:
            result["llama_cpp"]["prefill"] = {
                "prompt_len": args.prefill_len,
                "tokens_per_s": _median(peer_prefill),
                "samples_tokens_per_s": [round(x, 3) for x in peer_prefill],
            }
        result["expert_loads"] = self.expert_loads()
        if args.startup:
            result["startup"] = self.startup()
        result["load_average"] = {"start": load_start, "end": _loadavg()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        _log(f"wrote {args.json}")
        _log(_summary(result))
        report_if_asked(args, "engine", result)
        return 0

    def load_peers(self) -> tuple[dict, dict]:
        """({name: runner} of the peers that loaded, {name: status} of every peer, with the reason
        for a skipped one)."""
        args = self.args
        loaders = {
            "transformers": None if args.no_transformers else lambda: _load_transformers(args.model, args.dtype, self.threads),
            "llama_cpp": None if args.no_llama_cpp else lambda: _load_llama_cpp(args, self.threads),
        }
        peers, status = {}, {}
        for name, load in loaders.items():
            if load is None:
                status[name] = {"available": False, "reason": f"skipped (--no-{name.replace('_', '-')})"}
                continue
            runner, status[name] = load()
            if runner is None:
                _log(f"{name} comparison skipped: {status[name]['reason']}")
            else:
                peers[name] = runner
        return peers, status

    def _result(self, decode, peer_decode, peer_status, ratio_samples, experts, bytes_by_batch, bandwidth, prefill, warmup_s, split):
        args, np = self.args, self.np
        import jax
        import jaxlib

        from bench import sizes

        def table(runs):
            return {
                "tokens_per_s": _median([x["tokens_per_s"] for x in runs]),
                "step_ms": _median([x["step_ms"] for x in runs]),
                "samples_tokens_per_s": [round(x["tokens_per_s"], 3) for x in runs],
                "samples_step_ms": [round(x["step_ms"], 3) for x in runs],
                "step_ms_per_run": [x["step_ms_samples"] for x in runs],
            }

        bw_median = _median(bandwidth)
        roofline = {}
        for b in args.roofline_batches:
            mean_bytes = {k: int(np.mean([x[k] for x in bytes_by_batch[b]])) for k in bytes_by_batch[b][0]}
            step_ms = _median([x["step_ms"] for x in decode[b]])
            roofline[str(b)] = {
                "ratio": _median(ratio_samples[b]),
                "ratio_samples": [round(x, 4) for x in ratio_samples[b]],
                "measured_step_ms": step_ms,
                "roofline_step_ms": 1e3 * mean_bytes["total"] / (bw_median * 1e9),
                "bytes": mean_bytes,
                "bytes_per_run": bytes_by_batch[b],
                "experts_per_layer": [round(float(x), 3) for x in np.mean(experts[b], axis=0)] if experts[b] and experts[b][0] else [],
                "experts_per_layer_per_run": experts[b],
                "step_split": split.get(b),
            }

        peers_out = {}
        for name, status in peer_status.items():
            out = peers_out[name] = dict(status)
            if name not in peer_decode:
                continue
            out["decode"] = {str(b): table(runs) for b, runs in peer_decode[name].items()}
            out["ratio"], out["paired_ratio_samples"] = {}, {}
            for b, runs in peer_decode[name].items():
                ours = _median([x["tokens_per_s"] for x in decode[b]])
                out["ratio"][str(b)] = ours / _median([x["tokens_per_s"] for x in runs])
                out["paired_ratio_samples"][str(b)] = [round(o["tokens_per_s"] / t["tokens_per_s"], 4) for o, t in zip(decode[b], runs)]

        met = {f"roofline_ratio_b{b}": roofline[str(b)]["ratio"] <= _roofline_target(b) for b in args.roofline_batches}
        for name, targets in PEER_TARGETS.items():
            for b, target in targets.items():
                if str(b) in peers_out[name].get("ratio", {}):
                    met[f"{name}_ratio_b{b}"] = peers_out[name]["ratio"][str(b)] >= target
        cfg = self.cfg
        return {
            "benchmark": "engine",
            "model": str(args.model),
            "model_config": {
                "model_type": cfg.model_type,
                "num_layers": cfg.num_layers,
                "hidden_size": cfg.hidden_size,
                "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "vocab_size": cfg.vocab_size,
                "weight_bytes": self.model.weight_bytes,
            },
            "layers": sizes.layer_summary(cfg),
            "kv_dtype": self.kv_dtype,
            # K and V of one token over every full-attention layer, in the engine's KV dtype.
            "kv_bytes_per_token": self.kv_bytes_per_token,
            # float32 conv + recurrent state of one sequence over every linear-attention layer (0: none).
            "state_bytes_per_sequence": self.state_bytes_per_sequence,
            "dtype": args.dtype,
            "threads": self.threads,
            "versions": {
                "python": platform.python_version(),
                "jax": jax.__version__,
                "jaxlib": jaxlib.__version__,
                "numpy": np.__version__,
                "transformers": peer_status["transformers"].get("transformers_version"),
                "torch": peer_status["transformers"].get("torch_version"),
                "llama_cpp_python": peer_status["llama_cpp"].get("llama_cpp_python_version"),
            },
            "settings": {
                "runs": args.runs,
                "decode_steps": args.decode_steps,
                "prompt_len": args.prompt_len,
                "prefill_len": args.prefill_len,
                "batches": args.batches,
                "roofline_batches": args.roofline_batches,
                "compare_batches": args.compare_batches,
                "bandwidth_bytes": int(self._bandwidth_x.nbytes),
                "bandwidth_method": f"jitted sum of a float32 array into {_BANDWIDTH_ROWS} row sums, median of 3 calls",
                "seed": args.seed,
            },
            "load_s": round(self.load_s, 2),
            "warmup_s": {str(k): v for k, v in warmup_s.items()},
            "decode": {str(b): table(runs) for b, runs in decode.items()},
            "prefill": {
                "prompt_len": args.prefill_len,
                "tokens_per_s": _median(prefill),
                "samples_tokens_per_s": [round(x, 3) for x in prefill],
            },
            "bandwidth": {"gb_per_s": bw_median, "samples_gb_per_s": [round(x, 3) for x in bandwidth]},
            "roofline": roofline,
            **peers_out,
            "targets": {
                "roofline_ratio_max": {str(b): _roofline_target(b) for b in args.roofline_batches},
                **{f"{name}_ratio_min": {str(b): t for b, t in targets.items()} for name, targets in PEER_TARGETS.items()},
                "met": met,
            },
        }


def _roofline_target(batch: int) -> float:
    return ROOFLINE_TARGETS.get(batch, max(ROOFLINE_TARGETS.values()))


def _summary(result: dict) -> str:
    parts = ["decode tok/s " + ", ".join(f"B={b}: {v['tokens_per_s']:.1f}" for b, v in result["decode"].items())]
    parts.append(f"prefill {result['prefill']['tokens_per_s']:.1f} tok/s")
    parts.append("roofline " + ", ".join(f"B={b}: {v['ratio']:.2f}" for b, v in result["roofline"].items()))
    for name in PEER_TARGETS:
        if "ratio" in result[name]:
            parts.append(f"vs {name} " + ", ".join(f"B={b}: {v:.2f}x" for b, v in result[name]["ratio"].items()))
    if result.get("host_overhead"):
        parts.append(
            "host not hidden ms/step "
            + ", ".join(f"B={b}: {v['host_not_hidden_ms']:.2f} (of {v['host_ms']:.2f})" for b, v in result["host_overhead"].items())
        )
    parts.append(f"bandwidth {result['bandwidth']['gb_per_s']:.1f} GB/s")
    parts.append(f"KV {result['kv_bytes_per_token']} B/token")
    if result["state_bytes_per_sequence"]:
        parts.append(f"state {result['state_bytes_per_sequence'] / 2**20:.2f} MiB/sequence")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# transformers side


def _load_transformers(model_dir: Path, dtype: str, threads: int):
    """(runner, status) or (None, status with the reason) when transformers/torch are not installed."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return None, {"available": False, "reason": f"transformers/torch not installed ({e}); pip install 'moray[test]'"}
    torch.set_num_threads(threads)
    _log(f"loading transformers {transformers.__version__} model ({threads} threads)")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    status = {
        "available": True,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    return _HFRunner(model, torch, transformers), status


class _HFRunner:
    def __init__(self, model, torch, transformers):
        self.model, self.torch = model, torch

        class Clock(transformers.LogitsProcessor):
            """Timestamps each generation step (called once per forward, after its logits)."""

            def __init__(self):
                self.times = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        self.Clock = Clock

    def close(self) -> None:
        self.model = None

    def decode(self, prompts: list[list[int]], steps: int) -> dict:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        clock = self.Clock()
        with torch.inference_mode():
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=steps + 1,
                min_new_tokens=steps + 1,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[clock],
            )
        # times[0] follows the prefill forward; each later one follows a one-token decode forward.
        step_s = [b - a for a, b in zip(clock.times, clock.times[1:])]
        return {
            "tokens_per_s": len(prompts) * len(step_s) / sum(step_s),
            "step_ms": 1e3 * sum(step_s) / len(step_s),
            "step_ms_samples": [round(1e3 * s, 3) for s in step_s],
        }


# ---------------------------------------------------------------------------------------------
# llama.cpp side


def _load_llama_cpp(args: argparse.Namespace, threads: int):
    """(runner, status) or (None, status with the reason): llama-cpp-python or gguf missing, or a model
    the GGUF export does not cover."""
    if args.dtype != "float32":
        return None, {"available": False, "reason": f"the GGUF export writes float32 only, not {args.dtype}"}
    try:
        import llama_cpp
    except ImportError as e:
        return None, {"available": False, "reason": f"llama-cpp-python not installed ({e}); pip install 'moray[bench]'"}
    import tempfile

    from bench.gguf_export import export_gguf

    tmp = tempfile.TemporaryDirectory(prefix="moray-gguf-")
    _log("writing the checkpoint as GGUF float32 for llama.cpp")
    try:
        path = export_gguf(args.model, Path(tmp.name) / "model.gguf")
    except ValueError as e:
        tmp.cleanup()
        return None, {"available": False, "reason": str(e)}
    max_batch = max(args.compare_batches)
    max_len = max(args.prompt_len + args.decode_steps, args.prefill_len) + 8  # decode runs, or one prefill
    runner = _LlamaCppRunner(llama_cpp, path, threads, max_batch, max_len, tmp)
    status = {
        "available": True,
        "llama_cpp_python_version": llama_cpp.__version__,
        "threads": threads,
        "gguf_bytes": path.stat().st_size,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
    }
    return runner, status


class _LlamaCppRunner:
    """Greedy batched decode through llama.cpp's C API: one sequence per request, every step one
    `llama_decode` over the batch's next tokens (as llama.cpp's batched example and server do)."""

    def __init__(self, lib, path: Path, threads: int, max_batch: int, max_len: int, tmp):
        import ctypes

        self.lib, self.tmp = lib, tmp
        # llama.cpp logs every load detail to stderr; keep the benchmark's progress readable.
        self._quiet = lib.llama_log_callback(lambda level, text, data: None)
        lib.llama_log_set(self._quiet, ctypes.c_void_p())
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_seq_max = max_batch
        params.n_ctx = max_batch * (-(-max_len // 256) * 256)
        params.n_batch = params.n_ubatch = max(max_batch * max_len, 512)
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(params.n_batch, 0, max_batch)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """tokens: (token, position, sequence, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, index: int) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.vocab,))
        return int(logits.argmax())

    def decode(self, prompts: list[list[int]], steps: int) -> dict:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        prefill = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        self._decode(prefill)
        last = [i for i, x in enumerate(prefill) if x[3]]
        generated = [[self._argmax(i)] for i in last]
        positions = [len(p) for p in prompts]
        times = [time.perf_counter()]
        for _ in range(steps):
            self._decode([(seq[-1], positions[s], s, True) for s, seq in enumerate(generated)])
            for i, seq in enumerate(generated):
                seq.append(self._argmax(i))
            positions = [p + 1 for p in positions]
            times.append(time.perf_counter())
        step_s = [b - a for a, b in zip(times, times[1:])]
        return {
            "tokens_per_s": len(prompts) * steps / sum(step_s),
            "step_ms": 1e3 * sum(step_s) / steps,
            "step_ms_samples": [round(1e3 * s, 3) for s in step_s],
            "tokens": generated,  # greedy, steps + 1 per prompt
        }

    def prefill(self, prompt: list[int]) -> float:
        """Tokens/s of one sequence's prompt in one llama_decode (logits for its last token only)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        start = time.perf_counter()
        self._decode([(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
        self._argmax(len(prompt) - 1)
        return len(prompt) / (time.perf_counter() - start)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)
        self.tmp.cleanup()
