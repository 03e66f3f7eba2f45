"""`RedisKVIndex`: the KV index in Redis, shared by any number of router replicas.

Why the index itself lives in Redis (and not only an event stream each router replays): a router replica
that starts late, or restarts, reads the current cache state at once, with no replay and no dependence on
how much history a bounded stream kept. The workers' event sinks (`publisher.RedisKVEventSink`) write it
directly, one Lua call per batch of events, which also appends the batch to the model's stream for
anything that wants a local copy (`publisher.KVEventStreamConsumer`).

Layout (every key carries the model as a hash tag `{model}`, so in a Redis Cluster a model's keys share
one slot and the Lua scripts can touch them all; scripts declare `workers:{model}` as their key):

  kv:{model}:<hash>           HASH  <worker> -> <gen> if the worker holds the block (16-hex-digit chained
                                    hash) on its device, o<gen> if only in slower tiers (host, disk).
                                    Counts only while <gen> is the worker's current generation.
  wblocks:{model}:<w>:<gen>   SET   <hash> for a device block, <hash>@<tier> for a slower tier: the reverse
                                    index of one worker generation (lookups' SMISMEMBER, purges, snapshots).
  wstate:{model}:<w>          HASH  epoch, seq (last applied event), gen, tiers, ts: the worker's position.
  gens:{model}                HASH  worker -> current generation (what a lookup reads in one call).
  sweep:{model}               LIST  "<w>|<gen>": superseded generations whose entries are still to delete.
  wspec:{model}:<w>:<bucket>  SET   hashes the worker was chosen to compute (speculative entries), per
                                    time bucket of width speculative_ttl (server clock), PEXPIRE 2 buckets:
                                    an entry counts for between one and two ttl.
  spec:{model}:<hash>         HASH  worker -> expiry (ms): speculative holders of a chain's first block
                                    (how a lookup finds a worker that holds nothing of it yet).
  load:{model}:<w>            HASH  the worker's WorkerLoad fields, PEXPIRE heartbeat TTL: the heartbeat.
                                    No key, not live: its entries are ignored and nothing routes to it.
                                    sparse_blocks = 1: it publishes only block boundaries (hybrid).
  live:{model}                ZSET  worker -> heartbeat deadline (ms, server clock): liveness in one call.
  workers:{model}             SET   workers that ever heartbeated (to enumerate them without SCAN).
  sess:{model}:<session>      HASH  worker -> last use (ms), PEXPIRE session TTL.
  events:{model}              STREAM  one entry per batch, MAXLEN ~ stream_maxlen: t=e (events: w, ep,
                                    s = first seq, ts, tiers, d = 18-char records), t=s (snapshot part:
                                    w, ep, s = last seq, r = reset, tiers, d = 17-char records) or t=D (a
                                    batch of routing decisions: r = the router's id, fields 0, 1, ...
                                    = DECIDE records: speculative width, workers, blocks each holds,
                                    offset, the hashes from the offset on, session).

Purges are O(1): a new epoch, a sequence gap, a `cleared` event or `remove_worker` bumps the worker's
generation, which invalidates all its entries at once; the old generation's entries are deleted a few
hundred per write call afterwards (`sweep`), so a worker with 100k cached blocks restarting never stalls
Redis (and with it every router's lookup).

Lookups: `LOOKUP` computes every live worker's match server-side: its deepest held block along the
request's chain (+ 1), which for attention-only engines is the end of their cached prefix and for hybrid
engines (publishing only the blocks they can resume from) the deepest reusable boundary. Candidates are
the holders of the first block, then, among live workers whose heartbeat says `sparse_blocks` (hybrid)
only, those that hold later blocks alone (found by reading the holders of the chain's blocks from its
end, or by checking each such worker, whichever is cheaper): an attention-only worker holding any block
of a chain holds its first block too, so a cluster without hybrid workers pays nothing for the search.
One SMISMEMBER per candidate over the whole chain finds its deepest hit. The reply holds the
matches, every live worker's load and the session's workers: one round trip per routing decision. The
server's clock (TIME) dates speculative entries, so router replicas on different machines agree on what
has expired.
"""

from __future__ import annotations

import re
import struct
import threading
import time
import uuid
from collections import deque
from typing import Iterable

import redis
from redis.exceptions import NoScriptError

from workers.engine.kv_events import KVEvent, KVEventKind

from .redis_conn import CircuitBreaker, LuaScript
from .types import DEVICE_TIER, IndexUnavailable, Lookup, PrefixMatch, WorkerLoad

_KIND_CODE = {KVEventKind.STORED: "s", KVEventKind.REMOVED: "r", KVEventKind.CLEARED: "c"}
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:/-]+$")
MAX_LOOKUP_BLOCKS = 4096  # Lua unpack() limits; 64k tokens at 16 per block (longer prompts: first 4096)
SWEEP_BUDGET = 256  # superseded entries each write script deletes (the scripts say 256 too)
DECIDE_BATCH = 256  # decisions per DECIDE call (Lua's unpack and argument limits stay far away)

