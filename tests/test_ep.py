"""Expert-parallel MoE execution (`workers.models.moe_parallel`) against a dense one-hot float32 reference on
8 virtual CPU devices, for every dispatch mode and mesh; the hierarchical dispatch's fallback; and the
checks and environment handling of `workers.parallel`."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kernels import collectives
from kernels.moe import route_softmax_topk
from workers.engine.config import ParallelConfig
from workers.models.moe_parallel import DISPATCH_MODES, ExpertParallel
from workers.parallel import (
    ParallelConfigError,
    distributed_settings,
    layout_from_config,
    make_layout,
    make_mesh,
    parse_mesh,
    tpu_device_grid,
)

MESHES = [(1, 8), (2, 4), (4, 2), (8, 1)]
E, I, K = 16, 32, 4


def problem(tokens: int, hidden: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens, hidden))
    gate_up = jax.random.normal(keys[1], (E, 2 * I, hidden)) * 0.05
    down = jax.random.normal(keys[2], (E, hidden, I)) * 0.05
    weights, ids = route_softmax_topk(jax.random.normal(keys[3], (tokens, E)), K, True)
    return x, ids, weights, gate_up, down


def dense_reference(x, ids, weights, gate_up, down) -> np.ndarray:
    """Every expert on every token, combined with one-hot routing weights, in float64."""
    x, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
    combine = np.zeros((x.shape[0], E))
    np.add.at(combine, (np.arange(x.shape[0])[:, None], np.asarray(ids)), np.asarray(weights, np.float64))
    h = np.einsum("th,eih->tei", x, gate_up)
    gate, up = np.split(h, 2, axis=-1)
    act = gate / (1 + np.exp(-gate)) * up
    return np.einsum("tei,ehi,te->th", act, down, combine)


def run(ep: ExpertParallel, *args):
    return np.asarray(jax.jit(ep)(*args))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_every_mode_matches_the_dense_reference(shape):
    mesh = make_mesh(shape)
    args = problem(tokens=36, hidden=256)  # 36 rows: padded to 40 (5 per device) inside
    want = dense_reference(*args)
    outs = {}
    for mode in DISPATCH_MODES:
        outs[mode] = run(ExpertParallel(mesh, ("host", "chip"), mode), *args)
        np.testing.assert_allclose(outs[mode], want, atol=1e-5, err_msg=mode)
    # The all-to-all dispatch (the padded fallback on CPU) and EP over the inner axis only (each host
    # row a separate expert group) give the same result.
    a2a = ExpertParallel(mesh, ("host", "chip"), all_to_all_min_tokens=1)
    np.testing.assert_allclose(run(a2a, *args), want, atol=1e-5)
    if shape[1] > 1:
        np.testing.assert_allclose(run(ExpertParallel(mesh, ("chip",), "hierarchical"), *args), want, atol=1e-5)


def test_hierarchical_dispatch_layer_is_exact_where_it_splits():
    """hidden 512 on 2x4 (k = 4) and hidden 256 on 4x2 (k = 2): the column-split gather really runs, the
    gathered rows are bitwise the flat gather's, and fp8 pieces decode bitwise like the flat fp8 gather."""
    for shape, hidden in (((2, 4), 512), ((4, 2), 256)):
        mesh = make_mesh(shape)
        x = jax.random.normal(jax.random.key(3), (16, hidden))
        for dtype in ("model", "fp8"):
            split = ExpertParallel(mesh, ("host", "chip"), "hierarchical-dispatch", dtype)
            flat = ExpertParallel(mesh, ("host", "chip"), "flat", dtype)
            assert split.dispatch_for(hidden) == "hierarchical-dispatch"
            spec = P(("host", "chip"))
            gather = lambda ep: jax.jit(
                jax.shard_map(lambda a: ep.gather_tokens(a, ep.dispatch_for(hidden)), mesh=mesh, in_specs=spec, out_specs=spec)
            )(x)
            np.testing.assert_array_equal(np.asarray(gather(split)), np.asarray(gather(flat)))
        args = problem(tokens=16, hidden=hidden, seed=1)
        np.testing.assert_allclose(
            run(ExpertParallel(mesh, ("host", "chip"), "hierarchical-dispatch"), *args), dense_reference(*args), atol=1e-5
        )


