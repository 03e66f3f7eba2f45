"""One process of `test_ep_multiprocess.py`'s warm-cache case: an engine over 2 processes with a persistent
compilation cache directory, then a short greedy generation; process 0 writes its tokens.

Usage: python warm_cache_worker.py CHECKPOINT OUT.npy CACHE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ep_multiprocess_worker import ENGINE, PROMPTS  # noqa: E402

from workers.parallel import distributed_settings, init_distributed  # noqa: E402


def main(ckpt: str, out: str, cache: str) -> int:
    init_distributed(distributed_settings())
    import jax
    import numpy as np

    from workers.engine import LLM, SamplingParams

    llm = LLM(ckpt, dtype="float32", parallel={"mesh": "2x4"}, **{**ENGINE, "compilation_cache_dir": cache})
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    if jax.process_index() == 0:
        np.save(out, np.array([o.token_ids for o in outs]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