# Helpers shared by the scripts. ARGV[1] is always the hash tag "{model}". Hot paths use locals
# (prefix strings, redis.call) because global and function lookups dominate small Lua loops.
_LUA_COMMON = r"""
local call = redis.call
local tag = ARGV[1]
local KV, SPEC, WSTATE, WBLOCKS = 'kv:' .. tag .. ':', 'spec:' .. tag .. ':', 'wstate:' .. tag .. ':', 'wblocks:' .. tag .. ':'
local WSPEC = 'wspec:' .. tag .. ':'
local GENS, LIVE = 'gens:' .. tag, 'live:' .. tag
-- A reverse-set member: the bare hash for a device-resident block, <hash>@<tier> for a slower tier
-- (so the common lookup, device membership, needs no suffix on its member list).
local function member(h, tier) if tier == 'device' then return h end return h .. '@' .. tier end
local SWEEP = 'sweep:' .. tag
local function now_ms()
  local t = call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function split(s)
  local out = {}
  for t in string.gmatch(s, '[^,]+') do out[#out + 1] = t end
  return out
end
-- O(1) purge: a new generation; the old one's entries stop counting and are swept later.
local function purge(w)
  local skey = WSTATE .. w
  local gen = tonumber(call('HGET', skey, 'gen') or '0')
  if call('EXISTS', WBLOCKS .. w .. ':' .. gen) == 1 then call('RPUSH', SWEEP, w .. '|' .. gen) end
  call('HSET', skey, 'gen', gen + 1)
  call('HSET', GENS, w, gen + 1)
  return gen + 1
end
local function sweep(budget)
  while budget > 0 do
    local item = call('LINDEX', SWEEP, 0)
    if not item then return end
    local bar = string.find(item, '|', 1, true)
    local w, g = string.sub(item, 1, bar - 1), string.sub(item, bar + 1)
    local set = WBLOCKS .. w .. ':' .. g
    local members = call('SPOP', set, budget)
    for _, m in ipairs(members) do
      local k = KV .. string.sub(m, 1, 16)
      local v = call('HGET', k, w)
      if v == g or v == 'o' .. g then call('HDEL', k, w) end
    end
    budget = budget - #members
    if call('EXISTS', set) == 0 then call('LPOP', SWEEP) end
  end
end
-- kv:{m}:<hash> field <worker> = gen if the worker holds the block on its device, 'o'..gen if only in
-- slower tiers. Recomputed from the worker's reverse set (members <hash>@<tier>) after each change.
local function refresh(w, gen, h, rset, tiers)
  if call('SISMEMBER', rset, h) == 1 then call('HSET', KV .. h, w, gen); return end
  for _, t in ipairs(tiers) do
    if t ~= 'device' and call('SISMEMBER', rset, h .. '@' .. t) == 1 then call('HSET', KV .. h, w, 'o' .. gen); return end
  end
  call('HDEL', KV .. h, w)
end
-- The tiers a worker ever used (wstate field 'tiers'), extended by a batch's tier table.
local function worker_tiers(w, batch)
  local known = call('HGET', WSTATE .. w, 'tiers') or ''
  local set, list = {}, split(known)
  for _, t in ipairs(list) do set[t] = true end
  local grew = false
  for _, t in ipairs(batch) do
    if not set[t] then set[t] = true; list[#list + 1] = t; grew = true end
  end
  if grew then call('HSET', WSTATE .. w, 'tiers', table.concat(list, ',')) end
  return list
end
"""

# Arguments are packed (one string per list) because encoding each of a few hundred small arguments is
# most of a call's client-side cost: block hashes as concatenated 16-hex-digit strings; events as
# 18-character records <kind s|r|c><tier index 0-9><hash>; snapshot blocks as 17-character records
# <tier index><hash>; tier names as a comma-separated table the indexes refer to.

