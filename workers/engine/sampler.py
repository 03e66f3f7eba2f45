"""Batched, jittable token sampling, run on the logits the model runner returns for one engine step.

Host side, `build_sampling_batch` packs the `SamplingParams` of the step's requests into a
`SamplingBatch`: small device arrays, one row per request, padded to the batch bucket. Device
side, `sample` processes each row as

    raw logits -> ban EOS/stop tokens (min_tokens) -> penalties -> argmax          (greedy rows)
                                                                -> temperature -> top-k -> top-p
                                                                   -> min-p -> categorical draw

and returns the chosen tokens with logprobs taken from the *raw* logits (vLLM's default
"raw_logprobs"). Static flags in the batch decide which stages exist in the compiled program, so a
step of plain requests pays for no top-k/top-p search and no [B, V] penalty tensors.

Randomness: each row's key is derived inside `sample` from four uint32 words,

    key = fold_in(fold_in(fold_in(fold_in(key(0), stream), seed_hi), seed_lo), counter)

- seeded request:   stream 0, seed = request seed mod 2**64, counter = tokens generated so far;
- unseeded request: stream 1, seed = the engine's `step_seed` mod 2**64, counter = row index.

A seeded row's key therefore depends only on (seed, position in its output), and every per-row
operation is independent of the other rows, so a seeded request produces the same tokens alone or
in any batch, at any row. The separate stream keeps unseeded rows from replaying a seeded stream.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
from typing import Literal, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from workers.engine.sampling_params import SamplingParams

_SEEDED_STREAM = 0
_UNSEEDED_STREAM = 1
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


# ================================================================================ batch (host side)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "rng_words",
        "token_counts",
        "prompt_mask",
        "banned_token_ids",
        "allowed_bitmask",
        "bias_ids",
        "bias_values",
    ],
    meta_fields=["all_greedy", "use_penalties", "use_top_k", "use_top_p", "use_min_p"],
)
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling state for one step. B = batch bucket, V = vocab (logits width).

    Padding rows are greedy with neutral parameters; their tokens are meaningless. `build_sampling_batch`
    fills the fields with numpy arrays; `sample` moves them to the device with its other arguments.
    """

    temperature: jax.Array  # f32[B]; exactly 0 for greedy rows
    top_k: jax.Array  # i32[B]; V when disabled
    top_p: jax.Array  # f32[B]; 1 when disabled
    min_p: jax.Array  # f32[B]; 0 when disabled
    repetition_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    rng_words: jax.Array  # u32[B, 4]: (stream, seed_hi, seed_lo, counter), see module docstring
    token_counts: jax.Array | None  # i32[B, V] occurrences in the output so far; iff use_penalties
    prompt_mask: jax.Array | None  # bool[B, V] token occurs in the prompt; iff use_penalties
    # i32[B, S]: token ids to forbid this step (EOS/stop tokens of rows still below min_tokens),
    # padded with V (out of range, dropped by the scatter). None when no row needs it.
    banned_token_ids: jax.Array | None
    # i32[B, ceil(V / 32)]: bit t of row b set = token t allowed (structured outputs: the grammar's mask
    # for the next token; all ones for free rows). None when no row is constrained.
    allowed_bitmask: jax.Array | None
    # i32[B, S] / f32[B, S]: logit_bias pairs added to the logits, ids padded with V (dropped). None when
    # no row has a logit_bias.
    bias_ids: jax.Array | None
    bias_values: jax.Array | None
    # Static flags (part of the jit cache key). Filters only count non-greedy rows.
    all_greedy: bool
    use_penalties: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool


