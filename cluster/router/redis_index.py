"""`RedisKVIndex`: the KV index in Redis, shared by any number of router replicas.

Why the index itself lives in Redis (and not only an event stream each router replays): a router replica
that starts late, or restarts, reads the current cache state at once, with no replay and no dependence on
how much history a bounded stream kept. The workers' event sinks (`publisher.RedisKVEventSink`) write it
directly, one Lua call per batch of events, which also appends the batch to the model's stream for
anything that wants a local copy (`publisher.KVEventStreamConsumer`).

Layout (every key carries the model as a hash tag `{model}`, so in a Redis Cluster a model's keys share
one slot and the Lua scripts can touch them all; scripts declare `workers:{model}` as their key):

  kv:{model}:<hash>           HASH  "<worker>@<tier>" -> generation. A block (16-hex-digit chained hash)
                                    and who holds it in which tier (device, host, ...). An entry counts
                                    only while its generation equals the worker's current one.
  wblocks:{model}:<w>:<gen>   SET   "<hash>@<tier>": the reverse index of one worker generation (purges,
                                    snapshots).
  wstate:{model}:<w>          HASH  epoch, seq (last applied event), gen, ts: the worker's index position.
  sweep:{model}               LIST  "<w>|<gen>": superseded generations whose entries are still to delete.
  spec:{model}:<hash>         HASH  worker -> expiry (ms, server clock), PEXPIRE ttl: speculative entries
                                    for blocks a chosen worker is about to compute.
  load:{model}:<w>            HASH  the worker's WorkerLoad, PEXPIRE heartbeat TTL: the heartbeat. No key,
                                    no live worker: its entries are ignored and nothing routes to it.
  workers:{model}             SET   workers that ever heartbeated (to enumerate live ones without SCAN).
  sess:{model}:<session>      HASH  worker -> last use (ms), PEXPIRE session TTL.
  events:{model}              STREAM  one entry per batch, MAXLEN ~ stream_maxlen: t=e (events:
                                    w, ep, s = first seq, ts, d = "kind,hash,tier,...") or t=s (snapshot:
                                    w, ep, s = last seq, r = reset, d = "hash,tier,...").

Purges are O(1): a new epoch, a sequence gap, a `cleared` event or `remove_worker` bumps the worker's
generation, which invalidates all its entries at once; the old generation's entries are deleted a few
hundred per write call afterwards (`sweep`), so a worker with 100k cached blocks restarting never stalls
Redis (and with it every router's lookup).

Lookups: `LOOKUP` walks the request's chain server-side for every live worker at once (each drops out at
its first miss) and returns the matches, every live worker's load and the session's workers: one round
trip per routing decision. The server's clock (TIME) dates speculative entries, so router replicas on
different machines agree on what has expired.
"""

from __future__ import annotations

import re
from typing import Iterable

import redis
from redis.exceptions import NoScriptError, RedisError

from workers.engine.kv_events import KVEvent, KVEventKind

from .redis_conn import CircuitBreaker, LuaScript
from .types import Lookup, PrefixMatch, WorkerLoad

_KIND_CODE = {KVEventKind.STORED: "s", KVEventKind.REMOVED: "r", KVEventKind.CLEARED: "c"}
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:/-]+$")
SWEEP_BUDGET = 256  # superseded entries each write script deletes (the scripts say 256 too)

# Helpers shared by the scripts. ARGV[1] is always the hash tag "{model}".
_LUA_COMMON = r"""
local tag = ARGV[1]
local function key(kind, x) return kind .. ':' .. tag .. ':' .. x end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- O(1) purge: a new generation; the old one's entries stop counting and are swept later.
local function purge(w)
  local skey = key('wstate', w)
  local gen = tonumber(redis.call('HGET', skey, 'gen') or '0')
  if redis.call('EXISTS', key('wblocks', w .. ':' .. gen)) == 1 then
    redis.call('RPUSH', 'sweep:' .. tag, w .. '|' .. gen)
  end
  redis.call('HSET', skey, 'gen', gen + 1)
  return gen + 1
end
local function sweep(budget)
  while budget > 0 do
    local item = redis.call('LINDEX', 'sweep:' .. tag, 0)
    if not item then return end
    local bar = string.find(item, '|', 1, true)
    local w, g = string.sub(item, 1, bar - 1), string.sub(item, bar + 1)
    local set = key('wblocks', w .. ':' .. g)
    local members = redis.call('SPOP', set, budget)
    for _, m in ipairs(members) do
      local at = string.find(m, '@', 1, true)
      local k, field = key('kv', string.sub(m, 1, at - 1)), w .. string.sub(m, at)
      if redis.call('HGET', k, field) == g then redis.call('HDEL', k, field) end
    end
    budget = budget - #members
    if redis.call('EXISTS', set) == 0 then redis.call('LPOP', 'sweep:' .. tag) end
  end
end
"""

