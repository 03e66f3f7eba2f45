"""The expert placement policy (`workers/models/eplb.py`): consistent maps, groups kept on one node, and
balance on Zipf-skewed loads."""

from __future__ import annotations

import numpy as np
import pytest

from workers.models.eplb import rebalance_experts

RNG = np.random.default_rng(0)
LAYERS, EXPERTS, DEVICES = 3, 64, 8
# Zipf loads, a different hot set per layer: the hottest expert takes ~21% of the tokens.
ZIPF = np.stack([RNG.permutation(1.0 / np.arange(1, EXPERTS + 1)) for _ in range(LAYERS)]) * 1e5


def check_maps(p, load):
    layers, experts = load.shape
    for layer in range(layers):
        assert np.array_equal(np.bincount(p.phy2log[layer], minlength=experts), p.logcnt[layer])
        assert p.logcnt[layer].min() >= 1
        for e in range(experts):
            slots = p.log2phy[layer, e]
            slots = slots[slots >= 0]
            assert len(slots) == p.logcnt[layer, e] and (p.phy2log[layer, slots] == e).all()


@pytest.mark.parametrize("slots,groups,nodes", [(80, 8, 2), (72, 1, 1), (96, 16, 2)])
def test_maps_are_consistent_and_balance_zipf_loads(slots, groups, nodes):
    p = rebalance_experts(ZIPF, slots, groups, nodes, DEVICES)
    check_maps(p, ZIPF)
    loads = p.device_loads(ZIPF, DEVICES)
    assert np.allclose(loads.sum(1), ZIPF.sum(1))  # every token goes somewhere, once
    assert (loads.max(1) / loads.mean(1)).max() <= 1.15
    # Experts in their natural order, one each, 8 per device: the hottest device takes far more than its share.
    contiguous = ZIPF.reshape(LAYERS, DEVICES, -1).sum(-1)
    assert (contiguous.max(1) / contiguous.mean(1)).min() > 1.5


def test_spare_slots_cannot_move_load_between_nodes():
    """The hierarchical constraint's price: spare slots stay on their node, so with few groups per node the
    nodes' shares follow their groups (here 4 nodes of 4 groups: the node with the hottest group is >15%
    over), and a global pool (one group) balances what the groups could not."""
    grouped = rebalance_experts(ZIPF, 96, 16, 4, DEVICES).device_loads(ZIPF, DEVICES)
    pooled = rebalance_experts(ZIPF, 96, 1, 1, DEVICES).device_loads(ZIPF, DEVICES)
    assert (grouped.max(1) / grouped.mean(1)).max() > 1.15 >= (pooled.max(1) / pooled.mean(1)).max()


def test_groups_stay_on_one_node():
    slots, groups, nodes = 80, 8, 2
    p = rebalance_experts(ZIPF, slots, groups, nodes, DEVICES)
    node_of_slot = np.arange(slots) // (slots // nodes)
    for layer in range(LAYERS):
        for g in range(groups):
            members = np.isin(p.phy2log[layer], np.arange(g * 8, (g + 1) * 8))
            assert len(set(node_of_slot[members])) == 1, (layer, g)


def test_groups_that_do_not_divide_over_nodes_fall_back_to_one_global_pool():
    p = rebalance_experts(ZIPF, 80, 4, 8, DEVICES)  # 4 groups cannot stay whole on 8 nodes
    check_maps(p, ZIPF)
    loads = p.device_loads(ZIPF, DEVICES)
    assert (loads.max(1) / loads.mean(1)).max() <= 1.15


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="slots over devices"):
        rebalance_experts(ZIPF, 81, 1, 1, DEVICES)
    with pytest.raises(ValueError, match="cannot hold"):
        rebalance_experts(ZIPF, 56, 1, 1, DEVICES)
    with pytest.raises(ValueError, match="experts over groups"):
        rebalance_experts(ZIPF, 64, 3, 1, DEVICES)