# KEYS[1] workers set. ARGV: tag, session ('' = none), block hashes (packed), want loads (1|0),
# speculative bucket width (ms), the workers whose (cached) load says sparse_blocks, comma-separated
# (read only when loads are not wanted: with them, the load hashes say it).
# Returns {matches = {w, blocks, offloaded, ...}, live = {w, load fields (empty unless wanted), ...},
# the session's workers}.
#
# The match rule (as in `MemoryKVIndex._match`): a worker's DEEPEST held block along the chain, + 1, not
# the end of its first consecutive run. Hashes are chained, so holding block i means holding exactly this
# prefix through block i; hybrid (linear-attention) engines publish only the blocks where a recurrent
# state snapshot lets them resume, so their holdings have gaps by design, while attention-only engines
# publish every block and evict tails first (deepest = end of the run).
#
# Candidates: the live workers holding (or about to compute) the first block, then, if some live worker
# that publishes only block boundaries (load field sparse_blocks: hybrid engines) is not one yet, those
# of them holding only later blocks (a hybrid worker may hold a late boundary and not the first block):
# see the script for the two exact ways. Attention-only workers are never searched for: by contract they
# hold a chain's first block whenever they hold any of it (they publish every block and evict a
# sequence's tail first), so without hybrid workers the lookup costs what the first-gap rule did. Each
# candidate's membership of every block is one SMISMEMBER on its reverse set (slower tiers and
# speculative sets are read only if it misses a block on the device); its match is its deepest hit. That
# is a handful of calls per candidate whatever the prompt length, plus, to find the sparse workers
# lacking the first block, up to a small call per block or an SMISMEMBER per such worker (~100 us of
# Redis time for a 76-block chain and 8 hybrid workers).
LOOKUP = LuaScript(
    _LUA_COMMON
    + r"""
local now = now_ms()
local want = ARGV[4] == '1'
local live, gens, ogens = {}, {}, {}
local nlive = 0
local g = call('HGETALL', GENS)
local allgens = {}
for j = 1, #g, 2 do allgens[g[j]] = g[j + 1] end
local function add(w, l)
  local gen = allgens[w] or '0'
  gens[w], ogens[w] = gen, 'o' .. gen
  live[#live + 1] = w
  live[#live + 1] = l
  nlive = nlive + 1
end
if want then  -- the load hashes themselves (their TTL is the heartbeat)
  for _, w in ipairs(call('SMEMBERS', KEYS[1])) do
    local l = call('HGETALL', 'load:' .. tag .. ':' .. w)
    if #l > 0 then add(w, l) end
  end
else  -- liveness alone: the heartbeat deadlines, one call
  for _, w in ipairs(call('ZRANGEBYSCORE', LIVE, now, '+inf')) do add(w, {}) end
end
local sub = string.sub
local hashes = ARGV[3]
local n = #hashes / 16
local matches = {}
if n > 0 and nlive > 0 then
  local lists = {}  -- member lists per suffix ('' for device blocks and speculative sets, '@host', ...)
  local function members(suffix)
    local m = lists[suffix]
    if m == nil then
      m = {}
      for k = 1, n do m[k] = sub(hashes, k * 16 - 15, k * 16) .. suffix end
      lists[suffix] = m
    end
    return m
  end
  local cands, seen = {}, {}
  local ncands = 0
  -- Adds the live workers holding block h (current generation) as candidates; only those in `only`
  -- if given.
  local function take(h, only)
    local f = call('HGETALL', KV .. h)
    for j = 1, #f, 2 do
      local w, v = f[j], f[j + 1]
      if not seen[w] and (v == gens[w] or v == ogens[w]) and (only == nil or only[w]) then
        ncands = ncands + 1; cands[ncands] = w; seen[w] = true
      end
    end
  end
  local h0 = sub(hashes, 1, 16)
  take(h0)
  local s = call('HGETALL', SPEC .. h0)
  for j = 1, #s, 2 do
    local w = s[j]
    if gens[w] and not seen[w] and tonumber(s[j + 1]) > now then ncands = ncands + 1; cands[ncands] = w; seen[w] = true end
  end
  if ncands < nlive then
    -- The other live workers that publish only block boundaries (hybrid engines: heartbeat field
    -- sparse_blocks) may hold later blocks only. Attention-only workers are not searched: holding any
    -- block of the chain, they hold its first block too (so none of them is missed above).
    local sparse, rest = {}, {}
    if want then
      for j = 1, #live, 2 do
        local w, l = live[j], live[j + 1]
        if not seen[w] then
          for k = 1, #l, 2 do
            if l[k] == 'sparse_blocks' then
              local v = l[k + 1]
              if v == '1' or v == 'True' or v == 'true' then sparse[w] = true; rest[#rest + 1] = w end
              break
            end
          end
        end
      end
    else
      for w in string.gmatch(ARGV[6] or '', '[^,]+') do
        if gens[w] and not seen[w] and not sparse[w] then sparse[w] = true; rest[#rest + 1] = w end
      end
    end
    -- Two exact ways to find those holding later blocks, the cheaper one runs: take them all as
    -- candidates (each: an SMISMEMBER over the chain, ~0.25 us a block, and ~3 small calls), or read
    -- the holders of the other blocks from the chain's end (a call per block, ~1.3 us, stopping once
    -- every sparse worker is a candidate). Measured on Redis 7.0; either way the result is the same.
    local nrest = #rest
    if nrest == 0 then
      -- no hybrid worker left to look for: nothing to do
    elseif nrest * (n + 12) <= 5 * (n - 1) then
      for _, w in ipairs(rest) do ncands = ncands + 1; cands[ncands] = w; seen[w] = true end
    else
      local dm, i, target = members(''), n, ncands + nrest
      while ncands < target and i > 1 do
        take(dm[i], sparse)
        i = i - 1
      end
    end
  end
  local function hit(arrays, k)
    for _, a in ipairs(arrays) do if a[k] == 1 then return true end end
    return false
  end
  local bucket = math.floor(now / tonumber(ARGV[5]))
  -- A candidate's hits in its slower tiers and in its speculative sets (read once it misses a block on
  -- the device), and whether there are any such sets at all.
  local function others(w, rset)
    local slow, spec = {}, {}
    for t in string.gmatch(call('HGET', WSTATE .. w, 'tiers') or '', '[^,]+') do
      if t ~= 'device' then slow[#slow + 1] = call('SMISMEMBER', rset, unpack(members('@' .. t))) end
    end
    for b = bucket - 1, bucket do
      local k = WSPEC .. w .. ':' .. b
      if call('EXISTS', k) == 1 then spec[#spec + 1] = call('SMISMEMBER', k, unpack(members(''))) end
    end
    return slow, spec, #slow + #spec > 0
  end
  local dmembers = ncands > 0 and members('') or nil  -- (built only if needed: ~0.1 us a block)
  for c = 1, ncands do
    local w = cands[c]
    local rset = WBLOCKS .. w .. ':' .. gens[w]
    local dev = call('SMISMEMBER', rset, unpack(dmembers))
    local d = n
    while d > 0 and dev[d] ~= 1 do d = d - 1 end  -- the deepest block on the device
    local slow, spec, any = nil, nil, false
    if d < n then  -- a deeper one may sit in a slower tier, or be speculative
      slow, spec, any = others(w, rset)
      if any then
        for k = n, d + 1, -1 do
          if hit(spec, k) or hit(slow, k) then d = k; break end
        end
      end
    end
    local off = 0  -- positions up to d held only in a slower tier (a speculative entry counts as device)
    if slow == nil or #slow > 0 then
      for k = 1, d do
        if dev[k] ~= 1 then
          if slow == nil then
            slow, spec = others(w, rset)
            if #slow == 0 then break end
          end
          if hit(slow, k) and not hit(spec, k) then off = off + 1 end
        end
      end
    end
    if d > 0 then matches[#matches + 1] = w; matches[#matches + 1] = d; matches[#matches + 1] = off end
  end
end
local sess = {}
if ARGV[2] ~= '' then sess = call('HKEYS', 'sess:' .. tag .. ':' .. ARGV[2]) end
return {matches, live, sess}
"""
)

