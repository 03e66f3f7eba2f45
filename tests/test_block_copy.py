"""Whole blocks between page pools and a blocks-first array (kernels/block_copy.py): the CPU kernels'
scatter and gather (kernels/cpu/block_copy.cc) equal the XLA paths for every layout the engine uses, and the
engine's runner selects them on one CPU device, so the KV handoff and host-tier tests run them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_harness import ENGINE_ARGS

from kernels import block_copy, cpu_ffi
from workers.engine import EngineConfig
from workers.engine.engine import EngineCore
from workers.models.make_model import make_model


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert cpu_ffi.available(), "g++ is on every development and CI machine"


def _pages(shapes, num_blocks, page, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((num_blocks, page, *s)).astype(dtype)) for s in shapes]


# (layer page dims, transport width): one shape for all layers (width None), and layers of different
# shapes padded to one row width (as DeepSeek's MLA / Gemma 4's layers share a transport layout).
LAYOUTS = [([(4, 8)] * 3, None), ([(2, 8), (1, 6), (4, 4)], 16)]


@pytest.mark.parametrize("shapes,width", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_scatter_equals_xla_and_drops_ids_past_the_pool(shapes, width, dtype):
    num_blocks = 12
    data = block_copy.gather_blocks_first_jit(_pages(shapes, num_blocks, 4, dtype, seed=1), np.arange(5, dtype=np.int32), width)
    ids = np.array([2, 9, num_blocks, 0, num_blocks + 3], np.int32)  # two padding ids: dropped
    want = block_copy.scatter_blocks_first_jit(_pages(shapes, num_blocks, 4, dtype), ids, data, impl="xla")
    got = block_copy.scatter_blocks_first_jit(_pages(shapes, num_blocks, 4, dtype), ids, data, impl="cpu")
    others = np.array([1, 3, 4, 5, 6, 7, 8, 10, 11])
    for g, w, u in zip(got, want, _pages(shapes, num_blocks, 4, dtype)):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(np.asarray(g)[others], np.asarray(u)[others])


@pytest.mark.parametrize("shapes,width", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_gather_equals_xla_for_every_id_table(shapes, width, dtype):
    """Rows zero-padded to the transport width; ids as XLA's gather takes them: a negative one from the end,
    one past the pool clamped to its last block (the engine pads with block 0, but the paths must agree)."""
    pages = _pages(shapes, 12, 4, dtype, seed=5)
    ids = np.array([3, 0, 11, 5, -1, 12, 40], np.int32)
    per_layer = [ids, ids[::-1].copy(), np.roll(ids, 2)][: len(pages)]
    for table in (ids, per_layer):
        want = block_copy.gather_blocks_first_jit(pages, table, width, "xla")
        got = block_copy.gather_blocks_first_jit(pages, table, width, "cpu")
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("shapes,width", LAYOUTS)
@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_the_export_gather_is_priced_to_run_off_the_dispatching_thread(shapes, width, impl):
    """XLA:CPU runs a program priced under 1,000 flops inline on the thread that dispatches it: the export's
    copy (~3 flops per id; the kernel's custom call 0) would block the engine thread for milliseconds. Same
    blocks as the plain gather; a table of ids per layer (a sliding-window group) works too."""
    pages = _pages(shapes, 12, 4, seed=2)
    ids = np.array([3, 0, 11, 5], np.int32)
    compiled = block_copy.gather_blocks_first_async_jit.lower(pages, ids, width, impl).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] >= 1000
    assert block_copy.gather_blocks_first_jit.lower(pages, ids, width, impl).compile().cost_analysis()["flops"] < 1000  # why
    got, _ = block_copy.gather_blocks_first_async_jit(pages, ids, width, impl)
    np.testing.assert_array_equal(got, block_copy.gather_blocks_first_jit(pages, ids, width))
    per_layer = [ids, ids[::-1].copy(), ids][: len(pages)]
    got, _ = block_copy.gather_blocks_first_async_jit(pages, per_layer, width, impl)
    np.testing.assert_array_equal(got, block_copy.gather_blocks_first_jit(pages, per_layer, width))


@pytest.mark.parametrize("shapes,width", LAYOUTS)
@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_the_import_scatter_is_priced_to_run_off_the_dispatching_thread(shapes, width, impl):
    """The decode side's write of an imported chunk, like the export's gather: the plain scatter (the
    kernel's custom call, 0 flops) is priced under XLA:CPU's 1,000-flop inline line and would run on the
    engine thread; the async variant is not, and writes the same blocks (ids past the pool dropped)."""
    num_blocks = 12
    data = block_copy.gather_blocks_first_jit(_pages(shapes, num_blocks, 4, seed=6), np.arange(3, dtype=np.int32), width)
    ids = np.array([7, num_blocks, 1], np.int32)
    pages = _pages(shapes, num_blocks, 4)
    cost = block_copy.scatter_blocks_first_async_jit.lower(pages, ids, data, impl).compile().cost_analysis()
    assert (cost[0] if isinstance(cost, list) else cost)["flops"] >= 1000
    if impl == "cpu":  # (XLA's own scatter may be priced above the line on its own)
        assert block_copy.scatter_blocks_first_jit.lower(pages, ids, data, impl).compile().cost_analysis()["flops"] < 1000  # why
    got, done = block_copy.scatter_blocks_first_async_jit(pages, ids, data, impl)
    jax.block_until_ready(done)
    want = block_copy.scatter_blocks_first_jit(_pages(shapes, num_blocks, 4), ids, data, impl="xla")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_scatter_with_an_id_table_per_layer():
    num_blocks = 8
    data = block_copy.gather_blocks_first_jit(_pages([(2, 4)] * 2, num_blocks, 2, seed=3), np.array([1, 2], np.int32), None)
    ids = [np.array([4, 5], np.int32), np.array([num_blocks, 7], np.int32)]  # layer 1's first block let go
    got = block_copy.scatter_blocks_first_jit(_pages([(2, 4)] * 2, num_blocks, 2), ids, data, impl="cpu")
    want = block_copy.scatter_blocks_first_jit(_pages([(2, 4)] * 2, num_blocks, 2), ids, data, impl="xla")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_the_kernel_is_chosen_on_one_cpu_device_only(tmp_path):
    one = [jax.device_put(jnp.zeros((4, 2, 2)), jax.devices("cpu")[0])]
    assert block_copy.impl_for(one) == "cpu"
    if len(jax.devices("cpu")) > 1:
        mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
        split = [jax.device_put(jnp.zeros((4, 2, 2)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))]
        assert block_copy.impl_for(split) == "xla"
    model = make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=1)
    core = EngineCore(EngineConfig(model=str(model), **{**ENGINE_ARGS, "warmup": False}), show_progress=False)
    assert core.runner.block_copy_impl == "cpu"  # so the KV handoff and host-tier tests run the kernel


def test_scatter_converts_data_of_another_dtype():
    """The kernel copies bytes: float32 data into bfloat16 pages must arrive converted, as XLA's `.set` does."""
    pages = _pages([(2, 4)] * 2, 6, 2, jnp.bfloat16)
    data = jnp.asarray(np.random.default_rng(4).standard_normal((2, 2, 2, 2, 4)).astype(np.float32))
    ids = np.array([1, 4], np.int32)
    got = block_copy.scatter_blocks_first_jit(pages, ids, data, impl="cpu")
    want = block_copy.scatter_blocks_first_jit(_pages([(2, 4)] * 2, 6, 2, jnp.bfloat16), ids, data, impl="xla")
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
