"""Shared helpers of the router tests: KV events, a simulated worker over a real KVCacheManager, and a
private redis-server."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

from cluster.router import RedisKVIndex, WorkerLoad
from cluster.router.redis_conn import connect
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.kv_events import KVEvent, KVEventKind, KVEventPublisher
from workers.engine.request import Request
from workers.engine.sampling_params import SamplingParams
from workers.parallel import free_port

BS = 16
MODEL = "tiny-moe"
REDIS_SERVER = shutil.which("redis-server")


def stored(worker: str, hashes: list[int], epoch: int = 1, start_seq: int = 0, tier: str = "device") -> list[KVEvent]:
    return [KVEvent(worker, epoch, start_seq + i, KVEventKind.STORED, h, 0, BS, tier, 0.0) for i, h in enumerate(hashes)]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 30_000) for _ in range(n)]


class SimWorker:
    """A decode worker reduced to its KV cache: a real KVCacheManager (prefix cache, LRU eviction, events)
    serving requests whose prefill is instant-ish and whose decode runs one token per tick."""

    def __init__(self, worker_id: str, num_blocks: int = 8192):
        self.id = worker_id
        self.events = KVEventPublisher(worker_id, epoch=1)
        self.kv = KVCacheManager(num_blocks, BS, True, MODEL, self.events)
        self.running: list[tuple[Request, int]] = []  # (request, ticks left)
        self.prefill_backlog = 0  # uncached prompt tokens waiting to be prefilled
        self.work = 0.0  # load integrated over time

    def admit(self, rid: str, prompt: list[int], output: list[int]) -> int:
        """Allocates the prompt (taking its cached prefix); returns the cached tokens the engine reused."""
        r = Request(rid, list(prompt), SamplingParams())
        prefix = self.kv.cached_prefix(r)
        r.num_computed_tokens = min(len(prefix) * BS, len(prompt) - 1)
        assert self.kv.allocate(r, len(prompt) - r.num_computed_tokens, prefix) is not None
        reused = r.num_computed_tokens
        r.num_computed_tokens = len(prompt)
        self.kv.cache_full_blocks(r)
        self.prefill_backlog += len(prompt) - reused
        r.output_token_ids = list(output)  # produced over the next len(output) ticks
        self.running.append((r, len(output)))
        return reused

    def tick(self, prefill_rate: int = 2048) -> None:
        self.prefill_backlog = max(0, self.prefill_backlog - prefill_rate)
        still = []
        for r, left in self.running:
            if left > 1:
                still.append((r, left - 1))
            else:  # finished: its whole sequence (minus the last token) is computed and cached, then freed
                assert self.kv.allocate(r, len(r.output_token_ids) - 1) is not None
                r.num_computed_tokens = r.num_tokens - 1
                self.kv.cache_full_blocks(r)
                self.kv.free(r)
        self.running = still
        self.work += self.load_blocks()

    def load_blocks(self) -> float:
        return self.active_blocks() + self.prefill_backlog / BS

    def active_blocks(self) -> int:
        return sum(-(-(len(r.prompt_token_ids) + len(r.output_token_ids) - left) // BS) for r, left in self.running)

    def load(self, ts: float) -> WorkerLoad:
        return WorkerLoad(
            self.id,
            "decode",
            inflight_prefill_tokens=self.prefill_backlog,
            active_decode_blocks=self.active_blocks(),
            kv_usage=self.kv.usage,
            ts=ts,
        )


class RedisServer:
    """A private redis-server: no persistence (a restart loses everything, the worst case)."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None, tls: bool = False):
        self.tmp, self.args, self.tls = tmp, args, tls
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        port_args = ["--port", "0", "--tls-port", str(self.port)] if self.tls else ["--port", str(self.port)]
        self.log = open(self.tmp / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, *port_args, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.tmp), *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.tmp / f'redis-{self.port}.log').read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    if not self.tls:  # an answer (+PONG, or -NOAUTH) means it is serving
                        sock.sendall(b"PING\r\n")
                        if not sock.recv(64):
                            raise OSError("closed")
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.log.close()

    def url(self, userinfo: str = "") -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}/0"


def redis_index(server, **kw) -> RedisKVIndex:
    kw.setdefault("load_cache_s", 0)  # tests change loads between lookups
    return RedisKVIndex(connect(server.url(), 2.0), MODEL, **kw)