def build_sampling_batch(
    params_list: Sequence[SamplingParams],
    generated_counts: Sequence[int],
    bucket: int,
    vocab_size: int,
    prompt_token_ids_list: Sequence[Sequence[int]] | None = None,
    output_token_ids_list: Sequence[Sequence[int]] | None = None,
    *,
    step_seed: int | None = None,
    eos_token_ids: Sequence[int] = (),
    allowed_bitmask: np.ndarray | None = None,
    extra_banned: dict[int, list[int]] | None = None,
) -> SamplingBatch:
    """Packs one step's requests (row i = params_list[i]) into a `SamplingBatch` padded to `bucket`.

    generated_counts[i]: tokens request i has generated so far (its seeded-rng counter, and the
        min_tokens check). The token ids are only needed when some request uses penalties: then
        `prompt_token_ids_list` and `output_token_ids_list` must be given.
    step_seed: seeds this step's unseeded rows; pass a value that differs per engine step (e.g. a
        step counter mixed with an engine seed) for reproducible runs. None draws a random one.
    eos_token_ids: the model's EOS ids, banned (with stop_token_ids) for rows below min_tokens.
    allowed_bitmask: int32 [bucket, ceil(V / 32)] of allowed tokens per row (structured outputs), or None.
    extra_banned: more token ids to forbid this step, by row (bad_words).
    """
    n = len(params_list)
    if n > bucket:
        raise ValueError(f"{n} requests do not fit in a batch bucket of {bucket}")
    if len(generated_counts) != n:
        raise ValueError(f"got {len(generated_counts)} generated_counts for {n} requests")
    if step_seed is None:
        step_seed = secrets.randbits(64)

    # Padding rows: greedy (temperature 0) with neutral parameters.
    temperature = np.zeros(bucket, np.float32)
    top_k = np.full(bucket, vocab_size, np.int32)
    top_p = np.ones(bucket, np.float32)
    min_p = np.zeros(bucket, np.float32)
    repetition = np.ones(bucket, np.float32)
    presence = np.zeros(bucket, np.float32)
    frequency = np.zeros(bucket, np.float32)
    rng_words = np.zeros((bucket, 4), np.uint32)

    for row, (params, count) in enumerate(zip(params_list, generated_counts)):
        if not params.is_greedy:
            temperature[row] = params.temperature
            if params.top_k > 0:
                top_k[row] = min(params.top_k, vocab_size)
            top_p[row] = params.top_p
            min_p[row] = params.min_p
        repetition[row] = params.repetition_penalty
        presence[row] = params.presence_penalty
        frequency[row] = params.frequency_penalty
        rng_words[row] = _rng_words(params.seed, count, row, step_seed)

    sampled = temperature > 0
    use_penalties = any(p.uses_penalties for p in params_list)
    token_counts = prompt_mask = None
    if use_penalties:
        token_counts, prompt_mask = _penalty_tensors(params_list, bucket, vocab_size, prompt_token_ids_list, output_token_ids_list)

    host = SamplingBatch(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition,
        presence_penalty=presence,
        frequency_penalty=frequency,
        rng_words=rng_words,
        token_counts=token_counts,
        prompt_mask=prompt_mask,
        banned_token_ids=_banned_tokens(params_list, generated_counts, bucket, vocab_size, eos_token_ids, extra_banned),
        allowed_bitmask=allowed_bitmask,
        **_logit_bias(params_list, bucket, vocab_size),
        all_greedy=not sampled.any(),
        use_penalties=use_penalties,
        use_top_k=bool((sampled & (top_k < vocab_size)).any()),
        use_top_p=bool((sampled & (top_p < 1.0)).any()),
        use_min_p=bool((sampled & (min_p > 0.0)).any()),
    )
    # Host arrays: the jitted `sample` moves them with its other arguments. A separate jax.device_put of
    # the tree cost ~0.35 ms per engine step on CPU, more than the greedy sampling itself.
    return host


def _logit_bias(params_list: Sequence[SamplingParams], bucket: int, vocab_size: int) -> dict:
    width = max((len(p.logit_bias) for p in params_list), default=0)
    if not width:
        return {"bias_ids": None, "bias_values": None}
    width = 1 << (width - 1).bit_length()  # powers of two: few distinct shapes for the jit cache
    ids = np.full((bucket, width), vocab_size, np.int32)
    values = np.zeros((bucket, width), np.float32)
    for row, params in enumerate(params_list):
        for k, (token, bias) in enumerate(params.logit_bias):
            ids[row, k], values[row, k] = token, bias
    return {"bias_ids": ids, "bias_values": values}