# KEYS[1] workers set. ARGV: tag, worker, epoch, first seq, strict, stream maxlen (0 = no stream),
# oldest event time, tier table, event records (seq = first seq + position).
# strict=1 (the worker's sink): a gap or unknown start returns 'resync' and changes nothing; the sink
# then ships a snapshot. strict=0: a gap purges the worker and applies what follows.
# Returns {result, last seq}: result ok | dup | resync | gap | epoch.
APPLY = LuaScript(
    _LUA_COMMON
    + r"""
local w, epoch, first, strict = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5] == '1'
local batch_tiers = split(ARGV[8])
local recs = ARGV[9]
local n = #recs / 18
local last = first + n - 1
local skey = WSTATE .. w
local st = call('HMGET', skey, 'epoch', 'seq', 'gen')
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
local tiers = worker_tiers(w, batch_tiers)
local rset = WBLOCKS .. w .. ':' .. gen
local sub = string.sub
for i = skip, n - 1 do
  local o = i * 18
  local kind = sub(recs, o + 1, o + 1)
  local tier = batch_tiers[tonumber(sub(recs, o + 2, o + 2)) + 1]
  local h = sub(recs, o + 3, o + 18)
  if kind == 's' then
    call('SADD', rset, member(h, tier))
    if tier == 'device' then call('HSET', KV .. h, w, gen) else refresh(w, gen, h, rset, tiers) end
  elseif kind == 'r' then
    if call('SREM', rset, member(h, tier)) == 1 then refresh(w, gen, h, rset, tiers) end
  else
    gen = purge(w)
    rset = WBLOCKS .. w .. ':' .. gen
  end
end
call('HSET', skey, 'epoch', epoch, 'seq', last, 'gen', gen, 'ts', now_ms())
call('SADD', KEYS[1], w)
if ARGV[6] ~= '0' then
  call('XADD', 'events:' .. tag, 'MAXLEN', '~', ARGV[6], '*',
    't', 'e', 'w', w, 'ep', epoch, 's', first, 'ts', ARGV[7], 'tiers', ARGV[8], 'd', recs)
end
sweep(256)
return {result, last}
"""
)

