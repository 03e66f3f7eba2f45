"""`moray bench soak`: a long mixed load against a running server, then a drain; finds leaks and drift.

`--concurrency` clients, each in a loop for `--minutes`, pick one of: a completion or a chat completion,
streamed or not; a multi-turn chat session (2-4 turns under one `x-session-id`, each turn sending the
previous replies back); a multi-turn completion session (a growing token prompt); with `--grpc`, gRPC
Generate (streamed) and Complete. A share of the requests (`--cancel-fraction`) is cancelled by the client:
a stream closed after its first events, a plain request abandoned after a short random wait. Prompts are
token ids over a few shared prefixes, so the prefix cache and the KV handoff are exercised; max_tokens is
small and ignore_eos is set, so every finished request must return exactly max_tokens tokens.

Reported: failures (a non-200 or non-OK answer, a stream that breaks off or carries an error event, a
wrong token count, a timeout) with examples; requests, p50/p99 end-to-end latency and TTFT per minute;
the RSS of every Moray process (the Serve replicas of Frontend / Registry / PrefillServer / DecodeServer, the Serve
proxy and controller, and the `moray serve` driver) every 30 s, with its growth from minute 2 to the end;
and after the load stops and the requests drain, every worker's KV cache use from /metrics
(`vllm:kv_cache_usage_perc`, `vllm:num_requests_running`, `vllm:num_requests_waiting`, and the router's
`active_decode_blocks`), waiting up to `--drain-timeout` for it to reach 0. Exit 1 when a request failed
or KV was still in use after the drain.

Processes are found from the URL's port: the process listening on it is the Serve proxy, its parent the
Ray node (raylet), whose Serve processes are this server's (other Ray clusters on the machine are left
out). psutil is used when installed, else /proc. Loopback servers only.

    moray bench soak --url http://127.0.0.1:8000 --minutes 30 --concurrency 16 --grpc 127.0.0.1:9000 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bench.fuzz import check_grpc_address, check_url
from bench.report import add_report_argument, report_if_asked
from bench.serve import pct

RSS_INTERVAL_S = 30.0
MORAY_TITLES = ("ray::ServeReplica:", "ray::ProxyActor", "ray::ServeController")
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="base URL of a running server on this machine, e.g. http://127.0.0.1:8000")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--grpc", help="gRPC address of the same server: a share of the load goes there too")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="share of requests the client cancels (default 0.1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one request may take before it counts as failed")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for KV use to reach 0 after the load")
    p.add_argument("--json", help="also write the JSON report here")
    add_report_argument(p)


# ------------------------------------------------------------------------------------ processes


def _proc_read(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


class ProcTable:
    """pid -> (ppid, title, rss bytes) for this machine's processes, from psutil or /proc."""

    def __init__(self):
        try:
            import psutil  # noqa: F401

            self.psutil = True
        except ImportError:
            self.psutil = False

    def listener(self, port: int) -> int | None:
        """The pid of the process listening on TCP `port` (None when not found or not visible)."""
        if self.psutil:
            import psutil

            try:
                for c in psutil.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                        return c.pid
            except (psutil.AccessDenied, OSError):
                pass
        return self._proc_listener(port)

    @staticmethod
    def _proc_listener(port: int) -> int | None:
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                lines = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(cols[9])
        if not inodes:
            return None
        targets = {f"socket:[{i}]" for i in inodes}
        for pid in _pids():
            try:
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                        return pid
            except OSError:
                continue
        return None

    def info(self, pid: int) -> tuple[int, str, int] | None:
        """(ppid, title, rss bytes), or None for a process that is gone."""
        if self.psutil:
            import psutil

            try:
                p = psutil.Process(pid)
                with p.oneshot():
                    return p.ppid(), " ".join(p.cmdline()).strip(), p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                return None
        try:
            stat = _proc_read(pid, "stat").decode(errors="replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            title = _proc_read(pid, "cmdline").replace(b"\0", b" ").decode(errors="replace").strip()
            rss = 0
            for line in _proc_read(pid, "status").decode(errors="replace").splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            return ppid, title, rss
        except (OSError, ValueError, IndexError):
            return None

    def all(self) -> dict[int, tuple[int, str, int]]:
        out = {}
        for pid in _pids():
            i = self.info(pid)
            if i is not None:
                out[pid] = i
        return out


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _label(title: str) -> str:
    """'ray::ServeReplica:moray:DecodeServer.generate' -> 'ServeReplica:moray:DecodeServer'."""
    name = title.split()[0] if title else ""
    name = name.removeprefix("ray::")
    head, _, tail = name.rpartition(":")
    return f"{head}:{tail.split('.', 1)[0]}" if head else name.split(".", 1)[0]


def moray_processes(url: str, table: ProcTable | None = None) -> dict:
    """{"scope": ..., "processes": {pid: {"name", "rss_bytes"}}} for the server behind `url`."""
    table = table or ProcTable()
    port = urlsplit(url).port or 80
    procs = table.all()
    proxy = table.listener(port)
    scope = "all matching processes of this machine (the server's Ray node was not found)"
    candidates = procs
    if proxy is not None and proxy in procs:
        raylet = procs[proxy][0]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [raylet]
        while todo:
            pid = todo.pop()
            for c in children.get(pid, []):
                if c not in tree:
                    tree.add(c)
                    todo.append(c)
        candidates = {pid: procs[pid] for pid in tree}
        scope = f"the Ray node (pid {raylet}) of the process listening on port {port} (pid {proxy})"
        driver = procs.get(raylet, (None,))[0]
        if driver in procs and any(s in procs[driver][1] for s in ("moray serve", "cluster.cli serve", "cluster.serve_cli")):
            candidates[driver] = procs[driver]
    out = {}
    for pid, (_, title, rss) in candidates.items():
        if title.startswith(MORAY_TITLES):
            out[pid] = {"name": _label(title), "rss_bytes": rss}
        elif any(s in title for s in ("moray serve", "cluster.cli serve", "cluster.serve_cli")):
            out[pid] = {"name": "moray-serve-driver", "rss_bytes": rss}
    return {"scope": scope, "processes": dict(sorted(out.items()))}


def rss_sample(url: str, t: float) -> dict:
    found = moray_processes(url)
    return {
        "t_s": round(t, 1),
        "scope": found["scope"],
        "processes": found["processes"],
        "total_bytes": sum(p["rss_bytes"] for p in found["processes"].values()),
    }


def rss_growth(samples: list[dict], from_s: float = 120.0) -> dict:
    """Per process (by pid) and in total: RSS at the first sample at or after `from_s` (else the first) and at the end."""
    if not samples:
        return {}
    start = next((s for s in samples if s["t_s"] >= from_s), samples[0])
    end = samples[-1]
    per = {}
    for pid, p in end["processes"].items():
        if pid in start["processes"]:
            a, b = start["processes"][pid]["rss_bytes"], p["rss_bytes"]
            per[f"{p['name']} ({pid})"] = {
                "from_bytes": a,
                "to_bytes": b,
                "growth_bytes": b - a,
                "growth_ratio": (b / a - 1) if a else None,
            }
    gone = [f"{p['name']} ({pid})" for pid, p in start["processes"].items() if pid not in end["processes"]]
    new = [f"{p['name']} ({pid})" for pid, p in end["processes"].items() if pid not in start["processes"]]
    total_a, total_b = start["total_bytes"], end["total_bytes"]
    return {
        "from_t_s": start["t_s"],
        "to_t_s": end["t_s"],
        "total_from_bytes": total_a,
        "total_to_bytes": total_b,
        "total_growth_bytes": total_b - total_a,
        "per_process": per,
        "processes_gone": gone,
        "processes_new": new,
    }


# ------------------------------------------------------------------------------------ /metrics


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        parsed = {}
        for part in labels.rstrip("}").split('",'):
            if "=" in part:
                k, _, v = part.partition("=")
                parsed[k.strip()] = v.strip().strip('"')
        try:
            out.setdefault(name, []).append((parsed, float(value)))
        except ValueError:
            continue
    return out


def kv_state(metrics_text: str) -> dict:
    """Per worker: KV use ratio, running and waiting requests, and (decode workers) the router's view of blocks in use."""
    m = parse_metrics(metrics_text)
    workers: dict[str, dict] = {}
    for name, key in (
        ("vllm:kv_cache_usage_perc", "kv_cache_usage_ratio"),
        ("vllm:num_requests_running", "running"),
        ("vllm:num_requests_waiting", "waiting"),
        # The host KV tier, where there is one: how full, and how much it did (no references to wait for).
        ("moray_kv_host_tier_usage_ratio", "host_kv_usage_ratio"),
        ("moray_kv_host_saved_blocks_total", "host_blocks_saved"),
        ("moray_kv_host_loaded_blocks_total", "host_blocks_loaded"),
        ("moray_kv_evicted_live_session_blocks_total", "evicted_live_session_blocks"),
    ):
        for labels, v in m.get(name, []):
            # vLLM's names label a worker `engine`; Moray's own, `worker`.
            w = workers.setdefault(labels.get("worker", labels.get("engine", "?")), {"role": labels.get("role")})
            w[key] = v
    for labels, v in m.get("moray_router_worker_load", []):
        if labels.get("field") == "active_decode_blocks":
            workers.setdefault(labels.get("worker", "?"), {"role": "decode"})["kv_blocks_in_use"] = int(v)
    busy = [
        w
        for w, s in workers.items()
        if s.get("kv_cache_usage_ratio", 0) > 0 or s.get("running", 0) > 0 or s.get("waiting", 0) > 0 or s.get("kv_blocks_in_use", 0) > 0
    ]
    return {"workers": workers, "busy_workers": busy, "drained": bool(workers) and not busy}


async def wait_drained(session, base: str, timeout: float) -> dict:
    """Polls /metrics until no worker holds KV or requests (or `timeout` passes); the last kv_state."""
    start = time.perf_counter()
    while True:
        status, text = await _get(session, base + "/metrics")
        kv = (
            kv_state(text)
            if status == 200
            else {"error": f"/metrics answered {status}", "drained": False, "workers": {}, "busy_workers": []}
        )
        if kv["drained"] or time.perf_counter() - start > timeout:
            return kv
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------ load


@dataclass
class Record:
    t_s: float  # start, from the beginning of the soak
    kind: str
    outcome: str  # ok | failed | cancelled
    e2e_s: float = 0.0
    ttft_s: float | None = None
    error: str = ""
    prompt_tokens: int = 0


@dataclass
class Soak:
    url: str
    model: str
    max_model_len: int
    api_key: str | None
    rng: random.Random
    cancel_fraction: float
    timeout: float
    t0: float = field(default_factory=time.perf_counter)
    records: list[Record] = field(default_factory=list)
    prefixes: list[list[int]] = field(default_factory=list)
    vocab: int = 500

    def headers(self, session_id: str | None = None) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        if session_id:
            h["x-session-id"] = session_id
        return h

    def tokens(self, k: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(k)]

    def words(self, k: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(k))

    def record(self, start: float, kind: str, outcome: str, **kw) -> Record:
        r = Record(round(start - self.t0, 3), kind, outcome, **kw)
        self.records.append(r)
        return r


async def _post(soak: Soak, session, path: str, body: dict, kind: str, session_id: str | None = None) -> dict | None:
    """One HTTP request (streamed when body["stream"]); returns the parsed result for a session's next turn."""
    import aiohttp

    stream = bool(body.get("stream"))
    cancel = soak.rng.random() < soak.cancel_fraction
    cancel_after = soak.rng.randint(1, 3)
    start = time.perf_counter()
    label = f"{kind}{'_stream' if stream else ''}"

    async def attempt() -> dict | None:
        async with session.post(
            soak.url + path, json=body, headers=soak.headers(session_id), timeout=aiohttp.ClientTimeout(total=soak.timeout)
        ) as r:
            if r.status != 200:
                soak.record(start, label, "failed", e2e_s=time.perf_counter() - start, error=f"HTTP {r.status}: {(await r.text())[:300]}")
                return None
            if not stream:
                data = await r.json()
                return _finish_plain(soak, start, label, body, data)
            events, text, usage, ttft, done = 0, [], None, None, False
            async for raw in r.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    soak.record(start, label, "failed", e2e_s=time.perf_counter() - start, error=f"error event: {line[:300]}")
                    return None
                if event.get("choices"):
                    events += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    c = event["choices"][0]
                    text.append(c.get("text") if "text" in c else (c.get("delta") or {}).get("content") or "")
                if event.get("usage"):
                    usage = event["usage"]
                if cancel and events >= cancel_after:
                    soak.record(start, label, "cancelled", e2e_s=time.perf_counter() - start, ttft_s=ttft)
                    return None  # leaving the block closes the connection: the server sees the client go
            e2e = time.perf_counter() - start
            if not done:
                soak.record(start, label, "failed", e2e_s=e2e, ttft_s=ttft, error="the stream ended without [DONE]")
                return None
            want = body.get("max_tokens")
            if usage is not None and want is not None and usage["completion_tokens"] != want:
                soak.record(
                    start,
                    label,
                    "failed",
                    e2e_s=e2e,
                    ttft_s=ttft,
                    error=f"{usage['completion_tokens']} tokens, asked for {want} (ignore_eos)",
                )
                return None
            soak.record(start, label, "ok", e2e_s=e2e, ttft_s=ttft, prompt_tokens=(usage or {}).get("prompt_tokens", 0))
            return {"text": "".join(text), "usage": usage}

    try:
        if cancel and not stream:
            try:
                # Some go away at once (while the ingress is still validating and routing), most a little later.
                wait = soak.rng.uniform(0.0, 0.01) if soak.rng.random() < 0.25 else soak.rng.uniform(0.02, 0.5)
                return await asyncio.wait_for(attempt(), wait)
            except asyncio.TimeoutError:
                soak.record(start, label, "cancelled", e2e_s=time.perf_counter() - start)
                return None
        return await attempt()
    except asyncio.TimeoutError:
        soak.record(start, label, "failed", e2e_s=time.perf_counter() - start, error=f"no answer within {soak.timeout:.0f}s")
    except (aiohttp.ClientError, json.JSONDecodeError, OSError) as e:
        soak.record(start, label, "failed", e2e_s=time.perf_counter() - start, error=f"{type(e).__name__}: {e}")
    return None


def _finish_plain(soak: Soak, start: float, label: str, body: dict, data: dict) -> dict | None:
    e2e = time.perf_counter() - start
    try:
        choice = data["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        usage = data["usage"]
    except (KeyError, IndexError, TypeError):
        soak.record(start, label, "failed", e2e_s=e2e, error=f"malformed response: {json.dumps(data)[:300]}")
        return None
    want = body.get("max_tokens")
    if want is not None and usage["completion_tokens"] != want:
        soak.record(start, label, "failed", e2e_s=e2e, error=f"{usage['completion_tokens']} tokens, asked for {want} (ignore_eos)")
        return None
    soak.record(start, label, "ok", e2e_s=e2e, prompt_tokens=usage.get("prompt_tokens", 0))
    return {"text": text, "usage": usage}


def _sampling(soak: Soak, max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": soak.rng.choice([0, 0, 0.8])}
    if soak.rng.random() < 0.5:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def completion(soak: Soak, session) -> None:
    prompt = soak.rng.choice(soak.prefixes) + soak.tokens(soak.rng.randint(4, 32))
    await _post(
        soak, session, "/v1/completions", {"model": soak.model, "prompt": prompt, **_sampling(soak, soak.rng.randint(2, 24))}, "completion"
    )


async def chat(soak: Soak, session) -> None:
    messages = [{"role": "system", "content": "You are a soak test."}, {"role": "user", "content": soak.words(soak.rng.randint(3, 20))}]
    await _post(
        soak,
        session,
        "/v1/chat/completions",
        {"model": soak.model, "messages": messages, **_sampling(soak, soak.rng.randint(2, 16))},
        "chat",
    )


# What a chat template adds around one more exchange (end of the reply, a user turn, the generation prompt),
# bounded by its bytes: a ChatML template adds about 40.
TEMPLATE_BYTES_PER_TURN = 64


async def chat_session(soak: Soak, session) -> None:
    """Turns of one conversation under one x-session-id: each sends the whole history, replies included.

    The session stays within the server's max_model_len (as /v1/models tells it): the next turn is sent only
    if this turn's prompt tokens, plus the reply and the next user message counted at one token per UTF-8
    byte (a byte-level BPE never makes more tokens than bytes), plus the template's bytes, plus its
    max_tokens fit. (Counting a reply as max_tokens tokens, as before, let a random model's replies, whose
    text re-encodes to more tokens than were generated, grow a session past the limit: a correct 400.)"""
    sid = f"soak-{soak.rng.getrandbits(48):012x}"
    messages = [{"role": "system", "content": "You are a soak test."}]
    user = soak.words(soak.rng.randint(3, 12))
    for _ in range(soak.rng.randint(2, 4)):
        messages.append({"role": "user", "content": user})
        max_tokens = soak.rng.randint(2, 12)
        body = {"model": soak.model, "messages": messages, **_sampling(soak, max_tokens)}
        out = await _post(soak, session, "/v1/chat/completions", body, "chat_session_turn", sid)
        if out is None or out["usage"] is None:
            return
        user, next_max = soak.words(soak.rng.randint(3, 12)), 12
        bound = out["usage"]["prompt_tokens"] + len(out["text"].encode()) + len(user.encode()) + TEMPLATE_BYTES_PER_TURN + next_max
        if bound > soak.max_model_len:
            return
        messages.append({"role": "assistant", "content": out["text"]})
        await asyncio.sleep(soak.rng.uniform(0, 0.3))  # the user reads, then types


async def completion_session(soak: Soak, session) -> None:
    sid = f"soak-{soak.rng.getrandbits(48):012x}"
    history = soak.rng.choice(soak.prefixes) + soak.tokens(8)
    for _ in range(soak.rng.randint(2, 4)):
        history = history + soak.tokens(soak.rng.randint(4, 16))
        max_tokens = soak.rng.randint(2, 12)
        if len(history) + max_tokens > soak.max_model_len - 1:
            return
        out = await _post(
            soak,
            session,
            "/v1/completions",
            {"model": soak.model, "prompt": history, **_sampling(soak, max_tokens)},
            "completion_session_turn",
            sid,
        )
        if out is None:
            return
        history = history + soak.tokens(max_tokens)  # stands in for the reply (its ids are not returned)


async def grpc_call(soak: Soak, channel) -> None:
    import grpc

    from protos.moray.v1 import moray_pb2, moray_pb2_grpc

    stub = moray_pb2_grpc.MorayStub(channel)
    max_tokens = soak.rng.randint(2, 16)
    req = moray_pb2.GenerateRequest(
        model=soak.model,
        token_ids=moray_pb2.TokenIds(ids=soak.rng.choice(soak.prefixes) + soak.tokens(soak.rng.randint(4, 24))),
        sampling=moray_pb2.SamplingOptions(max_tokens=max_tokens, ignore_eos=True, temperature=soak.rng.choice([0.0, 0.8])),
    )
    md = (("authorization", f"Bearer {soak.api_key}"),) if soak.api_key else ()
    cancel = soak.rng.random() < soak.cancel_fraction
    start = time.perf_counter()
    streamed = soak.rng.random() < 0.6
    label = "grpc_generate" if streamed else "grpc_complete"
    try:
        if streamed:
            call = stub.Generate(req, metadata=md, timeout=soak.timeout)
            got, ttft, last = 0, None, None
            async for msg in call:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                got += len(msg.token_ids)
                last = msg
                if cancel and got >= 1:
                    call.cancel()
                    soak.record(start, label, "cancelled", e2e_s=time.perf_counter() - start, ttft_s=ttft)
                    return
            if last is None or not last.finished or last.usage.completion_tokens != max_tokens:
                soak.record(
                    start,
                    label,
                    "failed",
                    e2e_s=time.perf_counter() - start,
                    error=f"stream ended unfinished or with the wrong count: {last}",
                )
                return
            soak.record(start, label, "ok", e2e_s=time.perf_counter() - start, ttft_s=ttft, prompt_tokens=last.usage.prompt_tokens)
            return
        task = asyncio.ensure_future(stub.Complete(req, metadata=md, timeout=soak.timeout))
        if cancel:
            await asyncio.sleep(soak.rng.uniform(0.02, 0.5))
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, grpc.aio.AioRpcError):
                    pass
                soak.record(start, label, "cancelled", e2e_s=time.perf_counter() - start)
                return
        resp = await task
        if resp.usage.completion_tokens != max_tokens:
            soak.record(
                start,
                label,
                "failed",
                e2e_s=time.perf_counter() - start,
                error=f"{resp.usage.completion_tokens} tokens, asked for {max_tokens}",
            )
            return
        soak.record(start, label, "ok", e2e_s=time.perf_counter() - start, prompt_tokens=resp.usage.prompt_tokens)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and cancel:
            soak.record(start, label, "cancelled", e2e_s=time.perf_counter() - start)
            return
        soak.record(start, label, "failed", e2e_s=time.perf_counter() - start, error=f"{e.code().name}: {e.details()}")


async def client_loop(soak: Soak, session, channel, deadline: float) -> None:
    scenarios = [completion, completion, chat, chat_session, completion_session]
    while time.perf_counter() < deadline:
        if channel is not None and soak.rng.random() < 0.2:
            await grpc_call(soak, channel)
        else:
            await soak.rng.choice(scenarios)(soak, session)


# ------------------------------------------------------------------------------------ report


def per_minute(records: list[Record]) -> list[dict]:
    minutes: dict[int, list[Record]] = {}
    for r in records:
        minutes.setdefault(int(r.t_s // 60), []).append(r)
    out = []
    for m in sorted(minutes):
        rs = minutes[m]
        ok = [r for r in rs if r.outcome == "ok"]
        e2e = [r.e2e_s for r in ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        out.append(
            {
                "minute": m,
                "requests": len(rs),
                "ok": len(ok),
                "failed": sum(r.outcome == "failed" for r in rs),
                "cancelled": sum(r.outcome == "cancelled" for r in rs),
                "e2e_p50_s": round(pct(e2e, 50), 4),
                "e2e_p99_s": round(pct(e2e, 99), 4),
                "ttft_p50_s": round(pct(ttft, 50), 4),
                "ttft_p99_s": round(pct(ttft, 99), 4),
            }
        )
    return out


def _progress(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


async def _get(session, url: str, key: str | None = None):
    import aiohttp

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
        return r.status, await r.text()


async def soak_run(args: argparse.Namespace, base: str) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    channel = None
    if args.grpc:
        import grpc

        channel = grpc.aio.insecure_channel(args.grpc)
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        status, text = await _get(session, base + "/health")
        if status != 200:
            raise RuntimeError(f"{base}/health answered {status}: {text[:200]}")
        status, text = await _get(session, base + "/v1/models", args.api_key)
        card = json.loads(text)["data"][0]
        soak = Soak(base, card["id"], int(card.get("max_model_len") or 2048), args.api_key, rng, args.cancel_fraction, args.timeout)
        soak.prefixes = [soak.tokens(32) for _ in range(8)]
        loop = asyncio.get_running_loop()
        status, text = await _get(session, base + "/metrics")
        kv_before = kv_state(text) if status == 200 else {"error": f"/metrics answered {status}"}
        samples = [await loop.run_in_executor(None, rss_sample, base, 0.0)]
        _progress(
            f"{len(samples[0]['processes'])} Moray processes ({samples[0]['scope']}); {args.concurrency} clients for {args.minutes} min"
        )
        duration = args.minutes * 60
        deadline = soak.t0 + duration

        async def sampler():
            next_at = RSS_INTERVAL_S
            while True:
                await asyncio.sleep(max(0.0, soak.t0 + next_at - time.perf_counter()))
                samples.append(await loop.run_in_executor(None, rss_sample, base, time.perf_counter() - soak.t0))
                rs = soak.records
                _progress(
                    f"{time.perf_counter() - soak.t0:.0f}s: {len(rs)} requests, {sum(r.outcome == 'failed' for r in rs)} failed, "
                    f"{sum(r.outcome == 'cancelled' for r in rs)} cancelled, RSS {samples[-1]['total_bytes'] / 2**20:.0f} MiB"
                )
                next_at += RSS_INTERVAL_S

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*(client_loop(soak, session, channel, deadline) for _ in range(args.concurrency)))
        load_end = time.perf_counter()
        sampling.cancel()
        _progress(f"load stopped after {load_end - soak.t0:.0f}s; draining")
        kv = await wait_drained(session, base, args.drain_timeout)
        drain_s = time.perf_counter() - load_end
        samples.append(await loop.run_in_executor(None, rss_sample, base, time.perf_counter() - soak.t0))
        status, health = await _get(session, base + "/health")
    if channel is not None:
        await channel.close()
    records = soak.records
    failed = [r for r in records if r.outcome == "failed"]
    ok = [r for r in records if r.outcome == "ok"]
    kinds: dict[str, dict[str, int]] = {}
    for r in records:
        kinds.setdefault(r.kind, {"ok": 0, "failed": 0, "cancelled": 0})[r.outcome] += 1
    report = {
        "url": base,
        "grpc": args.grpc,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "cancel_fraction": args.cancel_fraction,
        "model": soak.model,
        "max_model_len": soak.max_model_len,
        "wall_s": round(time.perf_counter() - soak.t0, 1),
        "load_s": round(load_end - soak.t0, 1),
        "requests": len(records),
        "ok": len(ok),
        "failures": len(failed),
        "cancelled": sum(r.outcome == "cancelled" for r in records),
        "by_kind": dict(sorted(kinds.items())),
        "failure_examples": [{"t_s": r.t_s, "kind": r.kind, "error": r.error} for r in failed[:30]],
        "e2e_p50_s": round(pct([r.e2e_s for r in ok], 50), 4),
        "e2e_p99_s": round(pct([r.e2e_s for r in ok], 99), 4),
        "per_minute": per_minute(records),
        "rss_start": samples[0],
        "rss_end": samples[-1],
        "rss_timeline": [
            {
                "t_s": s["t_s"],
                "total_bytes": s["total_bytes"],
                "by_process": {f"{p['name']} ({pid})": p["rss_bytes"] for pid, p in s["processes"].items()},
            }
            for s in samples
        ],
        "rss_growth_from_minute_2": rss_growth(samples, 120.0),
        "kv_before": kv_before,
        "kv_after_drain": {**kv, "drain_s": round(drain_s, 2)},
        "health_after": {"status": status, "body": health[:200]},
    }
    report["passed"] = not failed and bool(kv.get("drained")) and status == 200
    return report


def run(args: argparse.Namespace) -> int:
    base = check_url(args.url)
    if args.grpc:
        check_grpc_address(args.grpc)
    if args.minutes <= 0 or args.concurrency <= 0:
        raise ValueError("--minutes and --concurrency must be positive")
    report = asyncio.run(soak_run(args, base))
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    report_if_asked(args, "soak", report)
    _progress(
        f"{report['requests']} requests, {report['failures']} failed, {report['cancelled']} cancelled; KV drained: "
        f"{report['kv_after_drain'].get('drained')} ({report['kv_after_drain']['drain_s']}s); {'PASSED' if report['passed'] else 'FAILED'}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
