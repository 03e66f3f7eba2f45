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