# KEYS[1] workers set. ARGV: tag, worker, epoch, last seq, reset (1 = replace), stream maxlen, tier
# table, block records. A worker's whole cache state, shipped in parts (the first with reset=1).
SNAPSHOT = LuaScript(
    _LUA_COMMON
    + r"""
local w, epoch, seq, reset = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local batch_tiers = split(ARGV[7])
local recs = ARGV[8]
local skey = WSTATE .. w
local gen
if reset == '1' then gen = purge(w) else gen = tonumber(call('HGET', skey, 'gen') or '0') end
local tiers = worker_tiers(w, batch_tiers)
local rset = WBLOCKS .. w .. ':' .. gen
for i = 0, #recs / 17 - 1 do
  local o = i * 17
  local tier = batch_tiers[tonumber(string.sub(recs, o + 1, o + 1)) + 1]
  local h = string.sub(recs, o + 2, o + 17)
  call('SADD', rset, member(h, tier))
  if tier == 'device' then call('HSET', KV .. h, w, gen) else refresh(w, gen, h, rset, tiers) end
end
call('HSET', skey, 'epoch', epoch, 'seq', seq, 'gen', gen, 'ts', now_ms())
call('SADD', KEYS[1], w)
if ARGV[6] ~= '0' then
  call('XADD', 'events:' .. tag, 'MAXLEN', '~', ARGV[6], '*',
    't', 's', 'w', w, 'ep', epoch, 's', seq, 'r', reset, 'tiers', ARGV[7], 'd', recs)
end
sweep(256)
return gen
"""
)

# KEYS[1] workers set. ARGV: tag, stream max length (0 = do not append to the stream), the deciding
# router's id, then one record per decision (a batch: one call however many decisions accumulated):
#   "<spec bucket width ms, 0 = none>|<session ttl ms>|<w1,w2>|<blocks each matches>|<offset>|<hashes>|<session>"
# (the session last: it may contain anything). Speculative entries go only on the blocks past each chosen
# worker's match (usually a short tail), so a record carries only the hashes from the smallest match
# among the chosen workers (`offset`, a block position) onward, not the whole prompt's; they go into
# the worker's set for the current time bucket; if
# that starts at the first block, the block's spec hash names the worker too, so a lookup finds it as a
# candidate. The decisions also go to the stream (one entry per batch, t=D), so routers that mirror the
# index locally share them.
DECIDE = LuaScript(
    _LUA_COMMON
    + r"""
local maxlen, rid = tonumber(ARGV[2]), ARGV[3]
local now = now_ms()
local find, sub = string.find, string.sub
local shared = {}
for k = 4, #ARGV do
  local rec = ARGV[k]
  local p1 = find(rec, '|', 1, true)
  local p2 = find(rec, '|', p1 + 1, true)
  local p3 = find(rec, '|', p2 + 1, true)
  local p4 = find(rec, '|', p3 + 1, true)
  local p5 = find(rec, '|', p4 + 1, true)
  local p6 = find(rec, '|', p5 + 1, true)
  local width, ttl = tonumber(sub(rec, 1, p1 - 1)), sub(rec, p1 + 1, p2 - 1)
  local ws, starts = split(sub(rec, p2 + 1, p3 - 1)), split(sub(rec, p3 + 1, p4 - 1))
  local offset = tonumber(sub(rec, p4 + 1, p5 - 1))
  local hashes, session = sub(rec, p5 + 1, p6 - 1), sub(rec, p6 + 1)
  local n = offset + #hashes / 16
  for j, w in ipairs(ws) do
    local start = tonumber(starts[j])
    if width > 0 and start < n then
      local m = {}
      for i = start - offset, n - offset - 1 do m[#m + 1] = sub(hashes, i * 16 + 1, i * 16 + 16) end
      local key = WSPEC .. w .. ':' .. math.floor(now / width)
      call('SADD', key, unpack(m))
      call('PEXPIRE', key, 2 * width)
      if start == 0 then
        call('HSET', SPEC .. m[1], w, now + width)
        call('PEXPIRE', SPEC .. m[1], width)
      end
    end
    if session ~= '' then call('HSET', 'sess:' .. tag .. ':' .. session, w, now) end
  end
  if session ~= '' then call('PEXPIRE', 'sess:' .. tag .. ':' .. session, ttl) end
  if width > 0 or session ~= '' then shared[#shared + 1] = tostring(#shared / 2); shared[#shared + 1] = rec end
end
if maxlen > 0 and #shared > 0 then
  call('XADD', 'events:' .. tag, 'MAXLEN', '~', maxlen, '*', 't', 'D', 'r', rid, unpack(shared))
end
return 1
"""
)