# KEYS[1] workers set. ARGV: tag, session ('' = none), block hashes...
# Returns {matches = {w, blocks, offloaded, ...}, loads = {w, {field, value, ...}, ...}, session workers}.
LOOKUP = LuaScript(_LUA_COMMON + r"""
local now = now_ms()
local loads, gens = {}, {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local l = redis.call('HGETALL', key('load', w))
  if #l > 0 then
    gens[w] = redis.call('HGET', key('wstate', w), 'gen') or '0'
    loads[#loads + 1] = w
    loads[#loads + 1] = l
  end
end
local matches, active = {}, nil
local n = #ARGV - 2
for i = 1, n do
  local h = ARGV[i + 2]
  local held = {}  -- worker -> 'd' (device or speculative) | 'o' (offloaded tiers only)
  local f = redis.call('HGETALL', key('kv', h))
  for j = 1, #f, 2 do
    local at = string.find(f[j], '@', 1, true)  -- worker ids never contain '@'
    local w = string.sub(f[j], 1, at - 1)
    if gens[w] == f[j + 1] then
      if string.sub(f[j], at + 1) == 'device' then held[w] = 'd' elseif held[w] == nil then held[w] = 'o' end
    end
  end
  local spec = redis.call('HGETALL', key('spec', h))
  for j = 1, #spec, 2 do
    if gens[spec[j]] and tonumber(spec[j + 1]) > now then held[spec[j]] = 'd' end
  end
  if active == nil then
    active = {}
    for w, _ in pairs(held) do active[w] = 0 end
  end
  local any = false
  for w, off in pairs(active) do
    local t = held[w]
    if t == nil then
      matches[#matches + 1] = w; matches[#matches + 1] = i - 1; matches[#matches + 1] = off
      active[w] = nil
    else
      if t == 'o' then active[w] = off + 1 end
      any = true
    end
  end
  if not any then break end
end
for w, off in pairs(active or {}) do
  matches[#matches + 1] = w; matches[#matches + 1] = n; matches[#matches + 1] = off
end
local sess = {}
if ARGV[2] ~= '' then sess = redis.call('HKEYS', key('sess', ARGV[2])) end
return {matches, loads, sess}
""")

# KEYS[1] workers set. ARGV: tag, worker, epoch, first seq, strict, stream maxlen (0 = no stream),
# oldest event time, then (kind, hash, tier) per event, seq = first seq + position.
# strict=1 (the worker's sink): a gap or unknown start returns 'resync' and changes nothing; the sink
# then ships a snapshot. strict=0: a gap purges the worker and applies what follows.
# Returns {result, last seq}: result ok | dup | resync | gap | epoch.
APPLY = LuaScript(_LUA_COMMON + r"""
local w, epoch, first, strict = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
local last = first + (#ARGV - 7) / 3 - 1
local skey = key('wstate', w)
local st = redis.call('HMGET', skey, 'epoch', 'seq', 'gen')
local gen = tonumber(st[3] or '0')
local result, skip = 'ok', 0
if st[1] ~= epoch then
  if strict and first ~= 0 then return {'resync', -1} end
  if st[1] then gen = purge(w); result = 'epoch' end
else
  local seq = tonumber(st[2])
  if last <= seq then return {'dup', seq} end
  if first > seq + 1 then
    if strict then return {'resync', seq} end
    gen = purge(w); result = 'gap'
  else
    skip = seq + 1 - first
  end
end
local now = now_ms()
local rset = key('wblocks', w .. ':' .. gen)
for i = 8 + skip * 3, #ARGV, 3 do
  local kind, h, tier = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if kind == 's' then
    redis.call('HSET', key('kv', h), w .. '@' .. tier, gen)
    redis.call('SADD', rset, h .. '@' .. tier)
    redis.call('HDEL', key('spec', h), w)
  elseif kind == 'r' then
    redis.call('HDEL', key('kv', h), w .. '@' .. tier)
    redis.call('SREM', rset, h .. '@' .. tier)
  else
    gen = purge(w)
    rset = key('wblocks', w .. ':' .. gen)
  end
end
redis.call('HSET', skey, 'epoch', epoch, 'seq', last, 'gen', gen, 'ts', now)
redis.call('SADD', KEYS[1], w)
if ARGV[6] ~= '0' then
  local d = table.concat(ARGV, ',', 8)
  redis.call('XADD', 'events:' .. tag, 'MAXLEN', '~', ARGV[6], '*', 't', 'e', 'w', w, 'ep', epoch, 's', first, 'ts', ARGV[7], 'd', d)
end
sweep(256)
return {result, last}
""")

