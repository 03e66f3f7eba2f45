"""Weight declarations: each leaf declared once (shape, logical axes, where it lives in the checkpoint).

A family builds a *plan*: the `ModelWeights` pytree with a `WeightSpec` at every leaf. From the plan we
derive the checkpoint keys we expect, shape checks, shardings, random ("dummy") weights, and the loader,
which places every tensor directly into its target sharding with `jax.make_array_from_callback` so a
host reads only the slices its devices hold.

Sources compose: `Tensor` (one checkpoint tensor), `Concat` (fuse along dim 0, e.g. gate|up or q|k|v),
`Stack` (per-expert tensors stacked into [E, ...]), `Rows` (rows reordered, e.g. a projection fused per
head group split into its parts); `OneOf` accepts alternative on-disk layouts (the per-expert keys
Hugging Face writes, or transformers 5.x fused expert tensors).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelLoadError
from .safetensors_io import CheckpointReader

Index = tuple[slice, ...]


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


# ---------------------------------------------------------------------------------------------
# Sources: where a leaf's values come from in the checkpoint.


@dataclass(frozen=True)
class Tensor:
    key: str
    shape: tuple[int, ...]

    def keys(self) -> Iterator[str]:
        yield self.key

    def present(self, reader: CheckpointReader) -> bool:
        return self.key in reader

    def check(self, reader: CheckpointReader) -> None:
        if self.key not in reader:
            raise ModelLoadError(f"missing tensor '{self.key}' (expected shape {_fmt(self.shape)})")
        got = reader.shape(self.key)
        if got != self.shape:
            raise ModelLoadError(f"tensor '{self.key}' has shape {_fmt(got)}, expected {_fmt(self.shape)}")

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        return np.asarray(reader.array(self.key)[index])


@dataclass(frozen=True)
class Concat:
    """Parts concatenated along dim 0; reads only the parts a slice overlaps."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.parts[0].shape
        return (sum(p.shape[0] for p in self.parts), *first[1:])

    def keys(self) -> Iterator[str]:
        for p in self.parts:
            yield from p.keys()

    def present(self, reader: CheckpointReader) -> bool:
        return all(p.present(reader) for p in self.parts)

    def check(self, reader: CheckpointReader) -> None:
        for p in self.parts:
            p.check(reader)

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        rows = index[0] if index else slice(None)
        start, stop, _ = rows.indices(self.shape[0])
        pieces, offset = [], 0
        for p in self.parts:
            n = p.shape[0]
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi:
                pieces.append(p.read(reader, (slice(lo - offset, hi - offset), *index[1:])))
            offset += n
        return np.concatenate(pieces, axis=0)


@dataclass(frozen=True)
class Stack:
    """Parts stacked along a new dim 0 (experts); reads only the experts a slice covers."""

    parts: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    keys = Concat.keys
    present = Concat.present
    check = Concat.check

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        rows = index[0] if index else slice(None)
        chosen = range(*rows.indices(len(self.parts)))
        return np.stack([self.parts[e].read(reader, index[1:]) for e in chosen])


@dataclass(frozen=True)
class Rows:
    """The rows of one source in another order: row i is the source's row `order[i]` (un-interleaving a
    fused projection at load time). `parts` holds the single source, so code walking Concat/Stack trees
    (quantisation, make-model) walks this one too."""

    parts: tuple[Any]
    order: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.order), *self.parts[0].shape[1:])

    keys = Concat.keys
    present = Concat.present
    check = Concat.check

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        rows = index[0] if index else slice(None)
        wanted = np.asarray(self.order)[rows]
        lo, hi = int(wanted.min()), int(wanted.max()) + 1  # read the span the wanted rows lie in
        return self.parts[0].read(reader, (slice(lo, hi), *index[1:]))[wanted - lo]


def grouped_rows(group_sizes: tuple[int, ...], num_groups: int) -> tuple[int, ...]:
    """The order that turns `num_groups` groups of [part 0 | part 1 | ...] (sizes `group_sizes`) into
    [part 0 of every group | part 1 of every group | ...]."""
    stride, starts = sum(group_sizes), np.cumsum((0, *group_sizes[:-1]))
    return tuple(g * stride + int(start) + i for start, size in zip(starts, group_sizes) for g in range(num_groups) for i in range(size))