def test_a_replicated_experts_tokens_go_round_its_replicas_in_decode_and_in_a_prompt():
    """`physical_ids`: 8 sequences decode 9 steps (3 x 3: a sequence moves on every 3 steps), each keeping its
    batch row and choosing expert 0 (3 replicas) every step: each sequence's tokens visit every replica equally (they used to stay on the one
    of its row, an imbalance no placement sees); within a step the 8 spread over the replicas; a 12-token
    prompt's tokens split evenly but for its ends; every assignment lands on a slot of its own expert."""
    import jax.numpy as jnp

    from workers.models.layers import physical_ids

    log2phy = jnp.asarray([[0, 4, 5], [1, -1, -1], [2, -1, -1], [3, -1, -1]])
    logcnt = jnp.asarray([3, 1, 1, 1])
    rows, steps = 8, 9
    ids = jnp.asarray([[0, 1]] * rows)
    per_step = [np.asarray(physical_ids(ids, log2phy, logcnt, jnp.full((rows, 1), 30 + s)))[:, 0] for s in range(steps)]
    for seq in range(rows):
        visited = np.bincount([int(step[seq]) for step in per_step], minlength=6)[[0, 4, 5]]
        assert visited.tolist() == [3, 3, 3], (seq, visited)
    for step in per_step:
        assert max(np.bincount(step, minlength=6)[[0, 4, 5]]) - min(np.bincount(step, minlength=6)[[0, 4, 5]]) <= 1
    prompt = np.asarray(physical_ids(jnp.asarray([[0, 2]] * 12), log2phy, logcnt, jnp.arange(12)[None, :] + 7))
    split = np.bincount(prompt[:, 0], minlength=6)[[0, 4, 5]]
    assert split.sum() == 12 and split.max() - split.min() <= 2, split  # a run of 3 round all 3; a part-run at each end
    assert set(prompt[:, 1].tolist()) == {2}


# ---------------------------------------------------------------------------------------------
# Redundant experts in the model: the placement applied to the weights, the dispatch through the replica map.

PROMPTS = [[3, 17, 42, 5, 88, 61, 9, 23, 70, 11], [8, 2, 77, 45], [5, 5, 5, 60, 21, 33, 94]]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from hf_checkpoints import qwen2_ep_checkpoint

    return qwen2_ep_checkpoint(tmp_path_factory.mktemp("eplb-qwen2"))


def skewed_placement(layers: int, experts: int, slots: int, nodes: int, devices: int):
    """A placement for Zipf loads whose hottest experts get replicas (moved off their home ranks)."""
    load = np.stack([RNG.permutation(1.0 / np.arange(1, experts + 1)) for _ in range(layers)])
    p = rebalance_experts(load, slots, 1, nodes, devices)
    assert p.logcnt.max() > 1 and not np.array_equal(p.phy2log[:, :experts], np.tile(np.arange(experts), (layers, 1)))
    return p


def test_redundant_experts_equal_one_device_in_every_dispatch_mode(qwen2):
    """16 experts in 24 slots over the 8 EP ranks of a 2x4 mesh (3 slots each, hot experts replicated):
    every dispatch variant gives the one-device logits, and the FP8 gather (not exact) the logits it gives
    without the replica map."""
    from workers.engine.config import ParallelConfig
    from workers.models import load_model, prompt_logits
    from workers.models.moe_parallel import DISPATCH_MODES, apply_placement
    from workers.parallel import load_parallel_model

    want = prompt_logits(load_model(qwen2, dtype="float32", show_progress=False), PROMPTS)
    placement = skewed_placement(2, 16, 24, 2, 8)
    for mode in (*DISPATCH_MODES, "all-to-all"):
        moe = {"dispatch": "flat", "all_to_all_min_tokens": 1} if mode == "all-to-all" else {"dispatch": mode}
        model = load_parallel_model(qwen2, ParallelConfig(mesh="2x4", moe=moe), dtype="float32", show_progress=False)
        apply_placement(model.weights, placement, model.mesh)
        assert model.weights.layers[0].mlp.gate_up.shape[0] == 24
        np.testing.assert_allclose(prompt_logits(model, PROMPTS), want, atol=1e-5, rtol=0, err_msg=mode)
    fp8 = ParallelConfig(mesh="2x4", moe={"dispatch": "hierarchical", "gather_dtype": "fp8"})
    as_loaded = prompt_logits(load_parallel_model(qwen2, fp8, dtype="float32", show_progress=False), PROMPTS)
    model = load_parallel_model(qwen2, fp8, dtype="float32", show_progress=False)
    apply_placement(model.weights, placement, model.mesh)
    placed = prompt_logits(model, PROMPTS)
    np.testing.assert_allclose(placed, as_loaded, atol=1e-5, rtol=0)
    assert 0 < np.nanmax(np.abs(placed - want)) < 0.1  # e4m3 hidden states: close, not equal (NaN: padding)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "deepseek_v3", "qwen3_moe-w4a16"])