# KEYS[1] workers set. ARGV: tag, worker, epoch, last seq, reset (1 = replace), stream maxlen, then
# (hash, tier) pairs. A worker's whole cache state, shipped in parts (the first with reset=1).
SNAPSHOT = LuaScript(_LUA_COMMON + r"""
local w, epoch, seq, reset = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local skey = key('wstate', w)
local gen
if reset == '1' then gen = purge(w) else gen = tonumber(redis.call('HGET', skey, 'gen') or '0') end
local rset = key('wblocks', w .. ':' .. gen)
for i = 7, #ARGV, 2 do
  redis.call('HSET', key('kv', ARGV[i]), w .. '@' .. ARGV[i + 1], gen)
  redis.call('SADD', rset, ARGV[i] .. '@' .. ARGV[i + 1])
end
redis.call('HSET', skey, 'epoch', epoch, 'seq', seq, 'gen', gen, 'ts', now_ms())
redis.call('SADD', KEYS[1], w)
if ARGV[6] ~= '0' then
  local d = table.concat(ARGV, ',', 7)
  redis.call('XADD', 'events:' .. tag, 'MAXLEN', '~', ARGV[6], '*', 't', 's', 'w', w, 'ep', epoch, 's', seq, 'r', reset, 'd', d)
end
sweep(256)
return gen
""")

# KEYS[1] workers set. ARGV: tag, speculative ttl ms, session ('' = none), session ttl ms, number of
# workers, workers..., block hashes...
DECIDE = LuaScript(_LUA_COMMON + r"""
local ttl, session, nw = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[5])
local now = now_ms()
for i = 6 + nw, #ARGV do
  local k = key('spec', ARGV[i])
  for j = 6, 5 + nw do redis.call('HSET', k, ARGV[j], now + ttl) end
  redis.call('PEXPIRE', k, ttl)
end
if session ~= '' then
  local k = key('sess', session)
  for j = 6, 5 + nw do redis.call('HSET', k, ARGV[j], now) end
  redis.call('PEXPIRE', k, ARGV[4])
end
return 1
""")

# KEYS[1] workers set. ARGV: tag, worker ('' = every worker without a live heartbeat).
REMOVE = LuaScript(_LUA_COMMON + r"""
local removed = {}
local targets = {}
if ARGV[2] ~= '' then targets = {ARGV[2]} else
  for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    if redis.call('EXISTS', key('load', w)) == 0 then targets[#targets + 1] = w end
  end
end
for _, w in ipairs(targets) do
  purge(w)
  -- Keep the generation counter (stale entries of old generations must never count again); forget the
  -- position, so the worker's sink, if it is still alive, resynchronises with a snapshot.
  redis.call('HSET', key('wstate', w), 'epoch', '', 'seq', -1)
  redis.call('DEL', key('load', w))
  redis.call('SREM', KEYS[1], w)
  removed[#removed + 1] = w
end
sweep(256)
return removed
""")

# KEYS[1] workers set. ARGV: tag. Every worker's position and current blocks, and the stream's last id,
# read atomically: a consumer loads this and then tails the stream from that id.
READ_ALL = LuaScript(_LUA_COMMON + r"""
local last = redis.call('XREVRANGE', 'events:' .. tag, '+', '-', 'COUNT', 1)
local last_id = '0-0'
if #last > 0 then last_id = last[1][1] end
local out = {}
for _, w in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local st = redis.call('HMGET', key('wstate', w), 'epoch', 'seq', 'gen')
  if st[1] and st[1] ~= '' then
    out[#out + 1] = {w, st[1], st[2], redis.call('SMEMBERS', key('wblocks', w .. ':' .. (st[3] or '0')))}
  end
end
return {last_id, out}
""")

# KEYS[1] workers set. ARGV: tag, budget. One bounded sweep step; returns the superseded sets left.
SWEEP = LuaScript(_LUA_COMMON + r"""
sweep(tonumber(ARGV[2]))
return redis.call('LLEN', 'sweep:' .. tag)
""")

