"""`moray bench eplb`: expert load balance per EP rank under skewed routing, without and with rebalancing.

A routing bias (bench only: `MoEWeights.routing_bias`, added to the softmax router's logits) makes each MoE
layer's expert loads follow a Zipf law over a random order of the experts; `--drift-at` re-draws that order
part-way (the hot experts move). Two engines on the same mesh (default 2x4 virtual CPU devices, expert
parallel over all 8) decode the same batch of streams step for step: one as loaded, one with
`eplb.num_redundant_experts` spare slots re-placed every `--period` steps (default: one window).

Per window of `--window-steps` steps: tokens per EP rank counted by the engines themselves (physical slots,
`ModelRunner.read_expert_loads`), the worst layer's max/mean over the ranks, the routed tokens, and the
median step time (reported only: 8 virtual devices on a few cores measure total work, not the busiest
rank). Per rebalance: what it cost the streams, over the steps from its request to the first step on the
last group of experts swapped in, in steps of the median (`rebalance_stall`: the worst step's extra, whose
bound in the issue is one, and all of its steps' extra together; the engines compile on first use, so a
step program compiled during a rebalance would count too). Collective bytes per link level of one decode step:
read from the compiled step program (its collectives, each device pair's bytes put on the slowest mesh axis they differ on, as `moray bench
collectives` does); a replica map sends tokens to other slots, not more of them, so both engines' figures
agree but for a few hundred bytes of routing metadata (measured: 705,536 vs 705,024 bytes over the host
link at batch 8). JSON to stdout / `--json`, plots with `--report`. No jax at import time
(registered in `cluster.cli`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench import scratch_dir
from bench.report import add_report_argument, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="an MoE checkpoint (default: a random qwen3_moe 'small', 16 experts top-4)")
    p.add_argument("--mesh", default="2x4", help="device mesh; experts split over all of it (default 2x4)")
    p.add_argument("--redundant", type=int, default=8, help="spare expert slots per MoE layer (default 8)")
    p.add_argument("--batch", type=int, default=32, help="streams decoding together (default 32)")
    p.add_argument("--window-steps", type=int, default=128, help="decode steps per measured window (default 128)")
    p.add_argument("--windows", type=int, default=6, help="windows per engine (default 6)")
    p.add_argument("--drift-at", type=int, default=3, help="window from which the hot experts move (default 3; 0: no drift)")
    p.add_argument("--period", type=int, default=None, help="steps between rebalances (default: --window-steps)")
    p.add_argument(
        "--layers-per-move",
        type=int,
        default=None,
        help="MoE layers whose experts move together (default: the engine's, eplb.layers_per_move)",
    )
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the expert loads (default 1.2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the result here")
    add_report_argument(p)


def _log(msg: str) -> None:
    print(f"[bench eplb] {msg}", file=sys.stderr, flush=True)


def routing_bias(num_layers: int, num_experts: int, exponent: float, rng):
    """Per layer, log-probabilities of a Zipf law over a random order of the experts (the router's own logits
    are small next to them, so its choices follow the law)."""
    import numpy as np

    ranks = np.stack([rng.permutation(num_experts) for _ in range(num_layers)]) + 1
    return np.log(1.0 / ranks.astype(np.float64) ** exponent).astype(np.float32) * 2.0


def set_bias(model, bias) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from workers.models.moe_parallel import moe_blocks

    replicated = NamedSharding(model.mesh, PartitionSpec())
    for block, row in zip(moe_blocks(model.weights), bias):
        block.routing_bias = jax.device_put(jnp.asarray(row), replicated)


def run_engine(args, model_dir, eplb: dict | None, biases, prompts) -> dict:
    import numpy as np

    from workers.engine import EngineConfig, EngineCore, SamplingParams
    from workers.engine.engine import load_engine_model
    from workers.engine.runner import rank_imbalance

    total_steps = args.window_steps * args.windows
    config = EngineConfig(
        model=str(model_dir),
        parallel={"mesh": args.mesh},
        eplb=eplb,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(256, args.batch * 8),
        max_model_len=total_steps + 64,
        warmup=False,
        compilation_cache_dir=None,
        worker_id="eplb" if eplb else "plain",
    )
    model = load_engine_model(config, show_progress=False)
    set_bias(model, biases[0])
    engine = EngineCore(config, model=model, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=total_steps + 8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    ep = getattr(model.experts, "ep_size", 1)
    prev = engine.runner.read_expert_loads()
    windows, all_steps, moving = [], [], []
    for w in range(args.windows):
        if args.drift_at and w == args.drift_at:
            set_bias(model, biases[1])
        steps = []
        for _ in range(args.window_steps):
            busy = engine.balancer is not None and engine.balancer.moving
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            moving.append(busy or (engine.balancer is not None and engine.balancer.moving))
        all_steps += steps
        cur = engine.runner.read_expert_loads()
        window, prev = cur - prev, cur
        per_rank = window.reshape(window.shape[0], ep, -1).sum(-1)
        windows.append(
            {
                "rank_max_over_mean": round(rank_imbalance(window, ep), 4),
                "per_layer_rank_max_over_mean": (per_rank.max(1) / per_rank.mean(1)).round(4).tolist(),
                "routed_tokens": int(window.sum()),
                "hottest_expert_share": round(float((window.max(1) / np.maximum(window.sum(1), 1)).max()), 4),
                "step_ms_median": statistics.median(steps) * 1e3,
                "rebalances_so_far": engine.balancer.num_rebalances if engine.balancer else 0,
            }
        )
        _log(f"{config.worker_id} window {w}: max/mean {windows[-1]['rank_max_over_mean']:.3f}, {windows[-1]['routed_tokens']} routed")
    if engine.balancer:
        engine.balancer.close()
    swaps = [rebalance_stall(all_steps, span, args.window_steps) for span in move_spans(moving)]
    return {"ep_size": ep, "windows": windows, "rebalances": swaps, "link_bytes_per_step": decode_link_bytes(engine)}


def move_spans(moving: list[bool]) -> list[range]:
    """The steps of each finished rebalance: a run of steps during which a placement was being computed or
    moved, and the step after it (the first to run on the last group swapped in). A run still going at the
    end is left out (its rebalance was not counted)."""
    spans, start = [], None
    for i, busy in enumerate(moving):
        if busy and start is None:
            start = i
        elif not busy and start is not None:
            spans.append(range(start, i + 1))
            start = None
    return spans


def rebalance_stall(steps: list[float], span: range, window_steps: int) -> dict:
    """What one rebalance cost the streams, in steps of the median of the window it started in: the most one
    of its steps took beyond an ordinary step (`worst_extra_steps`: the issue's bound, no stream stalls for
    more than one step) and all of its steps together beyond as many ordinary ones (`extra_steps`: the
    copies' whole cost, which on a CPU shares the cores with the steps)."""
    window = span.start // window_steps
    median = statistics.median(steps[window * window_steps : (window + 1) * window_steps])
    around = steps[span.start : span.stop]
    extra = sum(around) - len(around) * median
    return {
        "window": window,
        "step_in_window": span.start - window * window_steps,
        "step_ms": [round(t * 1e3, 3) for t in around],
        "median_step_ms": round(median * 1e3, 3),
        "worst_extra_steps": round(max(max(around) - median, 0.0) / median, 3),
        "extra_steps": round(max(extra, 0.0) / median, 3),
    }


def decode_link_bytes(engine) -> dict:
    """The collective bytes per mesh level (all devices together) of the step program the decode steps ran:
    the largest decode-only one (or the largest, where decode steps share the general program)."""
    from bench.collectives import bytes_by_level, collectives_from_hlo

    shapes = engine.runner.compiled_shapes()
    shape = max([s for s in shapes if s[2]] or shapes)
    mesh = engine.model.mesh
    names, dims = list(mesh.axis_names), list(mesh.devices.shape)
    ops = collectives_from_hlo(engine.runner.program(shape).as_text(), names, dims)
    return {"tokens": shape[0], "by_level": bytes_by_level(ops, names), "collectives": len(ops)}


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    import numpy as np

    from workers.models import load_config
    from workers.models.make_model import make_model

    for name in ("batch", "window_steps", "windows"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    rng = np.random.default_rng(args.seed)
    model_dir = args.model or make_model(Path(scratch_dir("moray-eplb-")) / "m", "qwen3_moe", "small", seed=args.seed)
    _, cfg = load_config(model_dir)
    layers = sum(cfg.moe_layers)
    biases = [routing_bias(layers, cfg.num_experts, args.zipf, rng) for _ in range(2)]
    prompts = [rng.integers(3, cfg.vocab_size, 16).tolist() for _ in range(args.batch)]
    period = args.period or args.window_steps
    result = {
        "model": str(model_dir),
        "mesh": args.mesh,
        "num_experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "redundant_slots": args.redundant,
        "batch": args.batch,
        "window_steps": args.window_steps,
        "period_steps": period,
        "drift_at_window": args.drift_at,
        "zipf": args.zipf,
    }
    result["without"] = run_engine(args, model_dir, None, biases, prompts)
    eplb = {"num_redundant_experts": args.redundant, "period_steps": period}
    if args.layers_per_move is not None:
        eplb["layers_per_move"] = args.layers_per_move
    result["with"] = run_engine(args, model_dir, eplb, biases, prompts)
    steady = [w["rank_max_over_mean"] for w in result["with"]["windows"][1 : args.drift_at or None]]
    result["summary"] = {
        "without_max_over_mean_median": statistics.median(w["rank_max_over_mean"] for w in result["without"]["windows"]),
        "with_max_over_mean_median_before_drift": statistics.median(steady) if steady else None,
        "with_max_over_mean_after_drift": [w["rank_max_over_mean"] for w in result["with"]["windows"][args.drift_at :]]
        if args.drift_at
        else None,
        "rebalances": len(result["with"]["rebalances"]),
        "rebalance_extra_steps_max": max((r["extra_steps"] for r in result["with"]["rebalances"]), default=None),
        "rebalance_worst_step_extra_max": max((r["worst_extra_steps"] for r in result["with"]["rebalances"]), default=None),
    }
    write_result(args, "eplb", result)
    return 0
