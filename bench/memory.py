"""`moray bench memory --model DIR --json OUT`: weight memory, decode speed and quality of the W4A16, FP8
and MXFP8 versions of one unquantised model, against that model.

For the unquantised model ("bf16") and each scheme (checkpoints written by `moray quantize` into
--work-dir, a temporary directory by default):
- weight bytes, measured from the device buffers: the sum of `nbytes` over every leaf's addressable
  shards, with the model loaded in bfloat16 (the TPU serving dtype; packed values and E8M0 scales keep
  their own dtypes). `linear_ratio` covers only the leaves the scheme quantises (embedding, norms, routers
  and LM head stay bf16 in every version).
- decode throughput: greedy decode of --batch sequences for --decode-steps steps after a --prompt-len
  prefill, on the contiguous KV cache, in the compute dtype (--dtype; float32 on CPU), as tokens/s and
  relative to the unquantised model.
- quality: next-token distributions at every position of a fixed prompt set (seeded random token ids),
  against the unquantised model in the same dtype: top-1 agreement and mean KL(unquantised || quantised);
  `unquantised_in_bf16_compute` gives the same figures for the unquantised model computed in bfloat16, as
  a yardstick.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.report import add_report_argument, report_if_asked

SCHEMES = ("w4a16", "fp8", "mxfp8")
REFERENCE = "bf16"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="unquantised checkpoint directory")
    p.add_argument("--json", required=True, type=Path, help="where to write the results")
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    p.add_argument("--group-size", type=int, default=128, help="W4A16 group size")
    p.add_argument("--work-dir", type=Path, help="keep the quantised checkpoints here (default: a temp dir)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype for speed/quality")
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=8, help="prompts in the quality set")
    p.add_argument("--seed", type=int, default=0)
    add_report_argument(p)


# ---------------------------------------------------------------------------------------------
# Measurements.


def device_bytes(tree) -> dict[str, int]:
    """Bytes held on devices per leaf path, summed over each array's addressable shards."""
    import jax

    return {
        jax.tree_util.keystr(path): sum(s.data.nbytes for s in leaf.addressable_shards)
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def quantized_paths(weights) -> set[str]:
    """Leaf paths of the arrays inside quantised weights, mapped to the dense leaf they replace."""
    import jax

    from kernels.quant import QuantizedWeight

    paths = set()
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights, is_leaf=lambda x: isinstance(x, QuantizedWeight)):
        if isinstance(leaf, QuantizedWeight):
            paths.add(jax.tree_util.keystr(path))
    return paths


def _sum_under(per_leaf: dict[str, int], prefixes: set[str]) -> int:
    return sum(n for path, n in per_leaf.items() if any(path == p or path.startswith(p + ".") for p in prefixes))


def decode_tokens_per_s(model, batch: int, prompt_len: int, steps: int, seed: int) -> float:
    """Greedy decode throughput (tokens/s over the batch), after a prefill and one warm-up step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, model.cfg.vocab_size, (batch, prompt_len), dtype=np.int32)
    cache = model.new_cache(batch, prompt_len + steps + 1)
    positions = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), prompts.shape)
    logits, cache = model.step(prompts, positions, cache)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]

    def step(token, cache, pos):
        logits, cache = model.step(token, np.full((batch, 1), pos, np.int32), cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    token, cache = step(token, cache, prompt_len)  # compiles the decode step
    jax.block_until_ready(token)
    start = time.perf_counter()
    for i in range(steps - 1):
        token, cache = step(token, cache, prompt_len + 1 + i)
    jax.block_until_ready(token)
    return batch * (steps - 1) / (time.perf_counter() - start)


def next_token_quality(ref_logits, logits) -> dict[str, float]:
    """Top-1 agreement and mean KL(ref || quantised) of the next-token distributions at every position."""
    import numpy as np

    ref, got = (np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in (ref_logits, logits))
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return {
        "top1_agreement": float(np.mean(ref.argmax(-1) == got.argmax(-1))),
        "mean_kl": float(kl.mean()),
        "positions": int(ref.shape[0]),
    }


# ---------------------------------------------------------------------------------------------


def measure(args) -> dict:
    """The report; quantised checkpoints go to --work-dir, or a temporary directory removed afterwards."""
    if args.work_dir:
        return _measure(args, args.work_dir)
    with tempfile.TemporaryDirectory(prefix="moray-bench-memory-") as tmp:
        return _measure(args, Path(tmp))


def _measure(args, work: Path) -> dict:
    import jax
    import numpy as np

    from workers.models import default_dtype, load_model, prompt_logits
    from workers.models.quantize import quantize_checkpoint

    dtype = args.dtype or default_dtype()
    rng = np.random.default_rng(args.seed)
    dirs = {REFERENCE: args.model}
    for scheme in args.schemes:
        dirs[scheme] = quantize_checkpoint(args.model, work / scheme, scheme, args.group_size)

    ref_model = load_model(args.model, dtype=dtype, show_progress=False)
    vocab = ref_model.cfg.vocab_size
    prompts = rng.integers(0, vocab, (args.num_prompts, args.prompt_len)).tolist()
    ref_logits = prompt_logits(ref_model, prompts)
    del ref_model
    # How far plain bf16 compute already moves these distributions: a yardstick for the quantised rows
    # (random-weight models have near-flat next-token distributions, so top-1 is fragile).
    calibration = None
    if str(dtype) != "bfloat16":
        bf16_logits = prompt_logits(load_model(args.model, dtype="bfloat16", show_progress=False), prompts)
        calibration = next_token_quality(ref_logits, bf16_logits)

    results: dict[str, dict] = {}
    ref_bytes: dict[str, int] = {}
    for name, path in dirs.items():
        bf16 = load_model(path, dtype="bfloat16", show_progress=False)
        per_leaf = device_bytes(bf16.weights)
        if name == REFERENCE:
            ref_bytes = per_leaf
        packed = quantized_paths(bf16.weights)
        del bf16
        model = load_model(path, dtype=dtype, show_progress=False)
        row = {
            "weight_bytes": sum(per_leaf.values()),
            "quantized_leaves": len(packed),
            "linear_bytes": _sum_under(per_leaf, packed),
            "linear_bytes_bf16": _sum_under(ref_bytes, packed),
            "decode_tokens_per_s": decode_tokens_per_s(model, args.batch, args.prompt_len, args.decode_steps, args.seed),
        }
        row.update(next_token_quality(ref_logits, prompt_logits(model, prompts)))
        del model
        results[name] = row

    ref = results[REFERENCE]
    for row in results.values():
        row["weight_ratio"] = row["weight_bytes"] / ref["weight_bytes"]
        row["linear_ratio"] = row["linear_bytes"] / row["linear_bytes_bf16"] if row["linear_bytes_bf16"] else 1.0
        row["decode_speed_ratio"] = row["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    return {
        "model": str(args.model),
        "memory_dtype": "bfloat16",
        "compute_dtype": str(dtype),
        "backend": jax.default_backend(),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "num_prompts": args.num_prompts,
        "w4a16_group_size": args.group_size,
        "unquantised_in_bf16_compute": calibration,
        "results": results,
    }


def run(args: argparse.Namespace) -> int:
    report = measure(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    report_if_asked(args, "memory", report)
    return 0
