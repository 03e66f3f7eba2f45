"""The `moray` command line.

Exit codes: 0 success; 1 a model/checkpoint that cannot be loaded; 2 bad arguments or input.
Errors are one line on stderr naming the cause.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty token id list")
    return ids


def cmd_make_model(args: argparse.Namespace) -> int:
    from workers.models.make_model import make_model

    out = make_model(args.out, args.arch, args.preset, seed=args.seed, mtp=args.mtp)
    print(out)
    return 0


def _add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (default: one device)")
    g.add_argument("--mesh", help="device mesh host x chip[ x core], e.g. 8, 2x4, 2x2x2")
    g.add_argument("--dp", type=int, help="attention data-parallel size (default devices / tp)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallelism of the dense layers (default 1)")
    g.add_argument("--ep", type=int, help="expert-parallel size (default all devices)")
    g.add_argument("--moe-dispatch", choices=["flat", "hierarchical", "hierarchical-dispatch"], default="flat")
    g.add_argument("--gather-dtype", choices=["model", "fp8"], default="model")
    g.add_argument(
        "--num-processes", type=int, default=1, help="run as N local processes joined by jax.distributed (CPU: mesh/N devices each)"
    )


def _parallel_config(args: argparse.Namespace):
    from pydantic import ValidationError

    from workers.engine.config import ParallelConfig

    try:
        return ParallelConfig(
            mesh=args.mesh, dp=args.dp, tp=args.tp, ep=args.ep, moe={"dispatch": args.moe_dispatch, "gather_dtype": args.gather_dtype}
        )
    except ValidationError as e:  # one line naming the first problem
        first = e.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{where + ': ' if where else ''}{first['msg']}") from None


def _launch_processes(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-runs this command as `--num-processes` local processes forming one JAX cluster."""
    from workers.parallel import launch_local_processes, parse_mesh

    if not args.mesh:
        raise ValueError("--num-processes needs --mesh (e.g. --mesh 2x4 --num-processes 2)")
    devices = 1
    for d in parse_mesh(args.mesh):
        devices *= d
    if devices % args.num_processes:
        raise ValueError(f"mesh {args.mesh} ({devices} devices) does not split over {args.num_processes} processes")
    command = [sys.executable, "-m", "cluster.cli", *argv]
    return launch_local_processes(command, args.num_processes, devices // args.num_processes)


def _is_lead_process() -> bool:
    import jax

    return jax.process_index() == 0


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from workers.models import prompt_logits
    from workers.parallel import distributed_settings, init_distributed, load_parallel_model

    init_distributed(distributed_settings())  # a process of `--num-processes`: join the others first
    model = load_parallel_model(args.model, _parallel_config(args), dtype=args.dtype, load_format=args.load_format)
    logits = prompt_logits(model, args.token_ids)
    if _is_lead_process():
        np.save(args.out, logits)
        print(f"wrote logits {list(logits.shape)} to {args.out}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from workers.engine import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
    )
    if args.prompt is None and args.token_ids is None:
        raise ValueError("give --prompt TEXT or --token-ids 1,2,3")
    llm = LLM(
        str(args.model),
        show_progress=args.verbose,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        warmup=False,
        parallel=_parallel_config(args),
    )
    if args.token_ids is not None:
        prompt = args.token_ids
    elif args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs tokenizer files in the model directory")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
    else:
        prompt = args.prompt
    out = llm.generate([prompt], params)[0]
    if not _is_lead_process():
        return 0
    if args.json:
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "num_cached_tokens": out.num_cached_tokens,
                    "prompt_token_ids": out.prompt_token_ids,
                    "logprobs": [{str(k): v for k, v in lp.items()} for lp in out.logprobs] if out.logprobs else None,
                }
            )
        )
    else:
        print(out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0


# Commands that live in their own module: each module defines `add_arguments(parser)` and
# `run(args) -> int`, and must be cheap to import (import jax and friends inside `run`).
MODULE_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cluster.serve_cli", "start a local cluster (or deploy onto a running one) and serve"),
    "serve-config": ("cluster.serve_config_cli", "print the Serve config (serve deploy / KubeRay) for a cluster config"),
    "quantize": ("workers.models.quantize", "write a compressed-tensors W4A16/FP8/MXFP8 checkpoint (numpy only)"),
    # name: (module, help)
}
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    # `moray bench NAME`: (module, help)
    "route": ("bench.route", "routing decision latency and throughput, memory and Redis KV index"),
    "memory": ("bench.memory", "weight memory, decode speed and quality of W4A16/FP8/MXFP8 vs unquantised"),
    "engine": ("bench.engine", "engine decode/prefill tokens/s, roofline ratio, and transformers side by side"),
    "collectives": ("bench.collectives", "EP MoE modes: collective bytes per mesh level (HLO), dispatch and layer times"),
    "serve": ("bench.serve", "load a server with a workload: TTFT, TPOT, e2e, hit rate, KV handoff"),
    "routing": ("bench.routing", "routing policies end to end on a local cluster: hit rate vs an oracle, TTFT, load balance"),
    "fuzz": ("bench.fuzz", "property-based fuzzing of a loopback server's HTTP and gRPC APIs: no 5xx, fast rejections"),
    "soak": ("bench.soak", "long mixed load with cancellations and sessions: failures, latency per minute, RSS, KV after drain"),
    "handoff": ("bench.handoff", "the KV transfer layer: handoff bandwidth vs memcpy, prefill rate with exports, time to the 2nd token"),
    "spec": ("bench.spec", "speculative decoding (n-gram, draft model) on trained checkpoints: acceptance, tokens/s vs none"),
    "eplb": ("bench.eplb", "expert load per EP rank under Zipf-skewed routing (with a drift), without and with rebalancing"),
    "compare": ("bench.compare", "two result files of one bench: every numeric figure that differs, with B/A (and --report plots)"),
}