def pack_decision(width_ms: int, session_ttl_ms: int, workers: list[str], held: list[int], hashes: list[int], session: str) -> str:
    """One DECIDE record (see the script): only the hashes some chosen worker lacks travel."""
    offset = min(min(held, default=0), len(hashes)) if width_ms > 0 else len(hashes)
    return f"{width_ms}|{session_ttl_ms}|{','.join(workers)}|{','.join(map(str, held))}|{offset}|{pack_hashes(hashes[offset:])}|{session}"


def unpack_decision(rec: str) -> tuple[int, list[str], list[int], list[int], str | None]:
    """(speculative width ms, workers, blocks each holds, block hashes, session) of a DECIDE record, the
    hashes being those it carries (from its offset on) and the held counts relative to them."""
    width, _ttl, workers, held, offset, hashes, session = rec.split("|", 6)
    raw = bytes.fromhex(hashes)
    start = int(offset)
    return (
        int(width),
        workers.split(","),
        [max(0, int(x) - start) for x in held.split(",")],
        list(struct.unpack(f">{len(raw) // 8}Q", raw)),
        session or None,
    )


# KEYS[1] workers set. ARGV: tag, worker ('' = every worker without a live heartbeat).
REMOVE = LuaScript(
    _LUA_COMMON
    + r"""
local removed, targets = {}, {}
if ARGV[2] ~= '' then targets = {ARGV[2]} else
  for _, w in ipairs(call('SMEMBERS', KEYS[1])) do
    if call('EXISTS', 'load:' .. tag .. ':' .. w) == 0 then targets[#targets + 1] = w end
  end
end
for _, w in ipairs(targets) do
  purge(w)
  -- Keep the generation counter (stale entries of old generations must never count again); forget the
  -- position, so the worker's sink, if it is still alive, resynchronises with a snapshot.
  call('HSET', WSTATE .. w, 'epoch', '', 'seq', -1)
  call('DEL', 'load:' .. tag .. ':' .. w)
  call('ZREM', LIVE, w)
  call('SREM', KEYS[1], w)
  removed[#removed + 1] = w
end
sweep(256)
return removed
"""
)

# KEYS[1] workers set. ARGV: tag. Every worker's position and current blocks, and the stream's last id,
# read atomically: a consumer loads this and then tails the stream from that id.
READ_ALL = LuaScript(
    _LUA_COMMON
    + r"""
local last = call('XREVRANGE', 'events:' .. tag, '+', '-', 'COUNT', 1)
local last_id = '0-0'
if #last > 0 then last_id = last[1][1] end
local out = {}
for _, w in ipairs(call('SMEMBERS', KEYS[1])) do
  local st = call('HMGET', WSTATE .. w, 'epoch', 'seq', 'gen')
  if st[1] and st[1] ~= '' then
    out[#out + 1] = {w, st[1], st[2], call('SMEMBERS', WBLOCKS .. w .. ':' .. (st[3] or '0'))}
  end
end
return {last_id, out}
"""
)

# KEYS[1] workers set. ARGV: tag, budget. One bounded sweep step; returns the superseded sets left.
SWEEP = LuaScript(
    _LUA_COMMON
    + r"""
sweep(tonumber(ARGV[2]))
return call('LLEN', SWEEP)
"""
)

ALL_SCRIPTS = (LOOKUP, APPLY, SNAPSHOT, DECIDE, REMOVE, READ_ALL, SWEEP)


def model_tag(model: str) -> str:
    """The Redis Cluster hash tag of a model's keys (braces inside the name would break the tag)."""
    clean = model.replace("{", "_").replace("}", "_")
    return "{" + clean + "}"


def check_worker_id(worker_id: str) -> str:
    if not _WORKER_ID.match(worker_id):
        raise ValueError(f"worker id {worker_id!r} may only contain letters, digits and . _ : / -")
    return worker_id


def pack_hashes(hashes: list[int]) -> str:
    """Block hashes as one string of 16-hex-digit fields (one C call, however long the prompt)."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


def _tier_table(tiers: dict[str, int]) -> str:
    if len(tiers) > 10:
        raise ValueError(f"at most 10 KV tiers are supported, got {sorted(tiers)}")
    return ",".join(tiers)


def pack_events(events: list[KVEvent]) -> tuple[str, str]:
    """(tier table, 18-character records) for APPLY."""
    tiers: dict[str, int] = {}
    recs = [f"{_KIND_CODE[e.kind]}{tiers.setdefault(e.tier, len(tiers))}{(e.block_hash or 0):016x}" for e in events]
    return _tier_table(tiers), "".join(recs)


def pack_blocks(blocks: list[tuple[int, str]]) -> tuple[str, str]:
    """(tier table, 17-character records) for SNAPSHOT."""
    tiers: dict[str, int] = {}
    recs = [f"{tiers.setdefault(tier, len(tiers))}{h:016x}" for h, tier in blocks]
    return _tier_table(tiers), "".join(recs)


def unpack_records(tiers: str, recs: str, width: int) -> list[tuple[str, int, str]]:
    """Decodes event (width 18) or block (width 17) records: [(kind or '', hash, tier)]."""
    names = tiers.split(",") if tiers else []
    out = []
    for o in range(0, len(recs), width):
        r = recs[o : o + width]
        kind, r = (r[0], r[1:]) if width == 18 else ("", r)
        out.append((kind, int(r[1:], 16), names[int(r[0])]))
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
    """The load HASH's fields (bools as "1"/"0", which the LOOKUP script and `WorkerLoad.from_dict` read)."""
    return {k: (str(int(v)) if isinstance(v, bool) else str(v)) for k, v in load.to_dict().items() if k != "worker_id"}


