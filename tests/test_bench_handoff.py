"""`moray bench handoff`'s prefill-rate part measures prefills: every request it sends is a new prompt."""

from __future__ import annotations

import argparse
import asyncio
import random

from bench import handoff


class _RecordingPrefillWorker:
    """Stands in for the prefill worker: records the prompts of both modes (exported and discarded)."""

    def __init__(self):
        self.prompts: list[tuple[int, ...]] = []

    async def prefill(self, request):
        self.prompts.append(tuple(request.prompt))

    async def release(self, request_id):
        pass

    async def _deltas(self, request_id, prompt, params):
        self.prompts.append(tuple(prompt))
        yield None


def test_prefill_rate_never_repeats_a_prompt():
    """Before: one list of prompts served every run of both modes, so from the second run on each prompt hit
    the prefix cache and the "prefill rate" timed no prefill (on the bench preset it said 0.50x)."""
    args = argparse.Namespace(rate_prompt_tokens=24, rate_requests=6, concurrency=3)
    worker = _RecordingPrefillWorker()
    result = asyncio.run(handoff.prefill_rate(args, worker, random.Random(0), vocab=50_000))
    assert len(worker.prompts) == 10 * 6  # 2 warm-up rounds and 3 measured ones, each mode once per round
    assert len(set(worker.prompts)) == len(worker.prompts)
    assert result["requests"] == 6 and len(result["runs"]["exported"]) == 3


def test_the_transfer_part_times_each_transport_in_one_run(tmp_path):
    """`--transport both`: handoffs over the object store and over shared memory in turn, real Ray, every
    handoff moved (no local prefill), a figure per transport and a target for each."""
    import json

    import ray

    from cluster.cli import main as moray
    from workers.models.make_model import make_model

    model = make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=1)
    was_up = ray.is_initialized()
    out = tmp_path / "h.json"
    argv = ["bench", "handoff", "--model", str(model), "--json", str(out), "--prompt-tokens", "200", "--handoffs", "2"]
    argv += ["--transport", "both", "--rate-requests", "2", "--ttst-concurrency", "1", "--ttst-rounds", "1"]
    # The bench starts (and stops) its own local Ray, or runs on the session's when one is up: it must not be
    # shut down here (stopping the session's failed every later Ray module's set-up in a full run).
    assert moray(argv) == 0
    assert ray.is_initialized() == was_up
    result = json.loads(out.read_text())
    by = result["transfer_by_transport"]
    assert set(by) == {"object_store", "shared_memory"} and result["transfer"] == by["object_store"]
    for name, t in by.items():
        assert len(t["handoffs"]) == 2 and t["import_failures"] == 0 and t["median"]["bytes"] > 0, name
        # Both engine threads' share of a handoff: the prefill's dispatch of the copy, the decode's writes.
        assert all(h["prefill_engine_thread_s"] > 0 and 0 < h["decode_engine_thread_s"] < h["import_s"] for h in t["handoffs"]), name
    assert by["object_store"]["median"]["bytes"] == by["shared_memory"]["median"]["bytes"]
    assert "bandwidth_fraction_of_memcpy_shared_memory" in result["targets"]