def test_redundant_experts_in_other_families_and_packed_experts(arch, tmp_path):
    """The hybrid and MLA families, and int4-packed experts (values and scales move together), under the
    hierarchical dispatch on 2x4 with 8 spare slots."""
    from workers.engine.config import ParallelConfig
    from workers.models import load_model, prompt_logits
    from workers.models.make_model import make_model
    from workers.models.moe_parallel import apply_placement
    from workers.models.quantize import quantize_checkpoint
    from workers.parallel import load_parallel_model

    family = arch.split("-")[0]
    d = make_model(tmp_path / family, family, "tiny", seed=2)
    if arch.endswith("w4a16"):
        d = quantize_checkpoint(d, tmp_path / "w4a16", "w4a16", 16)
    single = load_model(d, dtype="float32", show_progress=False)
    want = prompt_logits(single, PROMPTS)
    cfg = single.cfg
    placement = skewed_placement(sum(cfg.moe_layers), cfg.num_experts, cfg.num_experts + 8, 2, 8)
    model = load_parallel_model(d, ParallelConfig(mesh="2x4", moe={"dispatch": "hierarchical"}), dtype="float32", show_progress=False)
    apply_placement(model.weights, placement, model.mesh)
    np.testing.assert_allclose(prompt_logits(model, PROMPTS), want, atol=1e-4, rtol=0)


def test_each_expert_move_program_exchanges_in_one_collective(qwen2):
    """XLA:CPU starts a program's independent collectives in any order and lets them overlap; over gloo, two
    processes that entered them in different orders waited on each other for ever (a two-host replica hung at
    start-up in CI, in its copy programs with one ppermute per shift). So each move program, for every
    exchange width, exchanges all its rows in one collective, and still moves every row where it belongs."""
    from hlo_collectives import COLLECTIVE

    from workers.engine.config import ParallelConfig
    from workers.models.moe_parallel import _ExpertLeaves, copy_experts, moe_blocks, num_expert_parts, slot_moves
    from workers.parallel import load_parallel_model

    model = load_parallel_model(qwen2, ParallelConfig(mesh="2x4", moe={"dispatch": "hierarchical"}), dtype="float32", show_progress=False)
    blocks = moe_blocks(model.weights)
    experts = _ExpertLeaves(blocks, model.mesh)
    slots = experts.num_slots
    per_rank = slots // experts.ep
    widths = set()
    for crossing in range(1, per_rank + 1):  # rank 0's first slots take rank 1's: exchanges 1, 2, ... rows wide
        rows = np.tile(np.arange(slots), (len(blocks), 1))
        rows[:, :crossing] = per_rank + np.arange(crossing)
        local, sends = slot_moves(rows, slots, experts.ep)
        widths.add(sends.shape[1] // (experts.ep * (experts.ep - 1)))
        for part in range(num_expert_parts(blocks[0])):
            program, args = experts.program(local, sends, part)
            hlo = program.lower(*args).compile().as_text()
            assert len(COLLECTIVE.findall(hlo)) == 1, (crossing, part, COLLECTIVE.findall(hlo))
        before = [np.asarray(leaf) for leaf in experts.flat]
        after = copy_experts(blocks, rows, model.mesh)
        for old, new in zip(before, after):
            np.testing.assert_array_equal(np.asarray(new), old[rows[0]])
    assert widths == {1, 2}, widths


@pytest.mark.parametrize("sources,slots,ep", [(24, 24, 8), (16, 24, 8), (12, 12, 1), (32, 40, 4)])
def test_slot_moves_bring_every_slot_its_row_and_send_only_what_moves(sources, slots, ep):
    """The move program's plan, replayed in numpy as each rank's pool (its own rows, then what the rank k
    before it sent in exchange k): every new slot gets the source row asked for; a row that stays on its rank
    is not sent; each exchange is at most a power of two of rows wide."""
    from workers.models.moe_parallel import slot_moves

    rng = np.random.default_rng(sources + slots + ep)
    rows = rng.integers(0, sources, (3, slots))
    rows[0, : slots // ep] = np.arange(slots // ep) % (sources // ep)  # some slots keep rows of their own rank
    local, sends = slot_moves(rows, sources, ep)
    per, new_per = sources // ep, slots // ep
    width = sends.shape[1] // max(ep * (ep - 1), 1)
    data = rng.normal(size=(3, sources))
    for layer in range(3):
        for d in range(ep):
            own = data[layer, d * per : (d + 1) * per]
            got = []
            for k in range(1, ep):
                q = (d - k) % ep
                picks = sends[layer].reshape(ep, -1)[q, (k - 1) * width : k * width]
                got.append(data[layer, q * per + picks])
            pool = np.concatenate([own, *got])
            want = data[layer, rows[layer, d * new_per : (d + 1) * new_per]]
            assert np.array_equal(pool[local[layer, d * new_per : (d + 1) * new_per]], want)
    crossing = {(layer, int(src), r // new_per) for layer in range(3) for r, src in enumerate(rows[layer]) if src // per != r // new_per}
    most = max(
        (
            sum(1 for (l, s, d) in crossing if l == layer and s // per == q and (d - q) % ep == k)
            for layer in range(3)
            for q in range(ep)
            for k in range(1, ep)
        ),
        default=0,
    )
    assert width == (0 if most == 0 else 1 << (most - 1).bit_length())