def heartbeat_commands(pipe, tag: str, load: WorkerLoad, ttl_s: float) -> None:
    """A heartbeat: the load HASH with its TTL, the worker's deadline in live:{model} (liveness in one
    call for lookups; scored by the server's clock), and its registration."""
    key = f"load:{tag}:{load.worker_id}"
    ttl_ms = int(ttl_s * 1000)
    pipe.hset(key, mapping=load_mapping(load))
    pipe.pexpire(key, ttl_ms)
    pipe.eval(_HEARTBEAT_DEADLINE, 1, f"live:{tag}", load.worker_id, ttl_ms)
    pipe.sadd(f"workers:{tag}", load.worker_id)


# ZADD with a deadline on the server's clock (router and worker clocks may differ); also drops deadlines
# long past so the set stays small. Short enough that EVAL (no SHA bookkeeping) is fine.
_HEARTBEAT_DEADLINE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 3600000)
return 1
"""


class RedisKVIndex:
    """The KV index in Redis. Every method raises IndexUnavailable (never a raw Redis error) when Redis
    is unreachable, slow, or refuses the credentials; the circuit breaker then short-circuits calls until
    a background probe sees Redis answer again."""

    blocking_lookups = True  # a round trip: asyncio callers run lookups in a worker thread

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
        async_writes: bool = True,
        max_queued_writes: int = 10_000,
        load_cache_s: float = 0.25,
        speculative_ttl_s: float = 2.0,
    ):
        self.client = client
        self.model = model
        self.tag = model_tag(model)
        self.router_id = uuid.uuid4().hex[:12]  # names this router's decisions in the stream
        self.workers_key = f"workers:{self.tag}"
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.session_ttl_s = session_ttl_s
        self.stream_maxlen = stream_maxlen
        self.on_purge = on_purge  # (worker, reason) for gaps and epoch changes seen by `apply`
        self.breaker = CircuitBreaker(client, retry_interval_s, on_availability)
        self.load_cache_s = load_cache_s
        # Speculative entries live in time buckets of this width (see the layout): one to two widths.
        self._spec_width_ms = max(1, int(speculative_ttl_s * 1000))
        self._loads: dict[str, WorkerLoad] = {}
        self._sparse = ""  # the cached loads' workers with sparse_blocks, comma-separated (LOOKUP's ARGV)
        self._loads_at = -float("inf")
        self.async_writes = async_writes
        self.max_queued_writes = max_queued_writes
        self._writes: deque[list] = deque()
        self._write_cv = threading.Condition()
        self._queued = self._written = 0
        self._closing = False
        self._writer: threading.Thread | None = None
        self._idle_writer = False
        # How long the writer waits for more decisions before sending (0: at once). A mirror, whose
        # own decisions count locally at once, uses a little to batch writes.
        self.write_linger_s = 0.0

    @classmethod
    def from_config(cls, kv_cfg, model: str, router_cfg=None, **kw) -> "RedisKVIndex":
        from .redis_conn import connect_from_config

        if router_cfg is not None:
            kw.setdefault("heartbeat_ttl_s", router_cfg.heartbeat_ttl_s)
            kw.setdefault("session_ttl_s", router_cfg.session_ttl_s)
            kw.setdefault("speculative_ttl_s", router_cfg.speculative_ttl_s)
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
                pipe.evalsha(
                    APPLY.sha,
                    1,
                    self.workers_key,
                    self.tag,
                    e0.worker_id,
                    str(e0.epoch),
                    e0.seq,
                    0,
                    self.stream_maxlen,
                    e0.timestamp,
                    *pack_events(run),
                )
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
        self._run(SNAPSHOT, [worker_id, str(epoch), last_seq, 1 if reset else 0, self.stream_maxlen, *pack_blocks(blocks)])

    # ---------------------------------------------------------------- liveness and load

    def heartbeat(self, load: WorkerLoad) -> None:
        check_worker_id(load.worker_id)

        def send():
            pipe = self.client.pipeline(transaction=False)
            heartbeat_commands(pipe, self.tag, load, self.heartbeat_ttl_s)
            pipe.execute()

        self.breaker.call(send)
        self._loads_at = -float("inf")  # this process changed a load: re-read on the next lookup

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
        """One round trip. Loads change only with heartbeats (every few seconds), so their values are
        re-read at most every `load_cache_s`; liveness is checked on every call. Between re-reads the
        script learns which live workers are sparse (`WorkerLoad.sparse_blocks`) from the cached loads."""
        packed = pack_hashes(block_hashes[:MAX_LOOKUP_BLOCKS])
        want = time.monotonic() - self._loads_at >= self.load_cache_s
        args = [session_id or "", packed, 1 if want else 0, self._spec_width_ms, "" if want else self._sparse]
        matches_flat, live, sess = self._run(LOOKUP, args)
        names = live[::2]
        if want:
            self._loads = {w: parse_load(w, fields) for w, fields in zip(names, live[1::2])}
            self._sparse = ",".join(w for w, load in self._loads.items() if load.sparse_blocks)
            self._loads_at = time.monotonic()
        elif any(w not in self._loads for w in names):  # a worker joined since: read its load now
            self._loads_at = -float("inf")
            return self.lookup(block_hashes, session_id)
        loads = {w: self._loads[w] for w in names}
        matches = {matches_flat[i]: PrefixMatch(int(matches_flat[i + 1]), int(matches_flat[i + 2])) for i in range(0, len(matches_flat), 3)}
        return Lookup(matches, loads, sorted(w for w in sess if w in loads))

    def longest_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        return {w: m.blocks for w, m in self.lookup(block_hashes).matches.items()}

    # ---------------------------------------------------------------- decisions and sessions

    def record_decision(
        self, workers: list[str], block_hashes: list[int], ttl_s: float, session_id: str | None, held: list[int] | None = None
    ) -> None:
        """Speculative entries (blocks `held[i]` onward for `workers[i]`) and the session record, in one
        script call. Speculative entries last one to two `speculative_ttl_s` (time buckets); any
        ttl_s > 0 asks for them. With async_writes (the default) the call is queued for the writer
        thread, which pipelines whatever accumulated: the decision does not wait for a second round trip."""
        held = held or [0] * len(workers)
        rec = pack_decision(
            self._spec_width_ms if ttl_s > 0 else 0, int(self.session_ttl_s * 1000), workers, held, block_hashes, session_id or ""
        )
        if not self.async_writes:
            self.breaker.call(lambda: DECIDE(self.client, [self.workers_key], [self.tag, self.stream_maxlen, self.router_id, rec]))
            return
        self.breaker.guard()  # Redis down: fail now, do not queue
        if len(self._writes) >= self.max_queued_writes:
            raise IndexUnavailable("KV index write queue full")
        with self._write_cv:
            self._writes.append(rec)
            self._queued += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="moray-kv-index-writer", daemon=True)
                self._writer.start()
            if self._idle_writer:  # a busy writer takes this one with its next batch anyway
                self._write_cv.notify()

    def _write_loop(self) -> None:
        while True:
            with self._write_cv:
                while not self._writes and not self._closing:
                    self._idle_writer = True
                    self._write_cv.wait()
                    self._idle_writer = False
                if self._closing and not self._writes:
                    return
            if self.write_linger_s and not self._closing:
                time.sleep(self.write_linger_s)  # let a few decisions gather: one pipeline, one wake-up
            with self._write_cv:
                batch = list(self._writes)
                self._writes.clear()

            def send():
                for start in range(0, len(batch), DECIDE_BATCH):  # one script call per batch
                    DECIDE(
                        self.client,
                        [self.workers_key],
                        [self.tag, self.stream_maxlen, self.router_id, *batch[start : start + DECIDE_BATCH]],
                    )

            try:
                self.breaker.call(send)
            except IndexUnavailable:
                pass  # bookkeeping is best effort: lost speculative entries only cost some affinity
            with self._write_cv:
                self._written += len(batch)
                self._write_cv.notify_all()

    def flush(self, timeout: float = 2.0) -> bool:
        """Waits until every queued bookkeeping write was sent (or dropped because Redis is down)."""
        deadline = time.monotonic() + timeout
        with self._write_cv:
            target = self._queued
            while self._written < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._write_cv.wait(remaining)
        return True

    def close(self) -> None:
        self.flush()
        with self._write_cv:
            self._closing = True
            self._write_cv.notify_all()
        if self._writer is not None:
            self._writer.join(2)
            self._writer = None

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
                blocks.append((int(h, 16), tier or DEVICE_TIER))
            out.append((w, int(epoch), int(seq), blocks))
        return last_id, out

    def flush_all(self) -> None:
        """Deletes every key of this model (tests, benchmarks). SCAN-based; never use on a hot path."""

        def send():
            for k in self.client.scan_iter(match=f"*:{self.tag}*", count=1000):
                self.client.delete(k)

        self.breaker.call(send)
