"""`moray bench collectives`: what each expert-parallel MoE mode sends over each level of the mesh, and
how long its dispatch and its whole MoE layer take.

For every mode (flat, hierarchical, hierarchical-dispatch; the fp8 gather with flat and hierarchical
dispatch):
- from the compiled HLO of the dispatch, the combine and the whole layer: every collective, the mesh
  axes its replica groups span, and the bytes it makes devices receive per mesh level, summed over
  all devices. A peer's level is the slowest mesh axis on which the two devices differ, so `host` is
  inter-host traffic and the rest stays inside a host. Bytes assume the members of a group exchange
  directly (all-gather: each member receives every other member's shard; reduce-scatter: every other
  member's partial of its own shard; all-to-all: one piece from each; all-reduce: twice the shard),
  i.e. what the program asks of each link, independent of the library's algorithm.
- measured times: the mesh runs as `--processes` local processes (default: one per host row, so a
  2x4 mesh is 2 processes x 4 CPU devices talking gloo over loopback TCP). Each timed run calls every
  mode once in turn (modes side by side, so drift hits them alike); reported figures are medians over
  `--runs` runs of process 0's wall time for the dispatch (hidden states + routing metadata gathered)
  and for the whole layer (router, top-k, dispatch, local experts, combine).

On one machine every gloo connection shares loopback, so nothing is slower across "hosts" than inside
one; `bench/slow_link.sh RATE` runs the same workers in two network namespaces joined by a shaped veth
link and adds, per mode, the bytes that really crossed it per call (`link_bytes_per_call`).

Writes JSON (`--json OUT`; progress on stderr). No jax import at module import time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.report import add_report_argument, report_if_asked

MODES = {
    # name: (dispatch, gather dtype)
    "flat": ("flat", "model"),
    "hierarchical": ("hierarchical", "model"),
    "hierarchical-dispatch": ("hierarchical-dispatch", "model"),
    "flat-fp8": ("flat", "fp8"),
    "hierarchical-dispatch-fp8": ("hierarchical-dispatch", "fp8"),
}
# The reference implementation's result (TPU v7x, decode): dispatch 11.7 -> 7.2 ms.
TARGET_DISPATCH_REDUCTION = 0.35


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", default="2x4", help="host x chip[ x core] (default 2x4)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024)")
    p.add_argument("--tokens", type=int, default=256, help="tokens in the step, over all devices (default 256)")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=128, help="expert intermediate size (default 128)")
    p.add_argument("--runs", type=int, default=30, help="timed runs per mode (>= 20; default 30)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--processes", type=int, default=None, help="local processes (default: the mesh's host size)")
    p.add_argument("--json", type=Path, required=True, help="where to write the results")
    add_report_argument(p)


def run(args: argparse.Namespace) -> int:
    from workers.parallel import launch_local_processes, parse_mesh

    shape = parse_mesh(args.mesh)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; expected some of {list(MODES)}")
    if args.runs < 20:
        raise ValueError("--runs must be >= 20")
    processes = args.processes or shape[0]
    devices = math.prod(shape)
    if devices % processes or args.tokens % devices:
        raise ValueError(f"{processes} processes and {args.tokens} tokens must both divide the {devices} devices evenly")
    command = [sys.executable, "-m", "bench.collectives", *_worker_argv(args)]
    _log(f"mesh {args.mesh}: {processes} process(es) x {devices // processes} CPU devices")
    rc = launch_local_processes(command, processes, devices // processes, timeout=3600)
    if rc == 0:  # the workers wrote the JSON (process 0); the report is drawn here, not in every worker
        report_if_asked(args, "collectives", json.loads(args.json.read_text()))
    return rc


def _worker_argv(args) -> list[str]:
    argv = []
    for name in ("mesh", "hidden", "tokens", "experts", "top_k", "intermediate", "runs", "warmup", "modes", "json"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return argv


def _log(msg: str) -> None:
    print(f"[bench collectives] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Collectives in compiled HLO.

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
}  # fmt: skip
_KINDS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_NAMED_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclass
class CollectiveOp:
    kind: str
    axes: list[str]  # mesh axes its groups span
    group_size: int
    bytes_per_device: int  # the op's result on one device
    received: dict[str, int] = field(default_factory=dict)  # mesh level -> bytes, all devices together


def _shape_bytes(text: str) -> int:
    return sum(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def _groups(line: str, names: list[str], shape: list[int]):
    """Replica groups as lists of flat device positions in the mesh, for the HLO's three spellings."""
    import numpy as np

    ids = np.arange(math.prod(shape)).reshape(shape)
    if m := _NAMED_GROUPS.search(line):
        axes = re.findall(r"'(\w+)'", m.group(2))
        spanned = [names.index(a) for a in axes]
        rest = [i for i in range(len(names)) if i not in spanned]
        size = math.prod(shape[i] for i in spanned)
        return ids.transpose(rest + spanned).reshape(-1, size).tolist()
    if m := _IOTA_GROUPS.search(line):
        group_dims = [int(d) for d in m.group(1).split(",")]
        reshape = [int(d) for d in m.group(2).split(",")]
        iota = np.arange(math.prod(reshape)).reshape(reshape)
        if m.group(3):
            iota = iota.transpose([int(d) for d in m.group(3).split(",")])
        return iota.reshape(group_dims).tolist()
    if m := _LIST_GROUPS.search(line):
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return [g for g in groups if g] or [ids.ravel().tolist()]
    return [ids.ravel().tolist()]  # no groups: every device