ALL_SCRIPTS = (LOOKUP, APPLY, SNAPSHOT, DECIDE, REMOVE, READ_ALL, SWEEP)


def model_tag(model: str) -> str:
    """The Redis Cluster hash tag of a model's keys (braces inside the name would break the tag)."""
    clean = model.replace("{", "_").replace("}", "_")
    return "{" + clean + "}"


def check_worker_id(worker_id: str) -> str:
    if not _WORKER_ID.match(worker_id):
        raise ValueError(f"worker id {worker_id!r} may only contain letters, digits and . _ : / -")
    return worker_id


def hex_hash(h: int) -> str:
    return format(h, "016x")


def event_args(events: list[KVEvent]) -> list[str]:
    out = []
    for e in events:
        out += (_KIND_CODE[e.kind], hex_hash(e.block_hash or 0), e.tier)
    return out


def contiguous_runs(events: Iterable[KVEvent]) -> list[list[KVEvent]]:
    """Splits events into runs of one worker and epoch with consecutive sequence numbers."""
    runs: list[list[KVEvent]] = []
    for e in events:
        if isinstance(e, dict):
            e = KVEvent.from_dict(e)
        last = runs[-1][-1] if runs else None
        if last is not None and (last.worker_id, last.epoch, last.seq + 1) == (e.worker_id, e.epoch, e.seq):
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def parse_load(worker_id: str, flat: list[str]) -> WorkerLoad:
    d = dict(zip(flat[::2], flat[1::2]))
    d["worker_id"] = worker_id
    return WorkerLoad.from_dict(d)


def load_mapping(load: WorkerLoad) -> dict[str, str]:
    return {k: str(v) for k, v in load.to_dict().items() if k != "worker_id"}


