"""Proof from compiled HLO (8 virtual CPU devices) of which bytes cross which mesh level: the hierarchical
dispatch's inter-host bytes are at most 1/k of the flat gather's (k = devices per host), the staged
reduce-scatter's likewise; plus the HLO parser on each replica-group spelling."""

from __future__ import annotations

import pytest

from bench.collectives import build_programs, bytes_by_level, collectives_from_hlo, inputs, lowered
from workers.parallel import make_mesh


def level_bytes(mesh, mode: str, program: str, hidden: int, tokens: int = 64):
    programs = build_programs(mesh, mode, hidden, experts=16, top_k=2)
    data = inputs(mesh, tokens, hidden, experts=16, top_k=2, intermediate=32)
    ops = collectives_from_hlo(lowered(programs, program, data).compile().as_text(), list(mesh.axis_names), list(mesh.devices.shape))
    return bytes_by_level(ops, mesh.axis_names), ops, programs["dispatch_used"]


@pytest.mark.parametrize("shape,hidden", [((2, 4), 512), ((4, 2), 256)], ids=["2x4-k4", "4x2-k2"])
def test_hierarchical_dispatch_sends_one_kth_across_hosts(shape, hidden):
    mesh = make_mesh(shape)
    k = shape[1]
    flat, flat_ops, _ = level_bytes(mesh, "flat", "dispatch", hidden)
    split, split_ops, used = level_bytes(mesh, "hierarchical-dispatch", "dispatch", hidden)
    assert used == "hierarchical-dispatch"
    assert [op.kind for op in flat_ops] == ["all-gather", "all-gather"]  # hidden states, routing metadata
    assert {op.kind for op in split_ops} == {"all-to-all", "all-gather"}
    # Exactly 1/k: each host row fetches every remote row once (H/k columns on each of its k devices).
    assert split["host"] * k == flat["host"] > 0
    # Only the slow-level gathers span hosts; the rest stays inside a host.
    assert all(op.axes == ["host"] for op in split_ops if "host" in op.received)
    fp8_flat, _, _ = level_bytes(mesh, "flat-fp8", "dispatch", hidden)
    fp8_split, _, _ = level_bytes(mesh, "hierarchical-dispatch-fp8", "dispatch", hidden)
    assert fp8_flat["host"] < flat["host"] / 3  # fp8 rows: H + 4 bytes instead of 4H
    # Each of the k pieces carries its own copy of the row's 4-byte scale: slightly over 1/k.
    assert fp8_flat["host"] < fp8_split["host"] * k < 1.05 * fp8_flat["host"]


def test_staged_combine_sends_one_kth_across_hosts():
    mesh = make_mesh((2, 4))
    flat, flat_ops, _ = level_bytes(mesh, "flat", "combine", 256)
    staged, staged_ops, _ = level_bytes(mesh, "hierarchical", "combine", 256)
    assert [op.kind for op in flat_ops] == ["reduce-scatter"] and flat_ops[0].axes == ["host", "chip"]
    assert [op.axes for op in staged_ops] == [["chip"], ["host"]]  # fast level first
    assert staged["host"] * 4 == flat["host"]


def test_parser_reads_every_replica_group_spelling():
    names, shape = ["host", "chip"], [2, 4]
    lines = [
        "%a = f32[8,16]{1,0} all-gather(f32[4,16]{1,0} %x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}",
        "%b = f32[8,16]{1,0} all-gather(f32[4,16]{1,0} %x), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}",
        "%c = f32[8,16]{1,0} all-gather(f32[4,16]{1,0} %x), replica_groups=mesh['host'=2,'chip'=4] {'host'}, dimensions={0}",
        "%d = f32[4,16]{1,0} reduce-scatter(f32[16,16]{1,0} %x), replica_groups=[2,4]<=[8], dimensions={0}",
        "%e = (f32[2,16]{1,0}, f32[2,16]{1,0}) all-to-all(f32[2,16]{1,0} %x, f32[2,16]{1,0} %y), replica_groups={{0,1},{2,3},{4,5},{6,7}}",
        "%f = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,4},{4,0}}",
        "%g = bf16[8]{0} all-reduce(bf16[8]{0} %x), replica_groups={}, to_apply=%add",
    ]
    ops = collectives_from_hlo("\n".join(lines), names, shape)
    assert [op.kind for op in ops] == ["all-gather"] * 3 + ["reduce-scatter", "all-to-all", "collective-permute", "all-reduce"]
    # The three spellings of the same host-pairing gather: each of 8 devices receives half of 512 bytes.
    for op in ops[:3]:
        assert (op.axes, op.group_size, op.received) == (["host"], 2, {"host": 8 * 256})
    assert ops[3].received == {"chip": 8 * 3 * 256}  # 4-device groups inside a host, a 256-byte shard each
    assert ops[4].received == {"chip": 8 * 256 // 2}  # 256 bytes per device, half of it from the peer
    assert ops[5].received == {"host": 2 * 16}
    assert ops[6].group_size == 8 and ops[6].received == {"host": 8 * 4 * 2 * 16 // 8, "chip": 8 * 3 * 2 * 16 // 8}