def _hlo_mesh(line: str, names, shape):
    """The mesh a named replica-group spelling declares (it may omit size-1 axes), else ours."""
    if m := _NAMED_GROUPS.search(line):
        pairs = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        return [a for a, _ in pairs], [int(s) for _, s in pairs]
    return list(names), list(shape)


def _level(a: int, b: int, names, shape) -> str:
    """The slowest mesh axis on which flat positions a and b differ."""
    import numpy as np

    ca, cb = np.unravel_index(a, shape), np.unravel_index(b, shape)
    return next(names[i] for i in range(len(names)) if ca[i] != cb[i])


def collectives_from_hlo(hlo_text: str, axis_names, mesh_shape) -> list[CollectiveOp]:
    """Every collective of a compiled (SPMD-partitioned) HLO module, with its bytes per mesh level."""
    ops = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)  # an async pair counts once, at its -start
        if not m:
            continue
        result, kind, started = m.group(1), m.group(2), m.group(3)
        if started and result.startswith("("):  # async start: (operands..., result)
            result = _SHAPE.findall(result)[-1]
            result = f"{result[0]}[{result[1]}]"
        out_bytes = _shape_bytes(result)
        names, shape = _hlo_mesh(line, axis_names, mesh_shape)
        op = CollectiveOp(kind, [], 0, out_bytes)
        if kind == "collective-permute":
            pairs = [
                tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", (_PAIRS.search(line) or [None, ""])[1] or "")
            ]
            for src, dst in pairs:
                lvl = _level(src, dst, names, shape)
                op.received[lvl] = op.received.get(lvl, 0) + out_bytes
            op.group_size = 2
        else:
            groups = _groups(line, names, shape)
            g = len(groups[0])
            op.group_size = g
            per_peer = {
                "all-gather": out_bytes / g,
                "reduce-scatter": out_bytes,
                "all-to-all": out_bytes / g,
                "all-reduce": 2 * out_bytes / g,
            }[kind]
            for group in groups:
                for a in group:
                    for b in group:
                        if a != b:
                            lvl = _level(a, b, names, shape)
                            op.received[lvl] = op.received.get(lvl, 0) + per_peer
        op.received = {k: int(v) for k, v in op.received.items()}
        spanned = set(op.received)
        op.axes = [a for a in names if a in spanned]
        ops.append(op)
    return ops


def bytes_by_level(ops: list[CollectiveOp], levels) -> dict[str, int]:
    out = {lvl: 0 for lvl in levels}
    for op in ops:
        for lvl, b in op.received.items():
            out[lvl] = out.get(lvl, 0) + b
    return out


# ---------------------------------------------------------------------------------------------
# The programs measured (built inside a worker, where jax is set up).


