"""One process of `test_ep_multiprocess.py`: joins the JAX cluster (MORAY_* variables), runs the model's
forward under each parallel configuration and a greedy generation, and process 0 writes the results.

Usage: python ep_multiprocess_worker.py CHECKPOINT OUT.npz
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hlo_collectives

from workers.parallel import distributed_settings, init_distributed  # noqa: E402

PROMPTS = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45], [5, 5, 5, 60, 21, 33, 94]]
# name -> ParallelConfig fields. 2x2x2 with the core axis as the fast domain: the k = 2 hierarchical
# dispatch splits hidden 256 into halves, and its slow levels (host, chip) span both processes.
CONFIGS = {
    "2x4-flat": dict(mesh="2x4", moe={"dispatch": "flat"}),
    "2x4-hierarchical": dict(mesh="2x4", moe={"dispatch": "hierarchical"}),
    "2x2x2-hierarchical-dispatch": dict(mesh="2x2x2", moe={"dispatch": "hierarchical-dispatch", "fast_axes": ["core"]}),
}
ENGINE = dict(
    block_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=64,
    token_buckets=[4, 32],
    page_buckets=[8],
    compilation_cache_dir=None,
    warmup=False,
)
GENERATE = dict(mesh="2x4", moe={"dispatch": "hierarchical"})
# Expert load balancing on: a rebalance every 2 steps moves experts between the processes mid-generation.
EPLB = dict(num_redundant_experts=8, period_steps=2)
# The all-to-all exchange (every step) and the column-split gather: their step programs' collectives too.
ORDER_ONLY = (
    dict(mesh="2x4", moe={"dispatch": "flat", "all_to_all_min_tokens": 1}),
    dict(mesh="2x2x2", moe={"dispatch": "hierarchical-dispatch", "fast_axes": ["core"]}),
)


def main(ckpt: str, out: str) -> int:
    init_distributed(distributed_settings())
    import jax
    import numpy as np

    from workers.engine import LLM, SamplingParams
    from workers.engine.config import ParallelConfig
    from workers.models import prompt_logits
    from workers.parallel import load_parallel_model

    results = {"process_count": np.array(jax.process_count()), "device_count": np.array(jax.device_count())}
    for name, fields in CONFIGS.items():
        model = load_parallel_model(ckpt, ParallelConfig(**fields), dtype="float32", show_progress=False)
        results[name] = prompt_logits(model, PROMPTS)
    # jax.device_put of host data across processes runs a collective of its own (a check that every process
    # passed the same value): counted over the engine's start-up (expert balancing places its moves) and steps.
    from jax.experimental import multihost_utils

    checks, check = [], multihost_utils.assert_equal
    multihost_utils.assert_equal = lambda *args, **kwargs: (checks.append(1), check(*args, **kwargs))[1]
    llm = LLM(ckpt, dtype="float32", parallel=GENERATE, eplb=EPLB, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    multihost_utils.assert_equal = check
    results["device_put_checks"] = np.array(len(checks))
    results["generated"] = np.array([o.token_ids for o in outs])
    # Every step program the generations ran, as compiled for two processes (`hlo_collectives`), also those of
    # the other two MoE exchanges (their tokens must be the same).
    from hlo_collectives import count_collectives, unordered_collectives

    texts = []
    for parallel in (None, *ORDER_ONLY):
        if parallel is not None:
            other = LLM(ckpt, dtype="float32", parallel=parallel, **ENGINE)
            again = other.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
            results[f"generated-{parallel['moe']['dispatch']}"] = np.array([o.token_ids for o in again])
        runner = (llm if parallel is None else other).engine.runner
        texts += [runner.program(shape).as_text() for shape in runner.compiled_shapes()]
    results["step_programs"] = np.array(len(texts))
    results["collectives"] = np.array(sum(map(count_collectives, texts)))
    results["unordered_collectives"] = np.array(sum(len(unordered_collectives(t)) for t in texts))
    if jax.process_index() == 0:
        np.savez(out, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
