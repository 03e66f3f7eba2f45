"""Moray's log records: one format switch (`observability.log_format`), and request errors on the console
of `moray serve`.

Every process (each replica, the CLI) gives the `moray` logger one stderr handler in the configured
format: text lines, or JSON lines with timestamp, level, logger, message, request_id (a log call's
`extra`, else the request the current task serves), stage, application, deployment and replica. In a
replica, stderr goes to Ray's log files.

`moray serve` keeps Ray's log streaming off: it would bring all of every worker's output to the console.
So that server-side failures still reach the console, the replicas also ship their `moray` ERROR records,
one line each (no traceback), to a small named actor (`ErrorSink`) that the CLI starts before deploying
and drains onto its stderr (`ErrorConsole`). Without that actor (`cluster.deploy`, the Helm chart) the
replicas log only to their own stderr.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
from datetime import datetime, timezone

from .config import ObservabilityConfig

MORAY_LOGGER = "moray"
SINK_NAMESPACE = "moray"
SINK_MAX_LINES = 1000  # lines the sink keeps while nobody drains it (the oldest go first)

# The request the current task serves (set per request by the ingress and the worker servers), for
# records that do not name one.
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("moray_request_id", default=None)


def sink_name(app_name: str) -> str:
    return f"errors:{app_name}"


# ---- formats -------------------------------------------------------------------------------------------


def _where() -> dict[str, str]:
    """This process's place in Serve (application, deployment, replica); empty outside a replica."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not a Serve replica (the CLI, a test process)
        return {}
    return {"application": ctx.app_name, "deployment": ctx.deployment, "replica": ctx.replica_id.unique_id}


def _exception_summary(record: logging.LogRecord) -> str | None:
    if not record.exc_info or record.exc_info[1] is None:
        return None
    e = record.exc_info[1]
    return f"{type(e).__name__}: {e}".splitlines()[0]


class TextFormatter(logging.Formatter):
    """`2025-01-01 12:00:00,123 ERROR moray.cluster [app Frontend 1a2b] message`; `one_line` leaves out
    the traceback (the exception's type and message instead)."""

    def __init__(self, where: dict[str, str], one_line: bool = False):
        super().__init__("%(asctime)s %(levelname)s %(name)s " + _bracket(where) + "%(message)s")
        self.one_line = one_line

    def format(self, record: logging.LogRecord) -> str:
        if not self.one_line:
            return super().format(record)
        line = logging.Formatter.formatMessage(self, _with_asctime(self, record))
        summary = _exception_summary(record)
        return line + (f" ({summary})" if summary and summary not in line else "")


def _bracket(where: dict[str, str]) -> str:
    if not where:
        return ""
    return "[" + " ".join(where[k] for k in ("application", "deployment", "replica")) + "] "


def _with_asctime(formatter: logging.Formatter, record: logging.LogRecord) -> logging.LogRecord:
    record.message = record.getMessage()
    record.asctime = formatter.formatTime(record)
    return record


class JSONFormatter(logging.Formatter):
    """One JSON object per line. `one_line`: the exception's type and message only, no traceback."""

    def __init__(self, where: dict[str, str], one_line: bool = False):
        super().__init__()
        self.where, self.one_line = where, one_line

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id:
            out["request_id"] = request_id
        for key in ("stage", "client_request_id"):
            if getattr(record, key, None):
                out[key] = getattr(record, key)
        out.update(self.where)
        summary = _exception_summary(record)
        if summary:
            out["exception"] = summary
            if not self.one_line:
                out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def formatter(log_format: str, where: dict[str, str], one_line: bool = False) -> logging.Formatter:
    return (JSONFormatter if log_format == "json" else TextFormatter)(where, one_line)


# ---- per process ---------------------------------------------------------------------------------------