def build_programs(mesh, mode: str, hidden: int, experts: int, top_k: int):
    """Jitted (dispatch, combine, layer) for one mode on `mesh`, all experts split over all axes."""
    import jax
    from jax.sharding import PartitionSpec as P

    from kernels.moe import route_softmax_topk
    from workers.models.moe_parallel import ExpertParallel

    dispatch, gather_dtype = MODES[mode]
    axes = tuple(mesh.axis_names)
    ep = ExpertParallel(mesh, axes, dispatch, gather_dtype)
    used = ep.dispatch_for(hidden)
    tokens = P(axes)

    def dispatch_body(x, ids, weights):
        return ep.gather_tokens(x, used), *ep.gather_routing(ids, weights, used)

    def combine_body(y):
        return ep.combine(y, used)

    def layer(x, router, gate_up, down):
        weights, ids = route_softmax_topk(x @ router.T, top_k, True)
        return ep(x, ids, weights.astype(x.dtype), gate_up, down)

    smap = lambda f, ins, outs: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs))
    return {
        "dispatch": smap(dispatch_body, (tokens, tokens, tokens), (tokens, tokens, tokens)),
        "combine": smap(combine_body, tokens, tokens),
        "layer": jax.jit(layer),
        "dispatch_used": used,
    }


def inputs(mesh, tokens: int, hidden: int, experts: int, top_k: int, intermediate: int, seed: int = 0):
    """Global arrays, the same on every process: tokens split over all devices, experts over all."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(seed)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    n = mesh.size
    x = rng.standard_normal((tokens, hidden), np.float32)
    ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, top_k), np.float32)
    return {
        "x": put(x, P(axes)),
        "ids": put(ids, P(axes)),
        "weights": put(weights, P(axes)),
        "partials": put(rng.standard_normal((n * tokens, hidden), np.float32), P(axes)),
        "router": put((rng.standard_normal((experts, hidden)) * 0.05).astype(np.float32), P()),
        "gate_up": put((rng.standard_normal((experts, 2 * intermediate, hidden)) * 0.05).astype(np.float32), P(axes)),
        "down": put((rng.standard_normal((experts, hidden, intermediate)) * 0.05).astype(np.float32), P(axes)),
    }


def call(programs, name: str, data):
    if name == "dispatch":
        return programs["dispatch"](data["x"], data["ids"], data["weights"])
    if name == "combine":
        return programs["combine"](data["partials"])
    return programs["layer"](data["x"], data["router"], data["gate_up"], data["down"])


def lowered(programs, name: str, data):
    f = programs[name]
    if name == "dispatch":
        return f.lower(data["x"], data["ids"], data["weights"])
    if name == "combine":
        return f.lower(data["partials"])
    return f.lower(data["x"], data["router"], data["gate_up"], data["down"])


# ---------------------------------------------------------------------------------------------
# The worker (one per process).


def worker(args) -> int:
    from workers.parallel import distributed_settings, init_distributed, make_mesh, parse_mesh

    init_distributed(distributed_settings())
    import jax
    import numpy as np

    shape = parse_mesh(args.mesh)
    mesh = make_mesh(shape)
    levels = list(mesh.axis_names)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    data = inputs(mesh, args.tokens, args.hidden, args.experts, args.top_k, args.intermediate)
    lead = jax.process_index() == 0
    log = _log if lead else (lambda msg: None)

    results = {}
    programs = {}
    for mode in modes:
        programs[mode] = build_programs(mesh, mode, args.hidden, args.experts, args.top_k)
        entry = {"dispatch_used": programs[mode]["dispatch_used"], "hlo": {}}
        for name in ("dispatch", "combine", "layer"):
            ops = collectives_from_hlo(lowered(programs[mode], name, data).compile().as_text(), levels, list(shape))
            entry["hlo"][name] = {
                "bytes_by_level": bytes_by_level(ops, levels),
                "ops": [asdict(op) for op in ops],
            }
        results[mode] = entry
        log(f"{mode}: compiled; dispatch bytes by level {entry['hlo']['dispatch']['bytes_by_level']}")

    # Every mode must gather exactly what the flat gather does (the fp8 ones what the flat fp8 does).
    gathered = {mode: call(programs[mode], "dispatch", data) for mode in modes}
    for mode in modes:
        base = "flat-fp8" if MODES[mode][1] == "fp8" else "flat"
        if base in gathered:
            same = all(
                np.array_equal(np.asarray(a.data), np.asarray(b.data))
                for got, want in zip(gathered[mode], gathered[base])
                for a, b in zip(got.addressable_shards, want.addressable_shards)
            )
            results[mode][f"dispatch_equals_{base}"] = same

    for mode in modes:  # compile and warm every program before timing anything
        for name in ("dispatch", "combine", "layer"):
            for _ in range(args.warmup):
                jax.block_until_ready(call(programs[mode], name, data))
    times = {mode: {name: [] for name in ("dispatch", "combine", "layer")} for mode in modes}
    for r in range(args.runs):
        for name in ("dispatch", "combine", "layer"):
            for mode in modes:
                t0 = time.perf_counter()
                jax.block_until_ready(call(programs[mode], name, data))
                times[mode][name].append(time.perf_counter() - t0)
        if (r + 1) % 10 == 0:
            log(f"run {r + 1}/{args.runs}")

    link = os.environ.get("MORAY_BENCH_LINK_DEV")  # the inter-host interface (bench/slow_link.sh)
    if link:
        for mode in modes:
            results[mode]["link_bytes_per_call"] = {
                name: _link_bytes_per_call(link, lambda: call(programs[mode], name, data)) for name in ("dispatch", "combine", "layer")
            }

    for mode in modes:
        results[mode]["ms"] = {name: 1e3 * statistics.median(v) for name, v in times[mode].items()}
        results[mode]["samples_ms"] = {name: [round(1e3 * t, 4) for t in v] for name, v in times[mode].items()}
    if lead:
        summary = _summary(results, levels)
        out = {
            "mesh": args.mesh,
            "axes": levels,
            "processes": jax.process_count(),
            "devices_per_process": jax.local_device_count(),
            "hidden": args.hidden,
            "tokens": args.tokens,
            "experts": args.experts,
            "top_k": args.top_k,
            "intermediate": args.intermediate,
            "runs": args.runs,
            "backend": jax.default_backend(),
            # Set by bench/slow_link.sh; otherwise processes talk over loopback TCP.
            "inter_host_link": os.environ.get("MORAY_BENCH_LINK", "loopback"),
            "cpu_count": os.cpu_count(),
            "target_dispatch_reduction": TARGET_DISPATCH_REDUCTION,
            "summary": summary,
            "modes": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        for line in _table(summary, levels):
            log(line)
        log(f"wrote {args.json}")
    return 0


def _link_counter(dev: str) -> int:
    stats = Path("/sys/class/net") / dev / "statistics"
    return sum(int((stats / f).read_text()) for f in ("tx_bytes", "rx_bytes"))


def _link_bytes_per_call(dev: str, fn, calls: int = 10) -> int:
    """Bytes through the inter-host interface (both directions, with TCP/IP headers) per call of fn."""
    import jax

    jax.block_until_ready(fn())
    before = _link_counter(dev)
    for _ in range(calls):
        jax.block_until_ready(fn())
    return (_link_counter(dev) - before) // calls


def _summary(results, levels) -> dict:
    slow = levels[0]
    flat = results.get("flat")
    out = {}
    for mode, r in results.items():
        s = {
            "dispatch_used": r["dispatch_used"],
            "dispatch_exact": r.get("dispatch_equals_flat", r.get("dispatch_equals_flat-fp8")),
            "dispatch_ms": round(r["ms"]["dispatch"], 3),
            "combine_ms": round(r["ms"]["combine"], 3),
            "layer_ms": round(r["ms"]["layer"], 3),
            "dispatch_bytes": r["hlo"]["dispatch"]["bytes_by_level"],
            "combine_bytes": r["hlo"]["combine"]["bytes_by_level"],
        }
        if "link_bytes_per_call" in r:
            s["link_bytes_per_call"] = r["link_bytes_per_call"]
        if flat is not None:
            flat_slow = flat["hlo"]["dispatch"]["bytes_by_level"][slow]
            s[f"dispatch_{slow}_bytes_vs_flat"] = round(s["dispatch_bytes"][slow] / flat_slow, 4) if flat_slow else None
            s["dispatch_time_change_vs_flat"] = round(r["ms"]["dispatch"] / flat["ms"]["dispatch"] - 1, 4)
            s["layer_time_change_vs_flat"] = round(r["ms"]["layer"] / flat["ms"]["layer"] - 1, 4)
        out[mode] = s
    return out


def _table(summary, levels) -> list[str]:
    head = f"{'mode':<28}{'dispatch ms':>12}{'combine ms':>12}{'layer ms':>10}  " + "  ".join(f"{lvl + ' B (disp)':>16}" for lvl in levels)
    rows = [head]
    for mode, s in summary.items():
        rows.append(
            f"{mode:<28}{s['dispatch_ms']:>12.3f}{s['combine_ms']:>12.3f}{s['layer_ms']:>10.3f}  "
            + "  ".join(f"{s['dispatch_bytes'][lvl]:>16,}" for lvl in levels)
        )
    return rows


if __name__ == "__main__":  # a worker process started by `run`
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(worker(parser.parse_args()))
