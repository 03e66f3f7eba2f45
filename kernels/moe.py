"""Routed-expert computation: top-k routing and the expert SwiGLU over [E, ...] stacked weights.

Weight layout follows the checkpoints' [out, in] convention, experts stacked first:
`gate_up` [E, 2I, H] (gate rows first, then up) and `down` [E, H, I].

Two portable paths, chosen in `routed_experts` from static shapes:
- `gather`: index the selected experts' weights per token. Reads only the active parameters, which is
  what a small decode batch should cost (XLA:CPU emulates ragged_dot densely over all experts).
- `sorted`: sort assignments by expert and run `jax.lax.ragged_dot` (the grouped matmul TPUs run as
  megablox GMM); right for prefill-sized batches.
Both compute in the weights' dtype with float32 accumulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Gather the per-token expert weights while tokens x top_k stays at or below this many assignments.
GATHER_MAX_ASSIGNMENTS = 64


def route_softmax_topk(
    router_logits: jax.Array, top_k: int, renormalize: bool
) -> tuple[jax.Array, jax.Array]:
    """Softmax over all experts in float32, then top-k; optionally renormalise the k weights."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def _swiglu(gate_up: jax.Array) -> jax.Array:
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _experts_gather(x, ids, weights, gate_up, down):
    h = jnp.einsum("th,tkih->tki", x, gate_up[ids], preferred_element_type=jnp.float32)
    act = _swiglu(h).astype(x.dtype)
    out = jnp.einsum("tki,tkhi->tkh", act, down[ids], preferred_element_type=jnp.float32)
    return jnp.einsum("tkh,tk->th", out, weights)


def _experts_sorted(x, ids, weights, gate_up, down):
    t, k = ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    xs = x[token_of]
    h = jax.lax.ragged_dot(
        xs, jnp.swapaxes(gate_up, 1, 2), group_sizes, preferred_element_type=jnp.float32
    )
    act = _swiglu(h).astype(x.dtype)
    out = jax.lax.ragged_dot(
        act, jnp.swapaxes(down, 1, 2), group_sizes, preferred_element_type=jnp.float32
    )
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((t, x.shape[-1]), jnp.float32).at[token_of].add(out)


def routed_experts(
    x: jax.Array,  # [T, H]
    ids: jax.Array,  # [T, k] int32 expert ids
    weights: jax.Array,  # [T, k] float32 routing weights
    gate_up: jax.Array,  # [E, 2I, H]
    down: jax.Array,  # [E, H, I]
    impl: str | None = None,
) -> jax.Array:
    """Sum over k of weight * down(silu(gate(x)) * up(x)) for each token's selected experts."""
    if impl is None:
        impl = "gather" if ids.size <= GATHER_MAX_ASSIGNMENTS else "sorted"
    fn = {"gather": _experts_gather, "sorted": _experts_sorted}[impl]
    return fn(x, ids, weights, gate_up, down).astype(x.dtype)