def _add_module_commands(sub, commands: dict[str, tuple[str, str]]) -> None:
    import importlib

    for name, (module_name, help_text) in commands.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text)
        module.add_arguments(p)
        p.set_defaults(fn=module.run)


# `workers.models.make_model.ARCHS`, spelled out: importing it would load JAX for every `moray` command
# (tests/test_make_model.py checks the two agree).
MAKE_MODEL_ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "gemma4"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moray", description="MoE serving on Ray: tools and servers")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and timings")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a random-weight Hugging Face checkpoint")
    p.add_argument("out", type=Path)
    p.add_argument("--arch", choices=MAKE_MODEL_ARCHS, default="qwen3_moe")
    p.add_argument("--preset", choices=["tiny", "small", "bench"], default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mtp",
        action="store_true",
        help="with a multi-token-prediction head (deepseek_v3, qwen3_5_moe, qwen3_next; speculative method mtp)",
    )
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("logits", help="write the prompt logits of token-id prompts as float32 .npy")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--token-ids", type=_token_ids, action="append", required=True, help="e.g. 1,2,3; repeatable")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors")
    _add_parallel_arguments(p)
    p.set_defaults(fn=cmd_logits)

    p = sub.add_parser("generate", help="generate from one prompt with the offline engine")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--prompt")
    p.add_argument("--token-ids", type=_token_ids)
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--logprobs", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--json", action="store_true", help="print text, token ids, logprobs and finish reason as JSON")
    _add_parallel_arguments(p)
    p.set_defaults(fn=cmd_generate)

    _add_module_commands(sub, MODULE_COMMANDS)
    bench = sub.add_parser("bench", help="benchmarks that write JSON results")
    _add_module_commands(bench.add_subparsers(dest="bench", required=True), BENCH_COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from workers.models import ModelLoadError
    from workers.parallel import ENV_PROCESS_ID

    try:
        if getattr(args, "num_processes", 1) > 1 and ENV_PROCESS_ID not in os.environ:
            return _launch_processes(args, argv)
        return args.fn(args)
    except ModelLoadError as e:
        print(f"moray: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"moray: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
