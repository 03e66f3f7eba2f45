"""The moray.v1.Moray gRPC service as registered with Serve's gRPC proxy.

`add_MorayServicer_to_server` replaces the generated one in `grpc_servicer_functions` (see
`cluster.app.GRPC_SERVICERS`). The difference: requests travel to the ingress as the raw bytes the client
sent. Decoding them there means a request that is not a valid GenerateRequest is an INVALID_ARGUMENT with
a one-line message (the generated deserializer fails inside the proxy, which answers UNKNOWN), and the
size limit (`server.max_body_bytes`) is checked before anything is decoded or tokenised.
(`Frontend` also accepts parsed messages, so the generated servicer function keeps working.)

Serve logs every exception a deployment raises with its traceback at ERROR, in the replica and again in
the proxy. A streaming gRPC method can only report a status by raising, so client errors (an `APIError`
below 500) would flood the logs with tracebacks: `quiet_client_errors` installs a filter on Serve's
logger that turns those records into one INFO line. The ingress installs it in its replica, and this
servicer function in the proxy process (which imports and calls it).
"""

from __future__ import annotations

import logging

import grpc

from protos.moray.v1 import moray_pb2

from .openai_api import APIError

SERVICE = "moray.v1.Moray"
SERVE_LOGGER = "ray.serve"


def _client_error(exc: BaseException | None) -> APIError | None:
    """The client error (APIError < 500) behind a record's exception: raised directly, wrapped in
    Serve's gRPCStatusError, or in a Ray task error around either."""
    for _ in range(4):
        if exc is None:
            return None
        if isinstance(exc, APIError):
            return exc if exc.status < 500 else None
        exc = getattr(exc, "original_exception", None) or getattr(exc, "cause", None)
    return None


class ClientErrorLogFilter(logging.Filter):
    """Serve's "Request failed" records for client errors: one INFO line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            err = _client_error(record.exc_info[1] if record.exc_info else None)
        except Exception:  # noqa: BLE001 - a log filter must never break logging
            return True
        if err is None:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = "client error %s: %s", (err.status, err.message)
        record.exc_info = record.exc_text = record.stack_info = None
        return True


def quiet_client_errors() -> None:
    """Installs `ClientErrorLogFilter` on Serve's logger in this process (once)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, ClientErrorLogFilter) for f in logger.filters):
        logger.addFilter(ClientErrorLogFilter())


def add_MorayServicer_to_server(servicer, server) -> None:  # noqa: N802 - the name gRPC's generated code uses
    quiet_client_errors()
    raw = None  # no request_deserializer: the servicer gets the bytes as sent
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=raw, response_serializer=moray_pb2.GenerateResponse.SerializeToString
        ),
        "Complete": grpc.unary_unary_rpc_method_handler(
            servicer.Complete, request_deserializer=raw, response_serializer=moray_pb2.CompleteResponse.SerializeToString
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=raw, response_serializer=moray_pb2.ListModelsResponse.SerializeToString
        ),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=raw, response_serializer=moray_pb2.HealthResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.62
        server.add_registered_method_handlers(SERVICE, handlers)
