"""`moray serve`: start a fresh local Ray (or attach to a running cluster with --address), deploy, print
how to call it, serve until Ctrl-C or SIGTERM.

Exit codes: 0 stopped by Ctrl-C/SIGTERM after it was serving; 1 it could not start (no Ray cluster at
--address, pools that cannot be placed, not ready within --startup-timeout, a failed deployment); 2 a bad
config; 128+N interrupted by signal N (130 Ctrl-C, 143 SIGTERM) before it was serving. Every failure is
one line on stderr. Whatever it started (Serve, the local Ray) is shut down before it exits.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from . import logs
from .config import ClusterConfig, ConfigError, load_cluster_config, parse_cluster_config

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="cluster config YAML")
    p.add_argument("--model", type=Path, help="model directory (overrides the config's engine.model)")
    p.add_argument("--http-port", type=int)
    p.add_argument("--grpc-port", type=int)
    p.add_argument("--host", help="address the HTTP proxy binds (overrides server.host; 0.0.0.0 exposes it to the network)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument(
        "--ingress",
        choices=["serve", "direct"],
        help="server.ingress: Serve's proxies take the ports (serve), or the front-end replicas listen themselves (direct)",
    )
    p.add_argument(
        "--address",
        help="Ray cluster to deploy onto: 'auto' (the one RAY_ADDRESS names, else the last `ray start` on this machine), "
        "HOST:PORT (its GCS) or ray://HOST:PORT. Default: start a fresh local Ray for this command and stop it on exit; "
        "RAY_ADDRESS and running clusters are never used unless --address says so",
    )
    p.add_argument(
        "--host-kv-gib",
        type=float,
        help="a host-memory KV tier of this many GiB per worker below the device cache (overrides engine.host_kv; 0: off)",
    )
    p.add_argument(
        "--speculative-config",
        help="speculative decoding, as JSON with vLLM's keys (overrides engine.speculative), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\'',
    )
    p.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: this machine's); not with --address")
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="start the local Ray's dashboard too (on --dashboard-port); off by default: it adds about a second "
        "to start-up and `moray serve` needs none of it; not with --address (that cluster has its own)",
    )
    p.add_argument("--dashboard-port", type=int, default=8265, help="port of the local Ray's dashboard with --dashboard (default 8265)")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the --address cluster to answer (default 30)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for every pool to be ready (model load and XLA compile can take minutes on TPU); "
        "pools that cannot be placed fail at once on a local Ray, after this on a cluster that may scale up (default 1800)",
    )


def resolve_config(args: argparse.Namespace) -> ClusterConfig:
    if args.config is not None:
        data = load_cluster_config(args.config).model_dump(exclude_unset=True)
        if args.model is not None:
            data["engine"]["model"] = str(args.model)
    elif args.model is not None:
        data = {"engine": {"model": str(args.model)}}
    else:
        raise ConfigError("give --config FILE or --model DIR")
    if args.http_port:
        data.setdefault("server", {})["http_port"] = args.http_port
    if args.grpc_port:
        data.setdefault("server", {})["grpc_port"] = args.grpc_port
    if getattr(args, "host", None):
        data.setdefault("server", {})["host"] = args.host
    if getattr(args, "mode", None):
        data["mode"] = args.mode
    if getattr(args, "ingress", None):
        data.setdefault("server", {})["ingress"] = args.ingress
    if getattr(args, "host_kv_gib", None) is not None:
        data["engine"]["host_kv"] = {"memory_gib": args.host_kv_gib}
    if getattr(args, "speculative_config", None):
        try:
            data["engine"]["speculative"] = json.loads(args.speculative_config)
        except ValueError as e:
            raise ConfigError(f"--speculative-config is not JSON: {e}") from None
    # Workers may run in another directory: pin the model to an absolute path.
    data["engine"]["model"] = str(Path(data["engine"]["model"]).expanduser().resolve())
    return parse_cluster_config(data)


# ---- Signals ---------------------------------------------------------------------------------------------


class Interrupted(BaseException):
    """Not an Exception, as KeyboardInterrupt is not: start-up code (ours: status probes; Ray's own) has
    broad `except Exception` blocks that would swallow it, and start-up would carry on regardless."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """SIGINT/SIGTERM raise `Interrupted` in the main thread, whatever it is waiting for.

    Python runs a signal handler only between bytecodes, and some Ray calls block in C for minutes (a
    GCS that does not answer). So a watcher thread also sees each signal (through the wakeup fd) and
    enforces a deadline: if the process has not exited `grace_s` after the first signal, or on a second
    signal, it exits at once (the local Ray's processes die with it: Ray ties them to their parent).
    """

    def __init__(self, grace_s: float = 30.0):
        self.grace_s = grace_s
        self.first_signal_at: float | None = None
        self._signum: int | None = None
        self.cleaning_up = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self.install()
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="moray-signal-watch", daemon=True).start()

    def install(self) -> None:
        """(Re)installs the handlers: `ray.init` sets its own SIGTERM handler."""
        for s in STOP_SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        if self.cleaning_up:
            return  # the watcher thread handles a second signal
        raise Interrupted(signum)

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum not in STOP_SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if self.first_signal_at is not None:
                    _exit_now(f"moray: second {name}: exiting without waiting for the shutdown", 128 + signum)
                self._signum = signum
                self.first_signal_at = time.monotonic()
                threading.Thread(target=self._deadline, args=(signum,), daemon=True).start()

    def _deadline(self, signum: int) -> None:
        while time.monotonic() < self.first_signal_at + self.grace_s:
            time.sleep(0.2)
        _exit_now(f"moray: did not stop within {self.grace_s:g}s of {signal.Signals(signum).name}: exiting", 128 + signum)

    def raise_if_signalled(self) -> None:
        """A signal whose exception something swallowed anyway still stops the command."""
        if self.first_signal_at is not None and self._signum is not None:
            raise Interrupted(self._signum)

    def wait_forever(self) -> None:
        while True:
            self.raise_if_signalled()
            time.sleep(1.0)


def _exit_now(message: str, code: int) -> None:
    try:
        print(message, file=sys.stderr, flush=True)
    finally:
        os._exit(code)


# ---- Ray -------------------------------------------------------------------------------------------------


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """None once a TCP connection to host:port succeeds within timeout_s, else the last error."""
    import socket

    deadline = time.monotonic() + timeout_s
    error = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, timeout_s))):
                return None
        except OSError as e:
            error = e.strerror or str(e)
        if time.monotonic() >= deadline:
            return error
        time.sleep(0.5)


def resolve_address(address: str) -> tuple[str, str]:
    """(address to connect to, where it came from) for --address; 'auto' reads RAY_ADDRESS, then the session file."""
    from .launch import StartupError

    if address != "auto":
        return address, "--address"
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env:
        return env, "RAY_ADDRESS"
    from ray._common.utils import get_ray_address_file

    path = get_ray_address_file(None)
    try:
        found = Path(path).read_text().strip()
    except OSError:
        found = ""
    if found:
        return found, f"the `ray start` session file {path}"
    raise StartupError(
        f"--address auto: no Ray cluster to attach to (RAY_ADDRESS is unset and {path} does not exist); "
        "start one with `ray start --head`, or leave out --address to start a local Ray"
    )


def _host_port(address: str) -> tuple[str, int]:
    from .launch import StartupError

    rest = address.removeprefix("ray://")
    if "://" in rest:
        raise StartupError(
            f"{address} is not a Ray GCS address: --address takes HOST:PORT (e.g. 127.0.0.1:6379) or ray://HOST:PORT, "
            "not a dashboard URL (http://HOST:8265 is for `ray job submit`)"
        )
    host, _, port = rest.rpartition(":")
    try:
        return (host or "127.0.0.1").strip("[]"), int(port)
    except ValueError:
        raise StartupError(f"--address {address}: expected HOST:PORT") from None


def _import_in_background(module: str) -> threading.Thread:
    """Imports `module` on a daemon thread. The application's modules (the engine and JAX with them: about a
    second) are needed only once Ray is up, and starting Ray is mostly waiting for its processes; an import
    that fails here fails again, with its error, where the module is used. The caller joins the thread
    before returning: an interpreter that shuts down while a thread is inside JAX's native imports can die
    of SIGSEGV or SIGABRT (seen when start-up failed fast on a loaded machine)."""

    def run():
        try:
            importlib.import_module(module)
        except BaseException:  # noqa: BLE001 - reported by the import that needs it
            pass

    thread = threading.Thread(target=run, name=f"import-{module}", daemon=True)
    thread.start()
    return thread


def connect_ray(args: argparse.Namespace, guard: SignalGuard, say) -> bool:
    """Connects to the --address cluster, or starts a fresh local Ray. True when the Ray is ours (local)."""
    import ray

    from .launch import StartupError

    verbose = getattr(args, "verbose", False)
    # Quiet by default: replica logs stay in Ray's log directory unless -v (their errors reach the console
    # through cluster/logs.py's ErrorConsole).
    opts = {"logging_level": "INFO" if verbose else "WARNING", "log_to_driver": verbose}
    if args.address is None:
        stale = os.environ.pop("RAY_ADDRESS", None)  # nor may the local Ray's processes see it
        say("starting a local Ray" + (f" (ignoring RAY_ADDRESS={stale}: pass --address auto to use it)" if stale else ""))
        try:
            dashboard = getattr(args, "dashboard", False)
            if dashboard:
                opts["dashboard_port"] = getattr(args, "dashboard_port", 8265)
            context = ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=dashboard, **opts)
            if dashboard and getattr(context, "dashboard_url", None):
                say(f"Ray dashboard: http://{context.dashboard_url}")
        except SystemExit as e:  # ray.init's own SIGTERM handler, before ours is back
            if e.code == signal.SIGTERM:
                raise Interrupted(signal.SIGTERM) from None
            raise
        finally:
            guard.install()
        return True
    if args.num_cpus is not None:
        raise StartupError("--num-cpus sizes a local Ray: it does not go with --address")
    if getattr(args, "dashboard", False):
        raise StartupError("--dashboard starts a local Ray's dashboard: it does not go with --address")
    address, source = resolve_address(args.address)
    host, port = _host_port(address)
    say(f"connecting to the Ray cluster at {address} (from {source})")
    error = _probe(host, port, args.connect_timeout)
    if error is not None:
        raise StartupError(
            f"no Ray cluster answers at {address} (from {source}) within {args.connect_timeout:g}s: {error}; "
            "start it (`ray start --head`), fix the address, or leave out --address to start a local Ray"
        )
    # The port answers; should it not be a GCS, ray.init could block in C far longer than asked.
    watchdog = threading.Timer(
        args.connect_timeout + 60,
        _exit_now,
        (
            f"moray: error: {address} (from {source}) accepts connections but Ray did not connect within "
            f"{args.connect_timeout + 60:g}s; is it a Ray GCS port?",
            1,
        ),
    )
    watchdog.daemon = True
    watchdog.start()
    try:
        ray.init(address=address, **opts)
    except SystemExit as e:
        if e.code == signal.SIGTERM:
            raise Interrupted(signal.SIGTERM) from None
        raise
    except (ConnectionError, RuntimeError) as e:
        raise StartupError(f"could not connect to the Ray cluster at {address} (from {source}): {str(e).splitlines()[0]}") from None
    finally:
        watchdog.cancel()
        guard.install()
    return False


def _serve_running() -> bool:
    """Is a Serve controller already running on the connected cluster (someone else's Serve)?"""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def _kill_replicas(app_name: str) -> None:
    """Kills the app's replicas: ones still loading, or waiting for resources, would only stop when Serve's
    graceful shutdown timeout (graceful_shutdown_timeout_s) runs out."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == SERVE_NAMESPACE and entry.get("name", "").startswith(f"SERVE_REPLICA::{app_name}#"):
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE), no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _shutdown_serve(owns_serve: bool, app_name: str, timeout_s: float, drain: bool) -> None:
    """Removes what this command deployed within timeout_s: its application, then Serve itself when it
    started it (Serve's controller is always detached: it would outlive this process). Without `drain`
    (start-up never finished) the replicas are killed rather than waited for."""
    from ray import serve
    from ray.serve import context

    client = context._global_client
    if client is None:
        return
    serve.delete(app_name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is None:
            break
        # Only once Serve is deleting the app: before, it would replace the killed replicas.
        if not drain and str(getattr(app.status, "value", app.status)) == "DELETING":
            _kill_replicas(app_name)
        time.sleep(0.5)
    if owns_serve and not serve.status().applications:
        client.shutdown(timeout_s=max(5.0, deadline - time.monotonic()))
        context._set_global_client(None)


# ---- The command -----------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    if args.address is None and not Path(cfg.engine.model).is_dir():  # a local Ray reads it from this machine
        raise ConfigError(f"engine.model {cfg.engine.model} is not a directory")
    from .launch import StartupError, cluster_nodes, ensure_local_env, how_to_call, placement_problems, start_serve, wait_until_ready

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ensure_local_env()
    importer = _import_in_background("cluster.app")  # overlaps the Ray start below
    logs.configure(cfg.observability, forward_errors=False)
    guard = SignalGuard(grace_s=cfg.graceful_shutdown_timeout_s + 40)  # a safety net: cleanup is bounded below it
    phase = "starting"
    deployed = owns_serve = local = False
    console = None
    rc = 0
    try:
        local = connect_ray(args, guard, say)
        # Before deploying: the replicas look for it when they start. With -v Ray streams their output already.
        console = None if getattr(args, "verbose", False) else _error_console(cfg.name, say)
        problems = placement_problems(cfg, cluster_nodes())
        if problems and local:
            # A local Ray never grows: these replicas would wait forever.
            raise StartupError("; ".join(problems))
        for problem in problems:
            say(f"warning: {problem} (waiting up to {args.startup_timeout:g}s for the cluster to scale up)")
        owns_serve = not _serve_running()
        say(f"deploying '{cfg.name}' (model {cfg.engine.model}, {cfg.mode})...")
        deployed = True
        try:
            start_serve(cfg, detached=False)
        except (Interrupted, StartupError):
            raise
        except Exception as e:  # e.g. a port in use, a route taken by another application
            raise StartupError(
                f"Serve could not deploy '{cfg.name}': {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
            ) from None
        say(f"waiting for the application to become ready (up to {args.startup_timeout:g}s; Ctrl-C stops)")
        wait_until_ready(cfg, args.startup_timeout, known_problems=problems, say=say)
        guard.raise_if_signalled()  # one that arrived inside a call that swallowed it
        print(how_to_call(cfg), flush=True)
        phase = "serving"
        guard.wait_forever()
    except Interrupted as e:
        if phase == "serving":
            say("shutting down...")
        else:
            say(f"moray: interrupted by {e} while starting: stopping what it started")
            rc = 128 + e.signum
    except StartupError as e:
        say(f"moray: error: {e}")
        rc = 1
    finally:
        guard.cleaning_up = True
        # Serving: let the replicas drain (graceful_shutdown_timeout_s). Starting: nothing to drain, and
        # replicas still in their constructors would only stop at Serve's graceful timeout; a local Ray's
        # shutdown stops them (and Serve) at once.
        serving = phase == "serving"
        if console is not None:
            console.stop()
        _cleanup(deployed and (serving or not local), owns_serve, cfg.name, cfg.graceful_shutdown_timeout_s + 10, serving, rc)
        importer.join(IMPORT_JOIN_TIMEOUT_S)
    return rc


IMPORT_JOIN_TIMEOUT_S = 120.0  # an import that takes longer is stuck; exiting beside it is the lesser risk


def _error_console(app_name: str, say) -> logs.ErrorConsole | None:
    """The replicas' errors on this console; serving goes on without it."""
    try:
        return logs.ErrorConsole(app_name)
    except Interrupted:
        raise
    except Exception as e:  # noqa: BLE001
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        say(f"warning: the replicas' errors will be in Ray's logs only (no console for them: {cause})")
        return None


RAY_SHUTDOWN_TIMEOUT_S = 15.0


def _kill_descendants() -> None:
    """SIGKILLs every process this one started, and theirs: a local Ray's GCS, raylet, agents and workers
    (killing only the ones Ray's node tracks leaves agents behind until they notice the raylet is gone)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


def _cleanup(stop_serve: bool, owns_serve: bool, app_name: str, serve_timeout_s: float, drain: bool, rc: int) -> None:
    import ray

    if not ray.is_initialized():
        return
    if stop_serve:
        try:
            _shutdown_serve(owns_serve, app_name, serve_timeout_s, drain)
        except Exception as e:  # noqa: BLE001 - Ray's shutdown below still runs
            print(f"moray: Serve did not shut down cleanly: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    _shutdown_ray(RAY_SHUTDOWN_TIMEOUT_S, rc)


def _shutdown_ray(timeout_s: float, rc: int) -> None:
    """ray.shutdown(), bounded: interrupted mid-call (a signal during start-up), it has been seen to block
    for minutes in the driver's core worker. Past timeout_s the local Ray's processes are killed directly
    and this process exits at once (Ray's atexit hook would call the stuck shutdown again)."""
    import ray

    done = threading.Event()

    def stop() -> None:
        try:
            ray.shutdown()
        finally:
            done.set()

    threading.Thread(target=stop, name="moray-ray-shutdown", daemon=True).start()
    if done.wait(timeout_s):
        return
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and node.head:  # a local Ray this process started; never a cluster it attached to
        _kill_descendants()
    sys.stdout.flush()
    _exit_now(f"moray: Ray did not shut down within {timeout_s:g}s: stopped its processes and exiting", rc)