class RedisKVIndex:
    """The KV index in Redis. Every method raises IndexUnavailable (never a raw Redis error) when Redis
    is unreachable, slow, or refuses the credentials; the circuit breaker then short-circuits calls until
    a background probe sees Redis answer again."""

    def __init__(
        self,
        client: redis.Redis,
        model: str,
        *,
        heartbeat_ttl_s: float = 10.0,
        session_ttl_s: float = 600.0,
        stream_maxlen: int = 100_000,
        retry_interval_s: float = 1.0,
        on_purge=None,
        on_availability=None,
    ):
        self.client = client
        self.model = model
        self.tag = model_tag(model)
        self.workers_key = f"workers:{self.tag}"
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.session_ttl_s = session_ttl_s
        self.stream_maxlen = stream_maxlen
        self.on_purge = on_purge  # (worker, reason) for gaps and epoch changes seen by `apply`
        self.breaker = CircuitBreaker(client, retry_interval_s, on_availability)

    @classmethod
    def from_config(cls, kv_cfg, model: str, router_cfg=None, **kw) -> "RedisKVIndex":
        from .redis_conn import connect_from_config

        if router_cfg is not None:
            kw.setdefault("heartbeat_ttl_s", router_cfg.heartbeat_ttl_s)
            kw.setdefault("session_ttl_s", router_cfg.session_ttl_s)
        return cls(connect_from_config(kv_cfg), model, stream_maxlen=kv_cfg.stream_maxlen, retry_interval_s=kv_cfg.retry_interval_s, **kw)

    def _run(self, script: LuaScript, args: list) -> object:
        return self.breaker.call(lambda: script(self.client, [self.workers_key], [self.tag, *args]))

    def check(self) -> None:
        """Raises IndexUnavailable with a clear message if Redis cannot be used (e.g. a wrong password)."""
        self.breaker.call(self.client.ping)

    # ---------------------------------------------------------------- events

    def apply(self, events: Iterable[KVEvent]) -> None:
        """Applies events in order (one script call per contiguous run, pipelined). A gap or a new epoch
        purges the worker and keeps what follows, as the memory index does."""
        runs = contiguous_runs(events)
        if not runs:
            return

        def send():
            pipe = self.client.pipeline(transaction=False)
            for run in runs:
                e0 = run[0]
                pipe.evalsha(APPLY.sha, 1, self.workers_key, self.tag, e0.worker_id, str(e0.epoch), e0.seq, 0,
                             self.stream_maxlen, e0.timestamp, *event_args(run))
            return pipe.execute()

        results = self.breaker.call(lambda: self._with_scripts(send))
        for run, (result, _) in zip(runs, results):
            if result in ("gap", "epoch") and self.on_purge is not None:
                self.on_purge(run[0].worker_id, result)

    def _with_scripts(self, fn):
        """Runs a pipeline of EVALSHAs; if Redis lost its script cache (restart), loads them and retries."""
        try:
            return fn()
        except NoScriptError:
            for s in ALL_SCRIPTS:
                self.client.script_load(s.source)
            return fn()

    def load_snapshot(self, worker_id: str, epoch: int, last_seq: int, blocks: list[tuple[int, str]], reset: bool = True) -> None:
        args = [worker_id, str(epoch), last_seq, 1 if reset else 0, self.stream_maxlen]
        for h, tier in blocks:
            args += (hex_hash(h), tier)
        self._run(SNAPSHOT, args)

    # ---------------------------------------------------------------- liveness and load

    def heartbeat(self, load: WorkerLoad) -> None:
        check_worker_id(load.worker_id)

        def send():
            pipe = self.client.pipeline(transaction=False)
            key = f"load:{self.tag}:{load.worker_id}"
            pipe.hset(key, mapping=load_mapping(load))
            pipe.pexpire(key, int(self.heartbeat_ttl_s * 1000))
            pipe.sadd(self.workers_key, load.worker_id)
            pipe.execute()

        self.breaker.call(send)

    def live_workers(self) -> dict[str, WorkerLoad]:
        return self.lookup([]).loads

    def remove_worker(self, worker_id: str) -> None:
        self._run(REMOVE, [worker_id])

    def remove_dead_workers(self) -> list[str]:
        return list(self._run(REMOVE, [""]))

    def sweep(self, budget: int = SWEEP_BUDGET) -> int:
        """Deletes up to `budget` superseded entries; returns how many superseded sets remain. Every
        write script already sweeps a little; this is for a cluster whose workers are all gone."""
        return int(self._run(SWEEP, [budget]))

    # ---------------------------------------------------------------- lookups

    def lookup(self, block_hashes: list[int], session_id: str | None = None) -> Lookup:
        matches_flat, loads_flat, sess = self._run(LOOKUP, [session_id or "", *map(hex_hash, block_hashes)])
        loads = {loads_flat[i]: parse_load(loads_flat[i], loads_flat[i + 1]) for i in range(0, len(loads_flat), 2)}
        matches = {
            matches_flat[i]: PrefixMatch(int(matches_flat[i + 1]), int(matches_flat[i + 2]))
            for i in range(0, len(matches_flat), 3)
        }
        return Lookup(matches, loads, sorted(w for w in sess if w in loads))

    def longest_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        return {w: m.blocks for w, m in self.lookup(block_hashes).matches.items()}

    # ---------------------------------------------------------------- decisions and sessions

    def record_decision(self, workers: list[str], block_hashes: list[int], ttl_s: float, session_id: str | None) -> None:
        self._run(DECIDE, [int(ttl_s * 1000), session_id or "", int(self.session_ttl_s * 1000), len(workers), *workers,
                           *map(hex_hash, block_hashes)])

    def note_speculative(self, worker_id: str, block_hashes: list[int], ttl_s: float) -> None:
        self.record_decision([worker_id], block_hashes, ttl_s, None)

    def record_session(self, session_id: str, worker_id: str) -> None:
        self.record_decision([worker_id], [], 0, session_id)

    def session_workers(self, session_id: str) -> list[str]:
        return sorted(self.breaker.call(lambda: self.client.hkeys(f"sess:{self.tag}:{session_id}")))

    def read_all(self) -> tuple[str, list[tuple[str, int, int, list[tuple[int, str]]]]]:
        """(stream id, [(worker, epoch, last seq, [(hash, tier)])]): the whole index, atomically."""
        last_id, rows = self._run(READ_ALL, [])
        out = []
        for w, epoch, seq, members in rows:
            blocks = []
            for m in members:
                h, _, tier = m.partition("@")
                blocks.append((int(h, 16), tier))
            out.append((w, int(epoch), int(seq), blocks))
        return last_id, out

    def flush_all(self) -> None:
        """Deletes every key of this model (tests, benchmarks). SCAN-based; never use on a hot path."""
        def send():
            for k in self.client.scan_iter(match=f"*:{self.tag}*", count=1000):
                self.client.delete(k)

        self.breaker.call(send)


__all__ = ["RedisKVIndex", "RedisError", "model_tag"]
