"""`moray bench fuzz` and `moray bench soak`: the request generators on their own (they produce the hostile
cases they promise; loopback only), then a short fuzz and a short soak against one real local cluster."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("hypothesis")

from report_harness import check_report  # noqa: E402

from bench import fuzz  # noqa: E402
from bench.soak import Record, _label, kv_state, parse_metrics, per_minute, rss_growth  # noqa: E402
from cluster.cli import main as moray_main  # noqa: E402

T = fuzz.Target(model="tiny", vocab_size=512, max_model_len=256, api_key="k")


def stratum(name: str, n: int, seed: int = 0, grpc: bool = False) -> list:
    strata = fuzz.grpc_strata(T) if grpc else fuzz.http_strata(T)
    (strategy,) = [s for nm, _, s in strata if nm == name]
    return fuzz.draw_cases(strategy, n, seed)


def bodies(cases) -> list[bytes]:
    return [c.body_bytes() or b"" for c in cases]


# ---------------------------------------------------------------------------------------- loopback


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000/", "https://127.9.9.9"])
def test_loopback_urls_are_accepted(url):
    assert fuzz.check_url(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000", "http://127.0.0.1.nip.io", "ftp://127.0.0.1"]
)
def test_other_hosts_are_refused(url):
    with pytest.raises(ValueError):
        fuzz.check_url(url)


def test_grpc_addresses_and_the_commands_refuse_other_hosts(capsys):
    assert fuzz.check_grpc_address("127.0.0.1:9000") and fuzz.check_grpc_address("[::1]:9000") and fuzz.check_grpc_address("localhost:9000")
    for addr in ("10.1.2.3:9000", "grpc.example.com:443", "[2001:db8::1]:9000"):
        with pytest.raises(ValueError):
            fuzz.check_grpc_address(addr)
    # Refused before anything is sent: exit 2 with a one-line error.
    assert moray_main(["bench", "fuzz", "--url", "http://192.0.2.1:8000", "--cases", "1"]) == 2
    assert moray_main(["bench", "fuzz", "--url", "http://127.0.0.1:8000", "--grpc", "192.0.2.1:9000", "--cases", "1"]) == 2
    assert moray_main(["bench", "soak", "--url", "http://192.0.2.1:8000", "--minutes", "0.1"]) == 2
    assert "loopback" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- generators


def test_cases_are_deterministic_and_split_over_every_stratum():
    a = fuzz.draw_strata(fuzz.http_strata(T), 120, seed=5)
    b = fuzz.draw_strata(fuzz.http_strata(T), 120, seed=5)
    assert [c.describe() for c in a] == [c.describe() for c in b] and len(a) == 120
    strata = fuzz.http_strata(T)
    counts = fuzz.allocate(1000, [w for _, w, _ in strata])
    assert sum(counts) == 1000 and min(counts) >= 1
    assert fuzz.allocate(3, [1.0, 5.0, 2.0, 0.5]) == [1, 1, 1, 0]  # fewer cases than strata: the heaviest first


def test_every_pair_of_mutations_composes():
    """Mutations run on whatever the one before left (a field of the wrong type, messages that are a string...)."""
    case = fuzz.http_case(T)
    mutations = list(dict.fromkeys(fuzz.MUTATIONS))
    for i, a in enumerate(mutations):
        for j, b in enumerate(mutations):
            (c,) = fuzz.draw_cases(case("mutated", (a, b)), 1, seed=i * 100 + j)
            assert c.expect in ("ok", "reject", "any") and c.describe()["body_bytes"] > 0


def test_valid_cases_pass_the_servers_request_models():
    from cluster import openai_api as oa

    for case in stratum("valid", 60):
        model = oa.ChatCompletionRequest if "chat" in case.path else oa.CompletionRequest
        body = model.model_validate_json(case.body_bytes())
        assert case.expect == "ok" and not body.unsupported(), case.describe()
        limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
        assert limit is None or 1 <= limit <= 4  # small, so the fuzz stays fast


def test_wrong_types_huge_numbers_and_5000_digit_integers():
    wrong = stratum("mutated:wrong_type", 40)
    assert all(c.expect in ("reject", "any") for c in wrong)
    assert len({c.kind.split(", ")[0] for c in wrong}) >= 10  # many different fields
    huge = stratum("mutated:huge_number", 80)
    assert any(re.search(rb"\d{5000}", b) for b in bodies(huge))
    assert any(b"1e400" in b for b in bodies(huge))
    for c in huge:
        if "," not in c.kind and re.search(rb"(?<![\d.])\d{4301,}(?![\d.eE])", c.body_bytes()):  # an integer literal
            assert c.expect == "reject"  # past Python's int digit limit: must be a 400, never a 500


def test_lone_surrogates_invalid_utf8_and_deep_nesting_under_the_body_limit():
    lone = re.compile(rb"\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f])|(?<!\\ud[89ab][0-9a-f]{2})\\ud[c-f][0-9a-f]{2}")
    cases = [c for c in stratum("mutated:surrogate", 40) if "," not in c.kind]  # one mutation: nothing overwrote it
    assert cases and all(lone.search(c.body_bytes()) and c.expect == "reject" for c in cases)
    for c in stratum("mutated:invalid_utf8", 10):
        if "," not in c.kind:
            with pytest.raises(UnicodeDecodeError):
                c.body_bytes().decode("utf-8")
    deep = stratum("mutated:deep", 80)
    depths = [
        max((len(m) for m in re.findall(rb"\[+", b)), default=0) + max((len(m) // 5 for m in re.findall(rb'(?:\{"a":)+', b)), default=0)
        for b in bodies(deep)
    ]
    assert max(depths) >= 1000
    assert all(len(c.body_bytes()) < T.max_body_bytes for c in deep if "," not in c.kind)
    assert any(c.expect == "reject" for c in deep)


def test_unknown_and_unsupported_fields():
    unknown = [c for c in stratum("mutated:unknown_fields", 30) if "," not in c.kind]
    assert unknown and all(c.expect == "ok" and set(json.loads(c.body_bytes())) - fuzz.ALL_KNOWN for c in unknown)
    unsupported = stratum("mutated:unsupported", 60)
    seen = {c.kind.split(", ")[0].split(":")[2] for c in unsupported}
    assert {"tools", "response_format", "logit_bias"} <= seen
    assert all(c.expect == "reject" for c in unsupported if c.kind.count(",") == 0)


def test_token_ids_roles_tool_calls_context_and_stream_flags():
    oov = stratum("mutated:oov_tokens", 40)
    for c in oov:
        body = json.loads(c.body_bytes()) if c.kind.count(",") == 0 else None
        if body is not None:
            ids = body.get("stop_token_ids") or []
            prompt = body.get("prompt")
            flat = prompt[0] if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else prompt
            all_ids = ids + (flat if isinstance(flat, list) else [])
            assert any(not 0 <= i < T.vocab_size for i in all_ids) and c.expect == "reject"
    assert any("stop_token_ids" in c.kind for c in oov) and any("oov_token:prompt" in c.kind for c in oov)
    roles = stratum("mutated:bad_role", 30)
    assert any("bad_role" in c.kind for c in roles)
    tools = stratum("mutated:null_content_tool_calls", 40)
    chat_tools = [
        json.loads(c.body_bytes())
        for c in tools
        if c.path.endswith("chat/completions") and c.kind.startswith("mutated:null_content_tool_calls")
    ]
    assert any(m.get("content", 1) is None and "tool_calls" in m for b in chat_tools for m in b["messages"])
    ctx = stratum("mutated:beyond_context", 30)
    limits = [int(c.kind.split(", ")[0].rsplit(":", 1)[1]) for c in ctx if c.kind.startswith("mutated:max_tokens_beyond_context")]
    assert any(v > T.max_model_len for v in limits) and any(v <= 0 for v in limits)
    assert all(c.expect == "reject" for c in ctx if c.kind.count(",") == 0)
    streams = stratum("mutated:stream", 40)
    assert any(c.kind.startswith("mutated:stream:wrong_type") for c in streams)


def test_malformed_bodies_framing_and_grpc():
    for name, _, _ in [s for s in fuzz.http_strata(T) if s[0].startswith("raw_body:")][:8]:
        for c in stratum(name, 2):
            assert isinstance(c.body, bytes)
    framing = stratum("framing:cl_not_number", 1)[0]
    assert framing.framing.startswith(b"POST /v1/completions HTTP/1.1") and b"Content-Length: abc" in framing.framing
    from protos.moray.v1 import moray_pb2

    valid = stratum("valid", 20, grpc=True)
    for c in valid:
        req = moray_pb2.GenerateRequest.FromString(c.data)
        assert c.expect == "ok" and 1 <= req.sampling.max_tokens <= 4
    random_msgs = stratum("random", 40, grpc=True)
    assert all(moray_pb2.GenerateRequest.FromString(c.data) is not None for c in random_msgs)
    assert "reject" in {c.expect for c in random_msgs}
    from google.protobuf.message import DecodeError

    for kind in ("raw:bad_utf8_model", "raw:field_zero", "raw:length_past_end"):
        for c in stratum(kind, 3, grpc=True):
            with pytest.raises(DecodeError):
                moray_pb2.GenerateRequest.FromString(c.data)


def test_soak_report_helpers():
    text = "\n".join(
        [
            "# HELP x",
            'vllm:kv_cache_usage_perc{engine="d1",model_name="m",role="decode"} 0.25',
            'vllm:kv_cache_usage_perc{engine="p1",model_name="m",role="prefill"} 0.0',
            'vllm:num_requests_running{engine="d1",model_name="m",role="decode"} 1.0',
            'vllm:num_requests_waiting{engine="d1",model_name="m",role="decode"} 0.0',
            'moray_router_worker_load{field="active_decode_blocks",worker="d1"} 12.0',
        ]
    )
    assert parse_metrics(text)["vllm:kv_cache_usage_perc"][0] == ({"engine": "d1", "model_name": "m", "role": "decode"}, 0.25)
    kv = kv_state(text)
    assert kv["busy_workers"] == ["d1"] and not kv["drained"] and kv["workers"]["d1"]["kv_blocks_in_use"] == 12
    assert kv_state(text.replace("0.25", "0.0").replace("} 1.0", "} 0.0").replace("12.0", "0.0"))["drained"]
    assert _label("ray::ServeReplica:moray:DecodeServer.generate") == "ServeReplica:moray:DecodeServer"
    assert _label("ray::ProxyActor") == "ProxyActor"
    samples = [{"t_s": t, "total_bytes": 100 + t, "processes": {1: {"name": "A", "rss_bytes": 100 + t}}} for t in (0.0, 60.0, 120.0, 300.0)]
    g = rss_growth(samples)
    assert (g["from_t_s"], g["to_t_s"], g["total_growth_bytes"]) == (120.0, 300.0, 180.0)
    minutes = per_minute([Record(1.0, "c", "ok", 0.1), Record(61.0, "c", "failed"), Record(70.0, "c", "ok", 0.3, 0.1)])
    assert [m["requests"] for m in minutes] == [1, 2] and minutes[1]["failed"] == 1 and minutes[1]["ttft_p50_s"] == 0.1


def test_soak_chat_sessions_stay_within_the_context_they_are_told(tmp_path):
    """Seen in CI: a chat session of the soak client grew past the test model's max_model_len of 256 and the
    server's correct 400 counted as a failure. The replies of a random model re-encode to more tokens than
    were generated; here every reply is 12 tokens of 3-byte characters (each a token or more when sent back),
    and every prompt the client sends, rendered by the model's own template, must still fit."""
    import asyncio
    import random

    from bench import soak as soak_mod
    from workers.models.make_model import make_model
    from workers.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=1))
    limit = 256
    sent: list[int] = []

    async def fake_post(soak, session, path, body, kind, session_id=None):
        prompt = len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True))
        sent.append(prompt + body["max_tokens"])
        return {"text": "\u20ac" * 4 * body["max_tokens"], "usage": {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"]}}

    async def sessions():
        s = soak_mod.Soak("http://127.0.0.1:1", "tiny", limit, None, random.Random(3), 0.0, 10.0)
        for _ in range(40):
            await soak_mod.chat_session(s, None)

    original, soak_mod._post = soak_mod._post, fake_post
    original_sleep, soak_mod.asyncio.sleep = soak_mod.asyncio.sleep, lambda *_: original_sleep(0)
    try:
        asyncio.run(sessions())
    finally:
        soak_mod._post, soak_mod.asyncio.sleep = original, original_sleep
    assert len(sent) > 40 and max(sent) <= limit, (max(sent), limit)  # several turns each, none past the limit


# ---------------------------------------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ray_serve):
    """One disaggregated app (HTTP + gRPC, API key) on the session's Ray cluster, shared by the fuzz and the soak."""
    from cluster_harness import cluster_config, served_app

    from workers.models.make_model import make_model

    model = make_model(tmp_path_factory.mktemp("fuzz") / "tiny", "qwen3_moe", "tiny", seed=3)
    with served_app(ray_serve, cluster_config(model, name="fuzz"), "/") as app:
        yield {"base": app.base, "grpc": ray_serve.grpc, "key": app.config["server"]["api_keys"][0]}


@pytest.mark.cluster
def test_fuzz_end_to_end(cluster, tmp_path):
    out = tmp_path / "fuzz.json"
    # A loaded test machine can be slow: the 2 s rejection budget is the benchmark's, not this test's.
    rc = moray_main(
        [
            "bench",
            "fuzz",
            "--url",
            cluster["base"],
            "--grpc",
            cluster["grpc"],
            "--api-key",
            cluster["key"],
            # Enough for one case of every stratum (98 HTTP, 22 gRPC), fewer of the valid ones that generate.
            "--cases",
            "120",
            "--grpc-cases",
            "30",
            "--seed",
            "0",
            "--concurrency",
            "4",
            "--slow-rejection-s",
            "10",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "report"),
        ]
    )
    r = json.loads(out.read_text())
    assert r["cases_run"] == {"http": 120, "grpc": 30} and not r["stopped_by_time"]
    assert r["target"] == {"model": "tiny", "vocab_size": 512, "max_model_len": 256}
    for proto, n in (("http", 120), ("grpc", 30)):
        p = r[proto]
        assert p["cases"] == n == sum(p["by_status"].values()) == sum(sum(v.values()) for v in p["by_kind"].values())
        for key in (
            "server_errors",
            "server_error_examples",
            "server_error_groups",
            "timeouts",
            "malformed_responses",
            "slow_rejections",
            "slowest_rejection",
            "rejection_latency_p50_s",
            "rejection_latency_p99_s",
            "accepted_invalid",
            "rejected_valid",
        ):
            assert key in p
        assert p["slowest_rejection"]["latency_s"] >= p["rejection_latency_p99_s"] >= p["rejection_latency_p50_s"] > 0
        assert {"valid"} < set(p["by_kind"])
    assert r["http"]["by_status"].get("200", 0) > 0 and r["http"]["by_status"].get("400", 0) > 0
    assert r["grpc"]["by_status"].get("OK", 0) > 0 and r["grpc"]["by_status"].get("INVALID_ARGUMENT", 0) > 0
    assert r["server_ok_after"], r["server_check_problems"]
    assert r["check_after"]["completion_text"] == r["check_before"]["completion_text"] == r["check_after"]["grpc_completion_text"]
    # The one assertion that depends on the server's validation: nothing a client sends may cause a 5xx / INTERNAL / UNKNOWN.
    server_errors = r["http"]["server_error_examples"] + r["grpc"]["server_error_examples"]
    assert not server_errors, json.dumps(server_errors[:5], indent=1)
    assert rc == 0 and r["passed"], r["failures"]
    assert set(check_report(tmp_path / "report", min_plots=2)) == {"answers.png", "by_kind.png"}


def test_soak_end_to_end(cluster, tmp_path):
    out = tmp_path / "soak.json"
    rc = moray_main(
        [
            "bench",
            "soak",
            "--url",
            cluster["base"],
            "--grpc",
            cluster["grpc"],
            "--api-key",
            cluster["key"],
            "--minutes",
            "0.3",
            "--concurrency",
            "4",
            "--cancel-fraction",
            "0.2",
            "--json",
            str(out),
            "--report",
            str(tmp_path / "report"),
        ]
    )
    r = json.loads(out.read_text())
    assert r["requests"] == r["ok"] + r["failures"] + r["cancelled"] == sum(m["requests"] for m in r["per_minute"])
    assert r["ok"] > 0 and r["cancelled"] > 0
    assert {"completion", "chat", "chat_session_turn", "completion_session_turn", "grpc_generate"} <= {
        k.removesuffix("_stream") for k in r["by_kind"]
    }
    assert all(m["e2e_p99_s"] >= m["e2e_p50_s"] > 0 for m in r["per_minute"] if m["ok"])
    names = {p["name"] for p in r["rss_start"]["processes"].values()}
    assert {
        "ServeReplica:fuzz:Frontend",
        "ServeReplica:fuzz:Registry",
        "ServeReplica:fuzz:PrefillServer",
        "ServeReplica:fuzz:DecodeServer",
        "ProxyActor",
        "ServeController",
    } <= names, names
    assert "Ray node" in r["rss_start"]["scope"] and all(p["rss_bytes"] > 0 for p in r["rss_end"]["processes"].values())
    assert r["rss_growth_from_minute_2"]["per_process"]
    assert r["failures"] == 0, r["failure_examples"]
    kv = r["kv_after_drain"]
    assert kv["drained"] and kv["workers"], kv
    assert all(w["kv_cache_usage_ratio"] == 0 and w.get("kv_blocks_in_use", 0) == 0 for w in kv["workers"].values()), kv
    assert rc == 0 and r["passed"]
    assert set(check_report(tmp_path / "report", min_plots=2)) == {"per_minute.png", "rss.png"}
