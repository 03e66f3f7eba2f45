"""DeepSeek-V3 tiny served disaggregated on a real local Ray: the openai client gets the offline engine's
greedy text and the KV handoff moves latent rows: (kv_lora_rank + rope dim) x layers x dtype bytes per
token, as /metrics shows."""

from __future__ import annotations

import pytest
from cluster_harness import API_KEY, cluster_config, http_json, served_app, wait_until

from workers.models.make_model import make_model

pytestmark = pytest.mark.cluster

pytest.importorskip("openai")
import openai  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("deepseek-cluster") / "dsv3", "deepseek_v3", "tiny", seed=12)


@pytest.fixture(scope="module")
def cluster(model_dir, ray_serve):
    with served_app(ray_serve, cluster_config(model_dir, name="dsv3")) as app:
        yield {"base": app.base, "config": app.config}


def samples(cluster, name: str) -> list[tuple[str, float]]:
    status, text = http_json(cluster["base"] + "/metrics", key=None)
    assert status == 200
    return [
        (line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith((name + "{", name + " "))
    ]


def total(cluster, name: str) -> float:
    return sum(v for _, v in samples(cluster, name))


def test_served_text_equals_offline_and_the_handoff_moves_latent_rows(cluster, model_dir):
    from workers.engine import LLM, SamplingParams
    from workers.models import load_config

    _, cfg = load_config(model_dir)
    prompt = "Multi-head latent attention caches one compressed row per token and layer, shared by every head."
    engine_args = {k: v for k, v in cluster["config"]["engine"].items() if k != "model"}
    expected = LLM(str(model_dir), **engine_args, warmup=False).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    )[0]
    before = total(cluster, "moray_kv_handoff_bytes_total")
    client = openai.OpenAI(base_url=cluster["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = client.completions.create(model="dsv3", prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected.text
    # The decode worker publishes its counters with its next heartbeat.
    wait_until(lambda: total(cluster, "moray_kv_handoff_bytes_total") > before, 15, 0.2, "the handoff bytes showing")
    moved = total(cluster, "moray_kv_handoff_bytes_total") - before
    per_token = (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * cfg.num_layers * 4  # float32 on CPU
    assert {v for _, v in samples(cluster, "moray_kv_cache_bytes_per_token")} == {per_token}
    block = cluster["config"]["engine"]["block_size"]
    prompt_tokens = out.usage.prompt_tokens
    assert moved == -(-prompt_tokens // block) * block * per_token, (moved, prompt_tokens, per_token)
