"""Writes the chart's Grafana dashboard, helm/moray/dashboards/moray.json (`make helm-dashboard`).

The dashboard reads what the ingress serves at /metrics: vLLM's names for what vLLM also measures (so
panels match GKE's vLLM dashboard), `moray_` names for the router, KV handoff, host tier and Redis index.
Generated rather than hand-edited so every panel has the same shape and the queries stay greppable;
tests/test_helm.py checks the file is current and that every query names a metric the server exports.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "moray" / "dashboards" / "moray.json"
SEL = '{model_name=~"$model_name"}'  # vLLM-named series carry the served model
WINDOW = "$__rate_interval"


def rate(metric: str, by: str = "", selector: str = "") -> str:
    grouped = f" by ({by})" if by else ""
    return f"sum{grouped}(rate({metric}{selector}[{WINDOW}]))"


def quantile(q: float, metric: str, by: str = "", selector: str = SEL) -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) (rate({metric}_bucket{selector}[{WINDOW}])))"


def ratio(num: str, den: str) -> str:
    return f"{num} / clamp_min({den}, 1e-9)"


def target(expr: str, legend: str) -> dict:
    return {"expr": expr, "legendFormat": legend, "refId": "", "datasource": {"type": "prometheus", "uid": "${datasource}"}}


def timeseries(title: str, description: str, unit: str, targets: list[dict], w: int = 12, h: int = 8) -> dict:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
        "targets": targets,
        "gridPos": {"w": w, "h": h},
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def percentiles(metric: str, what: str) -> list[dict]:
    return [target(quantile(q, metric), f"{what} p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


PANELS = [
    row("Throughput and latency"),
    timeseries(
        "Token throughput",
        "Prompt and generated tokens per second over the cluster.",
        "tokens/s",
        [
            target(rate("vllm:generation_tokens_total", selector=SEL), "generated"),
            target(rate("vllm:prompt_tokens_total", selector=SEL), "prompt"),
            target(rate("moray_cached_prompt_tokens_total"), "prompt, from a prefix cache"),
        ],
    ),
    timeseries(
        "Requests",
        "Finished requests per second by finish reason, and requests that did not finish by outcome.",
        "reqps",
        [
            target(rate("vllm:request_success_total", "finished_reason", SEL), "{{finished_reason}}"),
            target(rate("moray_request_failures_total", "outcome"), "failed: {{outcome}}"),
            target(rate("moray_rejected_requests_total", "reason"), "rejected: {{reason}}"),
        ],
    ),
    timeseries(
        "Time to first token",
        "TTFT percentiles, and p99 by prefill path (local, or disaggregated with a KV handoff).",
        "s",
        [
            *percentiles("vllm:time_to_first_token_seconds", "TTFT"),
            target(quantile(0.99, "vllm:time_to_first_token_seconds", "path"), "TTFT p99 {{path}}"),
        ],
    ),
    timeseries(
        "Inter-token latency",
        "Time between streamed tokens (ITL) and per request (mean time per output token after the first).",
        "s",
        [
            *percentiles("vllm:inter_token_latency_seconds", "ITL"),
            target(quantile(0.99, "vllm:request_time_per_output_token_seconds"), "TPOT p99"),
        ],
    ),
    timeseries(
        "End-to-end latency",
        "Request latency from arrival at the ingress to the last token.",
        "s",
        percentiles("vllm:e2e_request_latency_seconds", "e2e"),
    ),
    timeseries(
        "Request phases",
        "Median time per request waiting for its first engine step (queue), from there to the first token (prefill), "
        "and from the first token to the last (decode); the median number of tokens requests asked for.",
        "s",
        [
            target(quantile(0.5, "vllm:request_queue_time_seconds"), "queue p50"),
            target(quantile(0.5, "vllm:request_prefill_time_seconds"), "prefill p50"),
            target(quantile(0.5, "vllm:request_decode_time_seconds"), "decode p50"),
            target(quantile(0.99, "vllm:request_queue_time_seconds"), "queue p99"),
        ],
    ),
    timeseries(
        "Requested generation tokens",
        "max_tokens per request (p50 and p99): how long the clients let their requests run.",
        "short",
        [
            target(quantile(0.5, "vllm:request_max_num_generation_tokens"), "max_tokens p50"),
            target(quantile(0.99, "vllm:request_max_num_generation_tokens"), "max_tokens p99"),
        ],
    ),
    row("Queues and KV cache"),
    timeseries(
        "Queue",
        "Requests waiting and running per pool, and requests the ingress admitted that have no first token yet.",
        "short",
        [
            target(f"sum by (role) (vllm:num_requests_waiting{SEL})", "waiting ({{role}})"),
            target(f"sum by (role) (vllm:num_requests_running{SEL})", "running ({{role}})"),
            target("sum(moray_ingress_queued_requests)", "ingress: no first token yet"),
            target(rate("vllm:num_preemptions_total", "role", SEL), "preemptions/s ({{role}})"),
        ],
    ),
    timeseries(
        "KV cache usage by pool",
        "Fraction of device KV blocks in use (mean and fullest worker per pool), and of the host tier.",
        "percentunit",
        [
            target(f"avg by (role) (vllm:kv_cache_usage_perc{SEL})", "device mean ({{role}})"),
            target(f"max by (role) (vllm:kv_cache_usage_perc{SEL})", "device max ({{role}})"),
            target("avg by (role) (moray_kv_host_tier_usage_ratio)", "host tier mean ({{role}})"),
        ],
    ),
    timeseries(
        "Prefix-cache hit rate by tier",
        "Prompt tokens found cached over prompt tokens looked up: in device memory, and copied back from the host tier.",
        "percentunit",
        [
            target(
                ratio(
                    f"({rate('vllm:prefix_cache_hits_total', selector=SEL)} - {rate('moray_prefix_cache_host_hit_tokens_total')})",
                    rate("vllm:prefix_cache_queries_total", selector=SEL),
                ),
                "device",
            ),
            target(
                ratio(rate("moray_prefix_cache_host_hit_tokens_total"), rate("vllm:prefix_cache_queries_total", selector=SEL)), "host tier"
            ),
            target(
                ratio(rate("vllm:prefix_cache_hits_total", selector=SEL), rate("vllm:prefix_cache_queries_total", selector=SEL)), "total"
            ),
        ],
    ),
    timeseries(
        "Speculative decoding",
        "Share of draft tokens the target accepted, and mean tokens per verify run (1 + accepted / drafts; 1 = no gain).",
        "short",
        [
            target(
                ratio(
                    rate("vllm:spec_decode_num_accepted_tokens_total", selector=SEL),
                    rate("vllm:spec_decode_num_draft_tokens_total", selector=SEL),
                ),
                "acceptance rate",
            ),
            target(
                f"1 + {ratio(rate('vllm:spec_decode_num_accepted_tokens_total', selector=SEL), rate('vllm:spec_decode_num_drafts_total', selector=SEL))}",
                "mean acceptance length",
            ),
        ],
    ),
    timeseries(
        "Host KV tier traffic",
        "Blocks per second saved to, loaded from and evicted by the host tier; live-session evictions are the last resort.",
        "short",
        [
            target(rate("moray_kv_host_saved_blocks_total"), "saved"),
            target(rate("moray_kv_host_loaded_blocks_total"), "loaded"),
            target(rate("moray_kv_host_evicted_blocks_total"), "evicted"),
            target(rate("moray_kv_evicted_live_session_blocks_total"), "evicted while the session was live"),
        ],
    ),
    row("Router"),
    timeseries(
        "Router decisions",
        "Routing decisions per second by policy and the branch that decided, and where prompts were prefilled.",
        "short",
        [
            target(rate("moray_router_decisions_total", "policy, branch"), "{{policy}}: {{branch}}"),
            target(rate("moray_router_prefill_total", "where"), "prefill: {{where}}"),
            target(rate("moray_router_redis_degraded_total"), "by load alone (index down)"),
        ],
    ),
    timeseries(
        "Cached tokens: best vs chosen vs reused",
        "Prefix tokens cached on the best live worker, on the chosen one, and those the engines actually reused.",
        "tokens/s",
        [
            target(rate("moray_router_cached_tokens_best_total"), "best candidate"),
            target(rate("moray_router_cached_tokens_chosen_total"), "chosen worker"),
            target(rate("moray_router_reused_tokens_total"), "reused by the engine"),
        ],
    ),
    timeseries(
        "Load per decode worker",
        "Prompt tokens routed to each decode worker per second (balance), and the router's decision time p99.",
        "short",
        [
            target(rate("moray_router_routed_prompt_tokens_total", "worker"), "{{worker}}"),
            target(quantile(0.99, "moray_router_decision_seconds", selector="") + " * 1000", "decision p99 (ms)"),
        ],
    ),
    row("KV handoff and the Redis index"),
    timeseries(
        "KV handoff",
        "Bytes per second decode workers imported from prefill workers, and the mean time of one handoff.",
        "Bps",
        [
            target(rate("moray_kv_handoff_bytes_total"), "bytes/s"),
            target(rate("moray_kv_handoff_state_bytes_total"), "of which linear-attention state"),
        ],
    ),
    timeseries(
        "KV handoff time",
        "Mean seconds per handoff, and handoffs per second.",
        "s",
        [
            target(ratio(rate("moray_kv_handoff_seconds_total"), rate("moray_kv_handoffs_total")), "mean handoff time"),
            target(rate("moray_kv_handoffs_total"), "handoffs/s"),
        ],
    ),
    timeseries(
        "Redis KV index health",
        "1 while the index answers; the age of workers' KV events when they reached it; errors and purges.",
        "short",
        [
            target("min(moray_router_index_up)", "index up"),
            target("max(moray_router_index_lag_seconds)", "max event lag (s)"),
            target(rate("moray_router_index_errors_total", "op"), "errors/s ({{op}})"),
            target(rate("moray_router_index_purges_total", "reason"), "purges/s ({{reason}})"),
            target("sum(moray_router_live_workers)", "live workers"),
        ],
    ),
    timeseries(
        "Failures",
        "Workers dropped after a failed call, requests moved to another worker, misrouted requests.",
        "short",
        [
            target(rate("moray_router_worker_failures_total"), "workers dropped/s"),
            target(rate("moray_failovers_total", "result"), "failovers/s ({{result}})"),
            target(rate("moray_misrouted_requests_total"), "misrouted/s"),
            target(rate("moray_request_timeouts_total", "stage"), "timeouts/s ({{stage}})"),
        ],
    ),
]


def layout(panels: list[dict]) -> list[dict]:
    """Ids, refIds and grid positions: a row spans the width, panels fill lines of 24 columns below it."""
    x = y = line_h = 0
    out = []
    for i, panel in enumerate(panels, start=1):
        panel = json.loads(json.dumps(panel))
        w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
        if panel["type"] == "row" or x + w > 24:  # start a new line
            y, x, line_h = y + line_h, 0, 0
        panel["id"] = i
        panel["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
        for j, t in enumerate(panel.get("targets", [])):
            t["refId"] = chr(ord("A") + j)
        x, line_h = x + w, max(line_h, h)
        out.append(panel)
    return out


def dashboard() -> dict:
    return {
        "uid": "moray-overview",
        "title": "Moray: MoE serving",
        "description": "Throughput, latency, queues, KV cache, prefix hits by tier, router decisions, KV handoff and the Redis index.",
        "tags": ["moray", "vllm", "llm-serving"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "model_name",
                    "type": "query",
                    "label": "Model",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {"query": "label_values(vllm:prompt_tokens_total, model_name)", "refId": "model_name"},
                    "definition": "label_values(vllm:prompt_tokens_total, model_name)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": layout(PANELS),
    }


def queried_metrics(board: dict) -> set[str]:
    """Every series name the dashboard's queries read (as a scrape shows it: with `_total`, `_bucket`)."""
    import re

    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return {name for e in exprs for name in re.findall(r"\b(?:vllm:|moray_)[a-z0-9_]+", e)}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
