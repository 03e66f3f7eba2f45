"""Gemma 4 (the tiny MoE composite: 3 sliding layers with a 16-token window, 1 full layer of another head
dim) served disaggregated on the session's real local Ray: the openai client gets the offline engine's
greedy text for a prompt past the window, the KV handoff moves both layer shapes, a chat's second turn
reports cached tokens, and streaming works."""

from __future__ import annotations

import pytest
from cluster_harness import cluster_config, metric_total, openai_client, served_app, wait_until

from workers.models.make_model import make_model

pytestmark = pytest.mark.cluster

pytest.importorskip("openai")
import openai  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gemma4-cluster") / "gemma4", "gemma4", "tiny", seed=5)


@pytest.fixture(scope="module")
def cluster(model_dir, ray_serve):
    with served_app(ray_serve, cluster_config(model_dir, name="gemma4")) as app:
        yield {"base": app.base, "config": app.config}


def client(cluster) -> openai.OpenAI:
    return openai_client(cluster["base"])


def handoff_bytes(cluster) -> float:
    return metric_total(cluster["base"], "moray_kv_handoff_bytes_total")


def test_served_text_equals_offline_past_the_window(cluster, model_dir):
    from workers.engine import LLM, SamplingParams

    prompt = "Sliding layers see the last sixteen tokens; the full layer sees every token of this long prompt, all of it."
    engine_args = {k: v for k, v in cluster["config"]["engine"].items() if k != "model"}
    expected = LLM(str(model_dir), **engine_args, warmup=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0]
    before = handoff_bytes(cluster)
    out = client(cluster).completions.create(model="gemma4", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > 16 and out.choices[0].text == expected.text
    wait_until(lambda: handoff_bytes(cluster) > before, 15, 0.2, "the handoff bytes showing")
    stream = client(cluster).completions.create(
        model="gemma4", prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text


def test_chat_second_turn_reports_cached_tokens(cluster):
    c = client(cluster)
    messages = [
        {"role": "system", "content": "You answer in one short sentence about attention windows and caches."},
        {"role": "user", "content": "Which layers of Gemma 4 keep every token of the conversation?"},
    ]
    first = c.chat.completions.create(model="gemma4", messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And the others?"}]
    second = c.chat.completions.create(model="gemma4", messages=messages, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