@dataclass(frozen=True)
class OneOf:
    """Alternative layouts of the same leaf; the first fully present one is used."""

    options: tuple[Any, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.options[0].shape

    def keys(self) -> Iterator[str]:
        for o in self.options:
            yield from o.keys()

    def chosen(self, reader: CheckpointReader):
        return next((o for o in self.options if o.present(reader)), self.options[0])

    def present(self, reader: CheckpointReader) -> bool:
        return any(o.present(reader) for o in self.options)

    def check(self, reader: CheckpointReader) -> None:
        self.chosen(reader).check(reader)

    def read(self, reader: CheckpointReader, index: Index) -> np.ndarray:
        return self.chosen(reader).read(reader, index)


def fused_experts(per_expert: list[Any], fused_key: str) -> OneOf:
    """Per-expert tensors stacked to [E, ...], or the transformers 5.x fused tensor of that shape."""
    stacked = Stack(tuple(per_expert))
    return OneOf((stacked, Tensor(fused_key, stacked.shape)))


# ---------------------------------------------------------------------------------------------
# Leaf declarations and sharding.


@dataclass(frozen=True)
class WeightSpec:
    source: Any  # Tensor | Concat | Stack | Rows | OneOf
    logical_axes: tuple[str | None, ...]
    # Initialiser scale for dummy weights; norms use ones (scale None), zero-centred norms zeros (0.0).
    init_scale: float | None = 0.02

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    # Placement lives on the leaf so a leaf made of several arrays (quantised weights: packed values plus
    # scales, `workers/models/quant.py`) can override both.
    def load(self, reader: CheckpointReader, mesh: Mesh, rules, dtype) -> jax.Array:
        """This leaf read straight into its sharding: each host reads only the slices its devices hold."""
        sharding = NamedSharding(mesh, partition_spec(self.logical_axes, rules))
        np_dtype = np.dtype(jnp.dtype(dtype))

        def fetch(index: Index) -> np.ndarray:
            return self.source.read(reader, index).astype(np_dtype, copy=False)

        return jax.make_array_from_callback(self.shape, sharding, fetch)

    def dummy(self, key: jax.Array, mesh: Mesh, rules, dtype) -> jax.Array:
        """Random values of this leaf's shape and sharding (ones for norms)."""
        sharding = NamedSharding(mesh, partition_spec(self.logical_axes, rules))
        return _random_fn(self.shape, jnp.dtype(dtype), self.init_scale, sharding)(key)


@functools.lru_cache(maxsize=None)
def _random_fn(shape: tuple[int, ...], dtype, scale: float | None, sharding: NamedSharding):
    """One compiled initialiser per distinct leaf kind: the layers of a model share theirs."""
    if scale is None:
        make = lambda k: jnp.ones(shape, dtype)
    else:
        make = lambda k: (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)
    return jax.jit(make, out_shardings=sharding)


def linear_spec(key: str, out_dim: int, in_dim: int, axes=("out", "in")) -> WeightSpec:
    return WeightSpec(Tensor(key, (out_dim, in_dim)), axes)


def norm_spec(key: str, dim: int, zero_centered: bool = False) -> WeightSpec:
    """A norm weight: ones for dummy weights, or zeros when it is an offset from one (norm(x) * (1 + w))."""
    return WeightSpec(Tensor(key, (dim,)), (None,), init_scale=0.0 if zero_centered else None)


# Logical axis -> mesh axis. Everything is replicated unless a rule says otherwise; parallel layouts
# change this table, not the model.
DEFAULT_RULES: dict[str, str | None] = {"experts": None}


def partition_spec(logical_axes, rules: dict[str, str | None]) -> PartitionSpec:
    mesh_axes = [rules.get(a) if a else None for a in logical_axes]
    used = [m for m in mesh_axes if m is not None]
    if len(used) != len(set(used)):
        raise ValueError(f"two logical axes of {logical_axes} map to one mesh axis: {mesh_axes}")
    return PartitionSpec(*mesh_axes)


def is_spec(x) -> bool:
    return isinstance(x, WeightSpec)


def plan_leaves(plan) -> list[WeightSpec]:
    return jax.tree.leaves(plan, is_leaf=is_spec)


def expected_keys(plan) -> set[str]:
    return {k for spec in plan_leaves(plan) for k in spec.source.keys()}


def check_checkpoint(plan, reader: CheckpointReader, ignorable: set[str] = frozenset()) -> None:
    """Every declared tensor present with the right shape; nothing unexpected left over."""
    for spec in plan_leaves(plan):
        spec.source.check(reader)
    unexpected = sorted(reader.keys() - expected_keys(plan) - set(ignorable))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelLoadError(f"unexpected tensor '{unexpected[0]}' in checkpoint{more}")


def load_weights(plan, reader: CheckpointReader, mesh: Mesh, rules, dtype, progress=None):
    """Reads every leaf straight into its sharding; `progress(n)` is called after each leaf."""

    def load_leaf(spec: WeightSpec):
        arr = spec.load(reader, mesh, rules, dtype)
        if progress:
            progress(1)
        return arr

    return jax.tree.map(load_leaf, plan, is_leaf=is_spec)


def dummy_weights(plan, mesh: Mesh, rules, dtype, seed: int = 0):
    """Random weights of the right shapes and shardings, without reading a checkpoint."""
    leaves, treedef = jax.tree.flatten(plan, is_leaf=is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [spec.dummy(key, mesh, rules, dtype) for spec, key in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def num_bytes(weights) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(weights))
