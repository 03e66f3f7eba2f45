"""Direct ingress (`server.ingress: direct`): every front-end replica serves HTTP and gRPC on the cluster's
ports itself, and Serve starts no proxies.

Why: through Serve's proxy each request crosses one more process and is wrapped twice (proxy -> replica as
an actor call, ASGI messages back). On the tiny model at concurrency 64 (`moray bench serve --vs-engine`,
2 cores) the proxy and the front end spent 0.12 CPU-seconds per 1,000 tokens, 0.036 served directly, and
served throughput rose from 0.25 to 0.43 of the offline engine's.

How: the sockets are bound in the replica's constructor with SO_REUSEPORT, so the front-end replicas of one
node share the ports (the kernel spreads connections over them), a new replica of a rolling update takes
connections as soon as it is up, and a port that cannot be bound fails the replica's start with a clear
error instead of a replica that serves nothing. A replica being stopped closes its listeners first and
lets its open requests finish. Serve's proxy cancels a request whose client went away; `cancel_on_disconnect`
does the same here (the pipeline then aborts it on its worker).

What the proxy did that this does too: `/-/healthz` (200 `success`, 503 once the replica stops), which
KubeRay probes on the head pod before its Service sends traffic there. What it did that this does not:
`/-/routes` (Moray's `/health` stays), and the route prefix (the app answers at `/`). The replicas listen on
the nodes they run on: the front ends of a direct cluster are placed on the head node (cluster/app.py), so a
load balancer or a Kubernetes Service reaches them there. gRPC servers set SO_REUSEPORT by default, so a port another gRPC
server on the node holds is shared with it, not refused (HTTP servers do not: a taken HTTP port is an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import grpc

from .config import ServerConfig
from .grpc_service import add_MorayServicer_to_server

log = logging.getLogger("moray.cluster")

# Long enough for a last SSE event to leave; open requests have had `graceful_shutdown_timeout_s` already.
STOP_GRACE_S = 5.0


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other replicas of this node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"server.ingress=direct: cannot listen on {host}:{port} (server.http_port): {e}") from e
    return sock


def cancel_on_disconnect(app):
    """ASGI middleware: an HTTP request whose client disconnects before its response is complete is
    cancelled, as Serve's proxy cancels it (a non-streamed completion would otherwise run to its end).

    After the request body, the app's own `receive` calls (Starlette's streaming response listens for the
    disconnect) wait for the one the watcher reads, so one reader ever calls the server's `receive`."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        body_read = asyncio.Event()
        disconnected = asyncio.Event()
        responded = False

        async def app_receive():
            if body_read.is_set():
                await disconnected.wait()
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def app_send(message):
            nonlocal responded
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                responded = True
            await send(message)

        handler = asyncio.ensure_future(app(scope, app_receive, app_send))

        async def watch():
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            if not responded:
                handler.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not disconnected.is_set():
                raise  # cancelled from outside (the server stopping), not by the client
        finally:
            watcher.cancel()

    return wrapped


PROXY_HEALTH_PATH = "/-/healthz"


def proxy_health(app, stopping):
    """ASGI middleware: `GET /-/healthz` answered as Serve's proxy answers it (KubeRay labels the head pod
    for its Service from it), 503 once `stopping()`; every other request goes to `app`."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != PROXY_HEALTH_PATH:
            return await app(scope, receive, send)
        status, body = (503, b"This node is being drained.") if stopping() else (200, b"success")
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return wrapped


def _add_health_check(frontend, server) -> None:
    """grpc.health.v1.Health/Check (the method Kubernetes' gRPC probes and grpc_health_probe call)."""
    from grpc_health.v1 import health_pb2

    handler = grpc.unary_unary_rpc_method_handler(
        frontend.Check,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": handler}),))


class DirectIngress:
    """The HTTP and gRPC listeners of one front-end replica (`Frontend` builds it in its constructor)."""

    def __init__(self, frontend, http_app, server: ServerConfig):
        import uvicorn

        self.http_socket = reuse_port_socket(server.host, server.http_port)
        self.stopping = False
        config = uvicorn.Config(
            proxy_health(cancel_on_disconnect(http_app), lambda: self.stopping),
            log_level="warning",
            access_log=False,
            lifespan="off",  # the replica's constructor is the app's start-up
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self.http = uvicorn.Server(config)  # (it installs no signal handlers off the main thread: Ray keeps its own)
        options = [("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", server.max_body_bytes)]
        self.grpc = grpc.aio.server(options=options)
        # The front end's gRPC methods take (request, context) from grpc.aio as from Serve's proxy, and the
        # status they set on the context is what grpc.aio sends, a stream's raised error included.
        add_MorayServicer_to_server(frontend, self.grpc)
        _add_health_check(frontend, self.grpc)
        host = f"[{server.host}]" if ":" in server.host else server.host
        try:
            self.grpc.add_insecure_port(f"{host}:{server.grpc_port}")
        except RuntimeError as e:
            self.http_socket.close()
            raise RuntimeError(f"server.ingress=direct: cannot listen on {host}:{server.grpc_port} (server.grpc_port): {e}") from e
        self._tasks: list[asyncio.Future] = []  # held here: the event loop keeps only weak references to tasks
        self._loop: asyncio.AbstractEventLoop | None = None
        self.where = f"http {server.host}:{server.http_port}, grpc {server.host}:{server.grpc_port}"

    def start(self) -> None:
        """Starts serving on the running event loop (the replica's)."""
        self._loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.ensure_future(self.http.serve(sockets=[self.http_socket])),
            asyncio.ensure_future(self.grpc.start()),
        ]
        log.info("direct ingress serving (%s)", self.where)

    def close(self) -> None:
        """Stops accepting connections and gives open requests STOP_GRACE_S to finish; returns at once (any
        thread may call it)."""
        self.stopping = True
        self.http.should_exit = True
        with contextlib.suppress(RuntimeError):  # the loop is closed already: the process is ending
            asyncio.run_coroutine_threadsafe(self.grpc.stop(STOP_GRACE_S), self._loop)
