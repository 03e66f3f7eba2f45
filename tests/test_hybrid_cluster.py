"""A hybrid linear-attention model (Qwen3.5-MoE tiny) served disaggregated on a real local Ray: the
openai client gets the offline engine's greedy text, the KV handoff carries attention KV and the
linear-attention state (both in /metrics), and later turns of a chat report cached tokens."""

from __future__ import annotations

import pytest
from cluster_harness import cluster_config, metric_total, openai_client, served_app, wait_until

from workers.models.make_model import make_model

pytestmark = pytest.mark.cluster

pytest.importorskip("openai")
import openai  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hybrid-cluster") / "qwen35", "qwen3_5_moe", "tiny", seed=11)


@pytest.fixture(scope="module")
def cluster(model_dir, ray_serve):
    with served_app(ray_serve, cluster_config(model_dir, name="hybrid")) as app:
        yield {"base": app.base, "config": app.config}


def client(cluster) -> openai.OpenAI:
    return openai_client(cluster["base"])


def metric(cluster, name: str) -> float:
    return metric_total(cluster["base"], name)


def test_served_text_equals_offline_and_handoff_carries_state(cluster, model_dir):
    from workers.engine import LLM, SamplingParams

    prompt = "A hybrid model keeps a recurrent state per sequence and a paged cache for its attention layers."
    engine_args = {k: v for k, v in cluster["config"]["engine"].items() if k != "model"}
    expected = LLM(str(model_dir), **engine_args, warmup=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    before_kv, before_state = metric(cluster, "moray_kv_handoff_bytes_total"), metric(cluster, "moray_kv_handoff_state_bytes_total")
    out = client(cluster).completions.create(model="qwen35", prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text
    # The decode worker publishes its counters with its next heartbeat.
    wait_until(lambda: metric(cluster, "moray_kv_handoff_state_bytes_total") > before_state, 15, 0.2, "the state bytes showing")
    state = metric(cluster, "moray_kv_handoff_state_bytes_total") - before_state
    total = metric(cluster, "moray_kv_handoff_bytes_total") - before_kv
    assert state > 0 and total > state  # attention KV travelled too


def test_chat_turns_report_cached_tokens(cluster):
    c = client(cluster)
    messages = [
        {"role": "system", "content": "You are a terse assistant that answers about caches and recurrent states."},
        {"role": "user", "content": "What does a linear attention layer keep for each sequence it serves?"},
    ]
    first = c.chat.completions.create(model="qwen35", messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the attention layers?"},
    ]
    second = c.chat.completions.create(model="qwen35", messages=messages, max_tokens=6, temperature=0)
    # At least the first turn's prompt up to its last full block was found (a state snapshot is
    # always kept there).
    assert second.usage.prompt_tokens_details.cached_tokens >= 8 * (first.usage.prompt_tokens // 8)