class _MorayHandler(logging.StreamHandler):
    """stderr as it is when a record comes (a test runner swaps it per test); marks the handlers this
    module added, so configuring again replaces them."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(cfg: ObservabilityConfig, forward_errors: bool = True) -> None:
    """Gives the `moray` logger its stderr handler in the configured format and, in a replica of an
    application that `moray serve` runs, the handler shipping ERROR records to its console. Idempotent."""
    logger = logging.getLogger(MORAY_LOGGER)
    where = _where()
    for h in [h for h in logger.handlers if isinstance(h, (_MorayHandler, ForwardErrors))]:
        logger.removeHandler(h)
    handler = _MorayHandler()
    handler.setFormatter(formatter(cfg.log_format, where))
    logger.addHandler(handler)
    if forward_errors and where:
        sink = _find_sink(where["application"])
        if sink is not None:
            forward = ForwardErrors(sink)
            forward.setFormatter(formatter(cfg.log_format, where, one_line=True))
            logger.addHandler(forward)


def _find_sink(app_name: str):
    import ray

    try:
        return ray.get_actor(sink_name(app_name), namespace=SINK_NAMESPACE)
    except (ValueError, RuntimeError):  # no `moray serve` console for this application (or no Ray)
        return None


class ForwardErrors(logging.Handler):
    """Ships ERROR records, one line each, to the `ErrorSink` (fire and forget: never blocks the caller)."""

    def __init__(self, sink):
        super().__init__(level=logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write.remote(self.format(record))
        except Exception:  # noqa: BLE001 - a console that went away must not break a request
            pass


# ---- the console of `moray serve` ----------------------------------------------------------------------


class ErrorSink:
    """A named actor holding the replicas' error lines until the CLI takes them (a long poll)."""

    def __init__(self):
        import asyncio

        self.lines: list[str] = []
        self.dropped = 0
        self.arrived = asyncio.Event()

    async def write(self, line: str) -> None:
        self.lines.append(line)
        if len(self.lines) > SINK_MAX_LINES:
            self.dropped += len(self.lines) - SINK_MAX_LINES
            del self.lines[:-SINK_MAX_LINES]
        self.arrived.set()

    async def drain(self, wait_s: float) -> tuple[list[str], int]:
        """(lines, how many were dropped) once there are some, or after `wait_s`."""
        import asyncio

        if not self.lines:
            try:
                await asyncio.wait_for(self.arrived.wait(), wait_s)
            except TimeoutError:
                pass
        lines, dropped = self.lines, self.dropped
        self.lines, self.dropped = [], 0
        self.arrived.clear()
        return lines, dropped


class ErrorConsole:
    """Started by `moray serve` before it deploys: the sink actor, and a thread printing its lines to stderr."""

    POLL_S = 0.5

    def __init__(self, app_name: str, out=None):
        import ray

        self.out = out or sys.stderr
        actor = ray.remote(num_cpus=0)(ErrorSink)
        # Owned by this process: it goes when the CLI does.
        self.sink = actor.options(name=sink_name(app_name), namespace=SINK_NAMESPACE, get_if_exists=True).remote()
        self._stop = threading.Event()
        self._answered = False  # the sink has answered (is running)
        self._thread = threading.Thread(target=self._pump, name="moray-error-console", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                lines, dropped = ray.get(self.sink.drain.remote(self.POLL_S), timeout=self.POLL_S + 10)
            except Exception:  # noqa: BLE001 - Ray shutting down, or the actor still starting
                if self._stop.wait(self.POLL_S):
                    return
                continue
            self._answered = True
            self._print(lines, dropped)

    def _print(self, lines: list[str], dropped: int) -> None:
        if dropped:
            lines = [f"moray: {dropped} more error lines were dropped (see the replicas' logs)", *lines]
        for line in lines:
            print(line, file=self.out, flush=True)

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stops printing (before Ray shuts down); what already arrived is printed first."""
        self._stop.set()
        self._thread.join(timeout=timeout_s + self.POLL_S)
        if not self._answered:  # stopped while starting: nothing can have arrived, do not wait for the actor
            return
        try:
            import ray

            self._print(*ray.get(self.sink.drain.remote(0), timeout=timeout_s))
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