def _rng_words(seed: int | None, generated: int, row: int, step_seed: int) -> tuple[int, int, int, int]:
    if seed is None:
        stream, seed64, counter = _UNSEEDED_STREAM, step_seed & _U64, row
    else:
        # Python ints are unbounded (and may be negative); reduce to 64 bits.
        stream, seed64, counter = _SEEDED_STREAM, seed & _U64, generated
    return stream, seed64 >> 32, seed64 & _U32, counter & _U32


def _penalty_tensors(
    params_list: Sequence[SamplingParams],
    bucket: int,
    vocab_size: int,
    prompt_token_ids_list: Sequence[Sequence[int]] | None,
    output_token_ids_list: Sequence[Sequence[int]] | None,
) -> tuple[np.ndarray, np.ndarray]:
    if prompt_token_ids_list is None or output_token_ids_list is None:
        raise ValueError(
            "a request uses repetition/presence/frequency penalties: build_sampling_batch needs "
            "prompt_token_ids_list and output_token_ids_list"
        )
    counts = np.zeros((bucket, vocab_size), np.int32)
    prompt_mask = np.zeros((bucket, vocab_size), np.bool_)
    for row, params in enumerate(params_list):
        # Rows without penalties keep zero counts / an empty mask, which leaves their logits as is.
        if not params.uses_penalties:
            continue
        output_ids = _checked_ids(output_token_ids_list[row], vocab_size, "output")
        counts[row] = np.bincount(output_ids, minlength=vocab_size)
        if params.repetition_penalty != 1.0:
            prompt_mask[row, _checked_ids(prompt_token_ids_list[row], vocab_size, "prompt")] = True
    return counts, prompt_mask