def test_hierarchical_dispatch_falls_back_to_flat_with_one_warning(caplog):
    mesh = make_mesh((4, 2))  # k = 2 needs hidden % 256 == 0
    collectives._warned.clear()
    split = ExpertParallel(mesh, ("host", "chip"), "hierarchical-dispatch")
    flat = ExpertParallel(mesh, ("host", "chip"), "flat")
    args = problem(tokens=16, hidden=128)
    with caplog.at_level(logging.WARNING, logger="moray.collectives"):
        got = run(split, *args)
        run(split, *problem(tokens=24, hidden=128))  # another shape: traced again, no second warning
    warnings = [r for r in caplog.records if "hierarchical dispatch" in r.getMessage()]
    assert len(warnings) == 1 and "hidden is 128" in warnings[0].getMessage()
    np.testing.assert_array_equal(got, run(flat, *args))  # the whole flat path, bit for bit


def test_fp8_gather_error_stays_within_the_e4m3_bound():
    mesh = make_mesh((2, 4))
    args = problem(tokens=32, hidden=256)
    want = dense_reference(*args)
    for mode in DISPATCH_MODES:
        got = run(ExpertParallel(mesh, ("host", "chip"), mode, "fp8"), *args)
        # Inputs carry <= 2^-4 relative rounding; through the expert MLP that stays a few percent.
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), mode


# ---------------------------------------------------------------------------------------------
# Layouts, checks and environment.


def test_layouts_assign_axes_and_reject_bad_combinations():
    mesh = make_mesh((2, 4))
    layout = make_layout(mesh, num_experts=16)
    assert (layout.dp_axes, layout.tp_axes, layout.ep_axes) == (("host", "chip"), (), ("host", "chip"))
    assert layout.rules() == {"experts": ("host", "chip"), "heads": None, "mlp": None}
    layout = make_layout(mesh, num_experts=12, dp=2, tp=4, ep=4)
    assert (layout.dp_axes, layout.tp_axes, layout.ep_axes) == (("host",), ("chip",), ("chip",))
    with pytest.raises(ParallelConfigError, match="ep=8 does not divide num_experts=12"):
        make_layout(mesh, num_experts=12, ep=8)
    with pytest.raises(ParallelConfigError, match=r"dp x tp must equal the number of devices: 4 x 1 != 8"):
        make_layout(mesh, num_experts=16, dp=4)
    with pytest.raises(ParallelConfigError, match="ep=2 is not a product of trailing mesh sizes 2x4"):
        make_layout(mesh, num_experts=16, ep=2)
    with pytest.raises(ParallelConfigError, match="mesh 2x2 has 4 devices but 8 are available"):
        layout_from_config(ParallelConfig(mesh="2x2"), num_experts=16)
    with pytest.raises(ValueError, match="dp x tp must equal the mesh size"):
        ParallelConfig(mesh="2x4", dp=2, tp=2)
    with pytest.raises(ParallelConfigError, match="expected sizes like"):
        parse_mesh("2by4")
    assert parse_mesh("8") == (1, 8) and parse_mesh("2x2x2") == (2, 2, 2)
    assert layout_from_config(ParallelConfig(), num_experts=16).mesh.size == 1  # the default: one device


def test_tpu_grid_groups_cores_by_chip_and_chips_by_host():
    """Two hosts x two chips x two cores (v7x-like), listed in a scrambled order."""
    devices = [
        SimpleNamespace(id=i, platform="tpu", process_index=h, slice_index=0, coords=(c, 0, 0), core_on_chip=k)
        for i, (h, c, k) in enumerate([(h, c, k) for h in range(2) for c in range(2) for k in range(2)])
    ]
    grid = tpu_device_grid(list(reversed(devices)))
    assert grid.shape == (2, 2, 2)
    assert [[[d.id for d in chip] for chip in host] for host in grid] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_distributed_settings_from_config_launcher_and_gke():
    assert distributed_settings(env={}) is None
    s = distributed_settings("10.0.0.1:1234", 2, 1, env={})
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 2, 1)
    launcher = {"MORAY_COORDINATOR_ADDRESS": "127.0.0.1:5000", "MORAY_NUM_PROCESSES": "2", "MORAY_PROCESS_ID": "1"}
    assert distributed_settings(env=launcher).process_id == 1
    gke = {"TPU_WORKER_ID": "3", "TPU_WORKER_HOSTNAMES": "w-0.svc,w-1.svc,w-2.svc,w-3.svc"}
    s = distributed_settings(env=gke)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("w-0.svc:8476", 4, 3)
    assert distributed_settings(env={"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "only-one"}) is None
    with pytest.raises(ParallelConfigError, match="inconsistent"):
        distributed_settings("h:1", 2, 5, env={})
