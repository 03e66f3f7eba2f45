"""Meshes, parallel layouts and multi-process wiring for one engine spanning several devices or hosts.

Mesh axes name the levels of the machine, slowest first: `host` (processes / TPU VMs), `chip`,
`core`. Collectives over a subset of axes are then intra-host or inter-host by construction.

- `device_grid`: the devices as an array over those levels. On TPU from device attributes
  (slice_index, process_index, coords, core_on_chip); elsewhere from a spec like "2x4" over the
  devices ordered by process, so the leading axis is the process axis when it matches their count.
- `make_layout`: mesh + parallel sizes -> a `ParallelLayout`: which axes attention data parallelism
  (dp), tensor parallelism of the dense parts (tp) and expert parallelism (ep) use. dp takes the
  leading axes and tp the trailing ones (dp x tp = devices); ep takes trailing axes (ep divides the
  number of experts; the leading axes left over hold independent replicas of the experts). Bad
  combinations raise `ParallelConfigError` naming the numbers.
- `init_distributed`: `jax.distributed.initialize` from explicit settings, `MORAY_*` variables set
  by `launch_local_processes`, or the GKE TPU environment (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES).
  CPU processes use gloo collectives over TCP.
- `launch_local_processes`: runs a command as N local processes wired together (for `--num-processes`).

Imports jax lazily: the CLI imports this module to parse arguments.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from jax.sharding import Mesh

log = logging.getLogger("moray.parallel")

LEVELS = ("host", "chip", "core")

# Set by `launch_local_processes` for its children; read by `distributed_settings`.
ENV_COORDINATOR = "MORAY_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MORAY_NUM_PROCESSES"
ENV_PROCESS_ID = "MORAY_PROCESS_ID"
TPU_COORDINATOR_PORT = 8476  # the port JAX's own GKE/Cloud TPU detection uses


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot run on these devices or this model."""


# ---------------------------------------------------------------------------------------------
# Mesh shapes and device grids.


def parse_mesh(spec: str) -> tuple[int, ...]:
    """ "8" -> (1, 8); "2x4" -> (2, 4); "2x2x2" -> (2, 2, 2). Axes are `LEVELS` from the end: a 2-D
    mesh is (host, chip), a 3-D one (host, chip, core)."""
    try:
        dims = tuple(int(d) for d in spec.lower().split("x"))
    except ValueError:
        raise ParallelConfigError(f"mesh {spec!r}: expected sizes like 8, 2x4 or 2x2x2") from None
    if not dims or len(dims) > len(LEVELS) or min(dims) < 1:
        raise ParallelConfigError(f"mesh {spec!r}: expected 1 to {len(LEVELS)} positive sizes like 2x4")
    return (1, *dims) if len(dims) == 1 else dims


def axis_names(ndim: int) -> tuple[str, ...]:
    return ("host", "chip") if ndim == 2 else LEVELS[-ndim:]