def _checked_ids(ids: Sequence[int], vocab_size: int, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise ValueError(f"{what} token id out of range [0, {vocab_size})")
    return arr


def _banned_tokens(
    params_list: Sequence[SamplingParams],
    generated_counts: Sequence[int],
    bucket: int,
    vocab_size: int,
    eos_token_ids: Sequence[int],
    extra_banned: dict[int, list[int]] | None = None,
) -> np.ndarray | None:
    """EOS/stop token ids that rows below their min_tokens must not sample (as vLLM does), plus
    `extra_banned` (bad_words)."""
    banned: dict[int, list[int]] = {row: list(ids) for row, ids in (extra_banned or {}).items() if ids}
    for row, (params, count) in enumerate(zip(params_list, generated_counts)):
        if count < params.min_tokens:
            ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            if ids:
                banned[row] = banned.get(row, []) + ids
    if not banned:
        return None
    # Round the width up to a power of two so the jit cache sees few distinct shapes.
    width = 1 << (max(len(ids) for ids in banned.values()) - 1).bit_length()
    out = np.full((bucket, width), vocab_size, np.int32)
    for row, ids in banned.items():
        out[row, : len(ids)] = ids
    return out


# ================================================================================ sampling (device)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32[B]
    token_logprob: jax.Array  # f32[B], log_softmax(raw logits)[token]
    top_logprob_ids: jax.Array  # i32[B, K], K = num_logprobs, best first
    top_logprobs: jax.Array  # f32[B, K]


@functools.partial(jax.jit, static_argnames=("num_logprobs", "token_logprobs"))
def sample(
    logits: jax.Array, batch: SamplingBatch, num_logprobs: int = 0, rows: jax.Array | None = None, token_logprobs: bool = True
) -> SamplerOutput:
    """Picks one token per row. `num_logprobs` (static): top logprobs to return, max over rows.
    `token_logprobs` (static): whether the chosen tokens' logprobs are wanted at all; without them (and
    without top logprobs) no pass over the logits computes a softmax normaliser (zeros are returned).

    `rows` (i32[B], optional): batch row i samples from `logits[rows[i]]`. The gather runs inside this
    jitted function; done eagerly on the engine's logits it cost more than greedy sampling itself.
    """
    if rows is not None:
        logits = logits[rows]
    raw = logits.astype(jnp.float32)
    processed = raw
    if batch.bias_ids is not None:  # OpenAI applies logit_bias first; bans and masks still win over it
        rows_ = jnp.arange(processed.shape[0])[:, None]
        processed = processed.at[rows_, batch.bias_ids].add(batch.bias_values, mode="drop")
    if batch.banned_token_ids is not None:
        processed = ban_tokens(processed, batch.banned_token_ids)
    if batch.allowed_bitmask is not None:
        processed = apply_bitmask(processed, batch.allowed_bitmask)
    if batch.use_penalties:
        processed = apply_penalties(processed, batch)
    # Greedy picks from the penalised logits; temperature would not change the argmax anyway.
    token_ids = argmax_rows(processed)
    if not batch.all_greedy:
        drawn = _draw(filter_logits(processed, batch), batch.rng_words)
        token_ids = jnp.where(batch.temperature > 0, drawn, token_ids)
    if not token_logprobs and not num_logprobs:
        empty_ids, empty = jnp.zeros((raw.shape[0], 0), jnp.int32), jnp.zeros((raw.shape[0], 0), jnp.float32)
        return SamplerOutput(token_ids, jnp.zeros(raw.shape[:1], jnp.float32), empty_ids, empty)
    return _logprobs(raw, token_ids, num_logprobs)


def argmax_rows(x: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first maximum; a NaN counts as the maximum), int32, as a max and
    a min instead of XLA's variadic (value, index) reduction, which XLA:CPU runs as a scalar loop: at
    [64, 16384] 5.3 ms against 0.5 ms, at [16, 151936] 11.7 against 1.4 ms; one [1, 16384] row 160 -> 52 us."""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def ban_tokens(logits: jax.Array, banned_token_ids: jax.Array) -> jax.Array:
    """Sets logits[b, banned_token_ids[b, j]] to -inf; ids >= V (padding) are dropped."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, banned_token_ids].set(-jnp.inf, mode="drop")


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets logits[b, t] to -inf where bit t of row b is clear (32 tokens per int32 word, low bit first)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Repetition penalty (HF/vLLM: over prompt + output tokens, positive logits divided by the
    penalty, negative ones multiplied) then OpenAI frequency/presence penalties (output only)."""
    counts = batch.token_counts
    seen = batch.prompt_mask | (counts > 0)
    rep = batch.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - batch.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - batch.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)


def filter_logits(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """Temperature, top-k, top-p and min-p for the sampled rows; filtered tokens become -inf.

    Greedy rows pass through unscaled (their result is discarded in favour of the argmax).
    """
    temperature = jnp.where(batch.temperature > 0, batch.temperature, 1.0)
    logits = logits / temperature[:, None]
    if batch.use_top_k or batch.use_top_p:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p, batch.use_top_k, batch.use_top_p)
    if batch.use_min_p:
        logits = _min_p(logits, batch.min_p)
    return logits


def _top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, use_top_k: bool, use_top_p: bool) -> jax.Array:
    """Keeps, per row, the top-k tokens and then the top-p nucleus of their renormalised
    distribution; the rest become -inf. Tokens tied with a cut-off are kept.

    Each cut-off is found as a per-row logit threshold by bisection rather than a full sort: XLA's
    CPU sort takes ~210 ms on [64, 16K] logits, 32 masked reductions ~13 ms, and the kept set is
    the same one a sort would give. (Token i in descending order is in the nucleus iff the mass
    strictly before it is < top_p, so the most likely token is always kept.)
    """
    keys = _ordered_keys(logits)
    if use_top_k:
        # k-th largest key: the smallest m with fewer than k keys above it.
        kth = _bisect_threshold(keys, jnp.ones_like(logits), top_k.astype(jnp.float32))
        logits = jnp.where(keys >= kth[:, None], logits, -jnp.inf)
    if use_top_p:
        probs = jax.nn.softmax(logits, axis=-1)
        # Nucleus edge: the smallest m with mass(keys > m) < top_p.
        edge = _bisect_threshold(keys, probs, top_p)
        # With top_p == 1 rounding could make the mass above a tail token round to 1 and drop it.
        keep_all = top_p >= 1.0
        logits = jnp.where(keep_all[:, None] | (keys >= edge[:, None]), logits, -jnp.inf)
    return logits


def _ordered_keys(x: jax.Array) -> jax.Array:
    """Maps f32 to i32 so that integer order equals float order (flip the magnitude bits of
    negatives), which lets bisection run exactly over the 2**32 possible values."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _bisect_threshold(keys: jax.Array, weights: jax.Array, limit: jax.Array) -> jax.Array:
    """Per row, the smallest key m in [row min, row max] with sum(weights[keys > m]) < limit.

    The predicate is monotone in m and true at the row max (nothing is above it, limit > 0), so
    32 halvings of the int32 range pin m exactly.
    """
    lo = jnp.min(keys, axis=-1)
    hi = jnp.max(keys, axis=-1)

    def halve(_, bounds):
        lo, hi = bounds
        # floor((lo + hi) / 2) without int32 overflow.
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)
        above = jnp.sum(jnp.where(keys > mid[:, None], weights, 0.0), axis=-1)
        ok = above < limit
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def _min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drops tokens with p < min_p * p_max. Done in logit space (log p - log p_max = logit -
    logit_max), which is also why the order relative to top-k/top-p does not matter: filtering
    renormalises all surviving probabilities by the same factor. min_p = 0 gives log 0 = -inf."""
    cutoff = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def _row_key(words: jax.Array) -> jax.Array:
    key = jax.random.key(0)
    for i in range(4):
        key = jax.random.fold_in(key, words[i])
    return key


def _draw(logits: jax.Array, rng_words: jax.Array) -> jax.Array:
    """Gumbel-max draw from softmax(logits); -inf logits are never drawn.

    vmap over rows: each row's noise depends only on its own key, never on the batch.
    """
    keys = jax.vmap(_row_key)(rng_words)
    noise = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
    # The barrier stops XLA from fusing the (costly) noise generation into the argmax reduction,
    # which runs it single-threaded on CPU: ~60 ms -> ~14 ms at [64, 16K]. Values are unchanged.
    perturbed = jax.lax.optimization_barrier(logits + noise)
    return argmax_rows(perturbed)


def _logprobs(raw: jax.Array, token_ids: jax.Array, num_logprobs: int) -> SamplerOutput:
    # logits - logsumexp == log_softmax, without materialising the [B, V] result.
    lse = jax.nn.logsumexp(raw, axis=-1)
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0] - lse
    if num_logprobs > 0:
        top_values, top_ids = jax.lax.top_k(raw, num_logprobs)
        top_logprobs = top_values - lse[:, None]
    else:
        top_ids = jnp.zeros((raw.shape[0], 0), jnp.int32)
        top_logprobs = jnp.zeros((raw.shape[0], 0), jnp.float32)
    return SamplerOutput(token_ids, chosen, top_ids.astype(jnp.int32), top_logprobs)


# ================================================================================ prompt logprobs


@dataclasses.dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token at that position


def prompt_logprobs(logits: jax.Array, prompt_ids: Sequence[int], k: int) -> list[dict[int, Logprob] | None]:
    """Per prompt position: {prompt token: its Logprob, then the top-k tokens, best first}.

    `logits[t]` (f32[T, V], T >= len(prompt_ids) - 1) predicts token t + 1, so position 0 has no
    logprob and is None, as in vLLM. Only [T, k]-sized results leave the device.
    """
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    if ids.size == 0:
        return []
    result: list[dict[int, Logprob] | None] = [None]
    if ids.size == 1:
        return result
    if logits.shape[0] < ids.size - 1:
        raise ValueError(f"need logits for {ids.size - 1} positions, got {logits.shape[0]}")
    arrays = _prompt_logprob_arrays(jnp.asarray(logits), jnp.asarray(ids[1:]), k)
    return result + prompt_logprob_entries(arrays, ids[1:].tolist(), k)


def prompt_row_logprobs(logits: jax.Array, first_row: int, next_ids: Sequence[int], k: int):
    """Dispatches (returns at once) the logprob arrays of `len(next_ids)` consecutive rows of a step's logits
    from `first_row`, row j predicting `next_ids[j]`; padded to a power of two of rows, so few programs
    compile. `prompt_logprob_entries` turns them into entries on the host."""
    n = len(next_ids)
    bucket = min(max(16, 1 << (n - 1).bit_length()), logits.shape[0])
    idx = np.minimum(first_row + np.arange(bucket, dtype=np.int32), logits.shape[0] - 1)
    ids = np.zeros((bucket,), np.int32)
    ids[:n] = next_ids
    return _row_logprob_arrays(logits, idx, ids, k)


def prompt_logprob_entries(arrays, next_ids: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """Per predicted token: {that token: its Logprob, then the top-k tokens, best first}."""
    token_lp, rank, top_ids, top_lp = jax.device_get(arrays)
    out = []
    for pos, token in enumerate(next_ids):
        entry = {int(token): Logprob(float(token_lp[pos]), int(rank[pos]))}
        for j in range(k):
            entry.setdefault(int(top_ids[pos, j]), Logprob(float(top_lp[pos, j]), j + 1))
        out.append(entry)
    return out


@functools.partial(jax.jit, static_argnames=("k",))
def _row_logprob_arrays(logits: jax.Array, idx: jax.Array, next_ids: jax.Array, k: int):
    return _prompt_logprob_arrays(logits[idx], next_ids, k)


@functools.partial(jax.jit, static_argnames=("k",))
def _prompt_logprob_arrays(logits: jax.Array, next_ids: jax.Array, k: int):
    logprobs = jax.nn.log_softmax(logits[: next_ids.shape[0]].astype(jnp.float32), axis=-1)
    token_lp = jnp.take_along_axis(logprobs, next_ids[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(logprobs > token_lp[:, None], axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    return token_lp, rank, top_ids, top_lp


# ================================================================================ stop checking


class StopCheck(NamedTuple):
    finished: bool
    reason: Literal["stop", "length"] | None
    text: str  # the whole output text so far, trimmed when a stop condition removes text
    # What ended it, as vLLM reports it: the stop string or stop token id; None for EOS/length.
    stop_reason: str | int | None = None


def check_stop(
    output_ids: Sequence[int],
    text_so_far: str,
    new_text: str,
    params: SamplingParams,
    eos_token_ids: Sequence[int] | int = (),
) -> StopCheck:
    """Whether a request is done after its newest token (`output_ids[-1]`, whose text is
    `new_text`, appended to `text_so_far`), following vLLM's StopChecker:

    1. before `min_tokens` tokens nothing stops it (the sampler also bans EOS/stop tokens then);
    2. EOS (unless ignore_eos) or a stop token id -> "stop", that token's text dropped;
    3. a stop string -> "stop", text from the stop string on dropped (kept with
       include_stop_str_in_output, text after it is dropped either way);
    4. max_tokens reached -> "length".

    Returns StopCheck(finished, reason, text, stop_reason); `text` is the whole output text.
    """
    text = text_so_far + new_text
    count = len(output_ids)
    if count == 0 or count < params.min_tokens:
        return StopCheck(False, None, text)
    if isinstance(eos_token_ids, int):
        eos_token_ids = (eos_token_ids,)

    last = output_ids[-1]
    token_text = text if params.include_stop_str_in_output else text_so_far
    if not params.ignore_eos and last in eos_token_ids:
        return StopCheck(True, "stop", token_text)
    if last in params.stop_token_ids:
        return StopCheck(True, "stop", token_text, last)

    match = _stop_string_match(text, len(new_text), params)
    if match is not None:
        cut, stop = match
        return StopCheck(True, "stop", text[:cut], stop)

    if count >= params.max_tokens:
        return StopCheck(True, "length", text)
    return StopCheck(False, None, text)


def _stop_string_match(text: str, new_chars: int, params: SamplingParams) -> tuple[int, str] | None:
    """(where to cut `text`, stop string) for the earliest stop string overlapping the new text.

    Only matches overlapping the new text are searched: earlier ones would have stopped earlier.
    """
    best: tuple[int, str] | None = None
    for stop in params.stop:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return (index + len(stop) if params.include_stop_str_in_output else index), stop
