"""One process of `test_ep_multiprocess.py`'s late-compiler case: an engine over 2 processes whose process 1
compiles each step program `LATE_S` seconds after process 0 (as a process compiling beside a busy core does),
then a greedy generation; process 0 writes its tokens.

Usage: python late_compile_worker.py CHECKPOINT OUT.npy
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ep_multiprocess_worker import ENGINE, PROMPTS  # noqa: E402

from workers.parallel import distributed_settings, init_distributed  # noqa: E402

LATE_S = 35.0  # past gloo's 30 s for the processes' first collective over a device group
GREEDY_TOKENS = 1  # the prefill's token: one step program, so one wait of LATE_S


def main(ckpt: str, out: str) -> int:
    init_distributed(distributed_settings())
    import jax
    import numpy as np

    from workers.engine import LLM, SamplingParams
    from workers.engine.runner import ModelRunner

    if jax.process_index() == 1:
        compile_into = ModelRunner._compile_into

        def late(self, shape, future):
            time.sleep(LATE_S)
            compile_into(self, shape, future)

        ModelRunner._compile_into = late
    llm = LLM(ckpt, dtype="float32", parallel={"mesh": "2x4"}, **ENGINE)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    if jax.process_index() == 0:
        np.save(out, np.array([o.token_ids for o in outs]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