def format_mesh(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def device_grid(devices: Sequence[Any], shape: Sequence[int] | None = None):
    """Devices as a numpy object array of `shape` (default: the TPU topology, or all devices in one
    row per process), ordered so that the mesh axes follow the machine's levels."""
    import numpy as np

    if devices and getattr(devices[0], "platform", None) == "tpu":
        grid = tpu_device_grid(devices)
        if shape is None or tuple(shape) == grid.shape:
            return grid
        ordered = list(grid.flat)
    else:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        if shape is None:
            hosts = len({d.process_index for d in ordered})
            shape = (hosts, len(ordered) // hosts)
    if math.prod(shape) != len(ordered):
        raise ParallelConfigError(f"mesh {format_mesh(shape)} has {math.prod(shape)} devices but {len(ordered)} are available")
    return np.array(ordered, dtype=object).reshape(tuple(shape))


def tpu_device_grid(devices: Sequence[Any]):
    """[hosts, chips per host, cores per chip] from TPU device attributes.

    A host is one (slice_index, process_index); a chip one `coords` within it; `core_on_chip` tells
    the TensorCores of a chip apart (two on v7x, one on v5e/v6e).
    """
    import numpy as np

    def key(d):
        return (getattr(d, "slice_index", 0), d.process_index, tuple(reversed(d.coords)), d.core_on_chip)

    ordered = sorted(devices, key=key)
    hosts = sorted({key(d)[:2] for d in ordered})
    chips = sorted({key(d)[:3] for d in ordered})
    cores_per_chip = len(ordered) // len(chips)
    chips_per_host = len(chips) // len(hosts)
    if chips_per_host * len(hosts) != len(chips) or cores_per_chip * len(chips) != len(ordered):
        raise ParallelConfigError(f"uneven TPU topology: {len(hosts)} hosts, {len(chips)} chips, {len(ordered)} cores")
    return np.array(ordered, dtype=object).reshape(len(hosts), chips_per_host, cores_per_chip)


def make_mesh(shape: Sequence[int] | None = None, devices: Sequence[Any] | None = None) -> "Mesh":
    """A mesh with Auto axis types (GSPMD outside our shard_maps) named by `axis_names`."""
    import jax
    from jax.sharding import AxisType, Mesh

    grid = device_grid(list(devices if devices is not None else jax.devices()), shape)
    return Mesh(grid, axis_names(grid.ndim), axis_types=(AxisType.Auto,) * grid.ndim)


# ---------------------------------------------------------------------------------------------
# Parallel layout.


@dataclass(frozen=True)
class ParallelLayout:
    mesh: Any  # jax.sharding.Mesh
    dp_axes: tuple[str, ...]  # attention data parallelism: each group of these owns its sequences
    tp_axes: tuple[str, ...]  # dense parts (attention heads, dense MLPs) split over these
    ep_axes: tuple[str, ...]  # experts split over these

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def dp(self) -> int:
        return self.size(self.dp_axes)

    @property
    def tp(self) -> int:
        return self.size(self.tp_axes)

    @property
    def ep(self) -> int:
        return self.size(self.ep_axes)

    def rules(self) -> dict[str, Any]:
        """Logical weight axis -> mesh axes (see `workers.models.weights.DEFAULT_RULES`)."""
        as_spec = lambda axes: (axes if len(axes) > 1 else axes[0]) if axes else None
        return {"experts": as_spec(self.ep_axes), "heads": as_spec(self.tp_axes), "mlp": as_spec(self.tp_axes)}

    def expert_parallel(self, dispatch="flat", gather_dtype="model", fast_axes=None, all_to_all_min_tokens=None):
        from workers.models.moe_parallel import ExpertParallel

        if fast_axes is not None:
            fast_axes = tuple(fast_axes)
            if self.ep_axes[len(self.ep_axes) - len(fast_axes) :] != fast_axes:
                raise ParallelConfigError(f"moe fast_axes {list(fast_axes)} must be the innermost EP axes {list(self.ep_axes)}")
        return ExpertParallel(self.mesh, self.ep_axes, dispatch, gather_dtype, fast_axes, all_to_all_min_tokens)

    def describe(self) -> str:
        shape = format_mesh(self.mesh.devices.shape)
        return f"mesh {shape} {tuple(self.mesh.axis_names)}: dp={self.dp} {self.dp_axes}, tp={self.tp} {self.tp_axes}, ep={self.ep} {self.ep_axes}"


def _leading_axes(names, shape, size: int, what: str) -> tuple[str, ...]:
    for i in range(len(shape) + 1):
        if math.prod(shape[:i]) == size:
            return tuple(names[:i])
    raise ParallelConfigError(f"{what}={size} is not a product of leading mesh sizes {format_mesh(shape)}")


def _trailing_axes(names, shape, size: int, what: str) -> tuple[str, ...]:
    for i in range(len(shape) + 1):
        if math.prod(shape[len(shape) - i :]) == size:
            return tuple(names[len(shape) - i :])
    raise ParallelConfigError(f"{what}={size} is not a product of trailing mesh sizes {format_mesh(shape)}")


def make_layout(
    mesh: "Mesh",
    num_experts: int,
    dp: int | None = None,
    tp: int = 1,
    ep: int | None = None,
) -> ParallelLayout:
    """Assigns mesh axes to dp/tp/ep and checks every size against the mesh and the model."""
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    n = mesh.size
    tp = tp or 1
    dp = n // tp if dp is None else dp
    if dp * tp != n:
        raise ParallelConfigError(f"dp x tp must equal the number of devices: {dp} x {tp} != {n} (mesh {format_mesh(shape)})")
    if ep is None:
        ep = n if num_experts % n == 0 else 1
        if ep == 1 and n > 1:
            raise ParallelConfigError(f"{num_experts} experts cannot be split over {n} devices: pass an ep that divides it")
    if ep < 1 or ep > n or n % ep:
        raise ParallelConfigError(f"ep={ep} must divide the number of devices ({n})")
    if num_experts and num_experts % ep:
        raise ParallelConfigError(f"ep={ep} does not divide num_experts={num_experts}")
    layout = ParallelLayout(
        mesh=mesh,
        dp_axes=_leading_axes(names, shape, dp, "dp"),
        tp_axes=_trailing_axes(names, shape, tp, "tp"),
        ep_axes=_trailing_axes(names, shape, ep, "ep"),
    )
    if set(layout.dp_axes) & set(layout.tp_axes):
        raise ParallelConfigError(f"dp={dp} and tp={tp} overlap on mesh {format_mesh(shape)}")
    return layout


def layout_from_config(parallel, num_experts: int, devices: Sequence[Any] | None = None) -> ParallelLayout:
    """A `ParallelLayout` from a `workers.engine.config.ParallelConfig` (or anything with its fields).

    No mesh and no sizes: one device. Sizes without a mesh: a 1 x N mesh of all devices.
    """
    import jax

    devices = list(devices if devices is not None else jax.devices())
    sizes = [s for s in (parallel.dp, parallel.ep, parallel.tp) if s and s > 1]
    if parallel.mesh:
        shape = parse_mesh(parallel.mesh)
    elif sizes:
        shape = None  # every device, one row per process
    else:
        shape, devices = (1, 1), devices[:1]
    if shape is not None and math.prod(shape) != len(devices):
        raise ParallelConfigError(
            f"mesh {parallel.mesh} has {math.prod(shape)} devices but {len(devices)} are available"
            + (" (CPU: set JAX_NUM_CPU_DEVICES, or use --num-processes)" if devices[0].platform == "cpu" else "")
        )
    mesh = make_mesh(shape, devices)
    return make_layout(mesh, num_experts, dp=parallel.dp, tp=parallel.tp, ep=parallel.ep)


# ---------------------------------------------------------------------------------------------
# Multi-process wiring.


@dataclass(frozen=True)
class DistributedSettings:
    coordinator_address: str
    num_processes: int
    process_id: int


def distributed_settings(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedSettings | None:
    """Where this process sits in a multi-process engine, or None for a single process.

    Explicit values win; then `MORAY_*` (our local launcher); then the GKE TPU variables the KubeRay
    TPU webhook injects (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES: worker 0 coordinates).
    """
    env = os.environ if env is None else env
    if coordinator_address is None and ENV_COORDINATOR in env:
        coordinator_address = env[ENV_COORDINATOR]
        num_processes = num_processes or int(env[ENV_NUM_PROCESSES])
        process_id = int(env[ENV_PROCESS_ID]) if process_id is None else process_id
    if coordinator_address is None and env.get("TPU_WORKER_HOSTNAMES"):
        hosts = [h.strip() for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h.strip()]
        if len(hosts) > 1:
            coordinator_address = f"{hosts[0]}:{TPU_COORDINATOR_PORT}"
            num_processes = num_processes or len(hosts)
            process_id = int(env.get("TPU_WORKER_ID", "0")) if process_id is None else process_id
    if coordinator_address is None:
        if num_processes and num_processes > 1:
            raise ParallelConfigError("num_processes > 1 needs a coordinator address")
        return None
    if not num_processes or process_id is None or not 0 <= process_id < num_processes:
        raise ParallelConfigError(
            f"distributed settings incomplete or inconsistent: coordinator={coordinator_address}, "
            f"num_processes={num_processes}, process_id={process_id}"
        )
    return DistributedSettings(coordinator_address, num_processes, process_id)


def init_distributed(settings: DistributedSettings | None) -> bool:
    """`jax.distributed.initialize` once per process (before any other jax call); True if multi-process."""
    if settings is None:
        return False
    import jax

    same_programs_on_every_process()
    if not jax.distributed.is_initialized():
        # On CPU, cross-process collectives use gloo over TCP (JAX's default CPU collectives).
        jax.distributed.initialize(
            coordinator_address=settings.coordinator_address,
            num_processes=settings.num_processes,
            process_id=settings.process_id,
        )
        log.info("process %d of %d (coordinator %s)", settings.process_id, settings.num_processes, settings.coordinator_address)
    if jax.default_backend() == "cpu":
        no_compilation_cache()
    return True


def same_programs_on_every_process() -> None:
    """Keeps the Python call stack that traced a program out of it, so every process builds the same bytes.

    A multi-process run matches each collective across processes by its launch id, which JAX derives from
    the executable's fingerprint, a hash of its HLO including the source locations. By default a location
    is the whole traceback, callers included, so the same program traced from two call paths gets two
    fingerprints: the processes then ran it under different launch ids, and every rank waited in its
    first all-gather, forever (a process whose compile went through one more frame hung so every time).
    The innermost frame (the model's own line) is the same everywhere."""
    import jax

    jax.config.update("jax_include_full_tracebacks_in_locations", False)


def no_compilation_cache() -> None:
    """A multi-process engine on CPU compiles without the persistent compilation cache. The processes match
    each program's collectives by a launch id derived from the executable's fingerprint, and an executable
    loaded from the cache has another fingerprint than the same program compiled. Only process 0 writes the
    cache (the others' keys differ), so with a warm cache process 0 ran what it loaded against what the
    others compiled, and every rank waited in the first all-gather, forever (the second run of a
    two-process engine over one cache directory hung every time). Not on TPU, where it is not checked."""
    import jax
    from jax._src import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once per process whether it uses the cache


_ports_given: set[int] = set()
_ports_lock = threading.Lock()


def free_port() -> int:
    """A TCP port nothing listens on now, and never one this process was given before. Once a probe's
    socket is closed the kernel may hand the same port to the next probe: a test cluster got one port for
    its HTTP and its gRPC ingress (two calls in a row), and every gRPC test of the run failed."""
    with _ports_lock:
        for _ in range(1000):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _ports_given:
                _ports_given.add(port)
                return port
    raise RuntimeError("no free TCP port that this process was not given already")


def launch_local_processes(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int,
    env: Mapping[str, str] | None = None,
    quiet_followers: bool = True,
    timeout: float | None = None,
) -> int:
    """Runs `command` as `num_processes` local processes forming one JAX cluster over loopback, each
    with `devices_per_process` virtual CPU devices. Process 0 keeps stdout; the others' stdout is
    dropped when `quiet_followers`. Returns the first non-zero exit code (the rest are stopped), else 0.
    """
    coordinator = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        child_env = {
            **os.environ,
            **(env or {}),
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(i),
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(devices_per_process),
        }
        stdout = subprocess.DEVNULL if (i and quiet_followers) else None
        procs.append(subprocess.Popen(list(command), env=child_env, stdout=stdout))
    deadline = None if timeout is None else time.monotonic() + timeout
    rc = 0
    try:
        pending = list(procs)
        while pending and rc == 0:
            for p in list(pending):
                code = p.poll()
                if code is not None:
                    pending.remove(p)
                    rc = rc or code
            if deadline is not None and time.monotonic() > deadline:
                rc = 124
            time.sleep(0.05)
    finally:
        for p in procs:  # one failed (or timed out): the others would wait for it forever
            if p.poll() is None:
                p.kill()
            p.wait()
    return rc


# ---------------------------------------------------------------------------------------------
# A model over a mesh.


def load_parallel_model(model_dir, parallel, devices: Sequence[Any] | None = None, **load_args):
    """`workers.models.load_model` placed on the mesh of `parallel` (a `ParallelConfig`): experts
    split over the EP axes, dense weights over the TP axes, the batch over the DP axes, and the routed
    experts run by an `ExpertParallel` in the configured MoE mode. One device: a plain `load_model`."""
    from workers.models import load_config, load_model

    _, cfg = load_config(model_dir)
    layout = layout_from_config(parallel, cfg.num_experts, devices)
    if layout.mesh.size == 1:
        return load_model(model_dir, **load_args)
    log.info("%s", layout.describe())
    model = load_model(model_dir, mesh=layout.mesh, rules=layout.rules(), **load_args)
    moe = parallel.moe
    model.experts = layout.expert_parallel(moe.dispatch, moe.gather_dtype, moe.fast_axes, moe.all_to_all_min_tokens)
    model.data_axes = layout.dp_axes
    return model
