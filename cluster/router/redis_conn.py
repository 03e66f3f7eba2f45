"""Redis plumbing shared by the index and the event sink: connecting (password/ACL user, TLS), Lua
scripts (EVALSHA with a fallback to EVAL), and the circuit breaker that keeps requests off a dead Redis.

Every call has a deadline: socket connect and read timeouts are `KVIndexConfig.timeout_s`, and redis-py's
own retries are off (its default retries with exponential backoff could hold a request for seconds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, NoScriptError, RedisError
from redis.retry import Retry

from .types import IndexUnavailable

log = logging.getLogger("moray.router")


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    return url.replace(f"{user}{parts.password}@", f"{user}***@", 1)


def connect(
    url: str,
    timeout_s: float,
    *,
    password_env: str | None = None,
    tls_ca_file: str | None = None,
    tls_cert_file: str | None = None,
    tls_key_file: str | None = None,
    tls_check_hostname: bool = True,
) -> redis.Redis:
    """A client for `redis://[user:password@]host:port/db`, `rediss://...` (TLS) or `unix://path`.

    The password may come from the environment (`password_env`) instead of the URL, so it never sits in a
    config file. Nothing is sent until the first command: a wrong password surfaces as IndexUnavailable
    on first use (see `describe`), not here.
    """
    kwargs: dict[str, Any] = dict(
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=True,
    )
    if password_env:
        password = os.environ.get(password_env)
        if password is None:
            raise ValueError(f"kv_index.password_env names {password_env!r}, which is not set")
        kwargs["password"] = password
    if url.startswith("rediss://"):
        kwargs.update(ssl_ca_certs=tls_ca_file, ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file, ssl_check_hostname=tls_check_hostname)
    return redis.Redis.from_url(url, **kwargs)


def connect_from_config(cfg, timeout_s: float | None = None) -> redis.Redis:
    """`connect` with the settings of a `cluster.config.KVIndexConfig`."""
    return connect(
        cfg.backend,
        timeout_s if timeout_s is not None else cfg.timeout_s,
        password_env=cfg.password_env,
        tls_ca_file=cfg.tls_ca_file,
        tls_cert_file=cfg.tls_cert_file,
        tls_key_file=cfg.tls_key_file,
        tls_check_hostname=cfg.tls_check_hostname,
    )


def describe(client: redis.Redis, exc: BaseException) -> str:
    """One line naming the Redis server and what went wrong, never the password."""
    kw = client.connection_pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}"
    user = kw.get("username")
    if isinstance(exc, AuthenticationError):
        who = f"user {user!r}" if user else "the default user"
        return f"Redis at {where} rejected the credentials of {who} ({exc}); check the password / ACL user in kv_index"
    if isinstance(exc, NoPermissionError):
        return f"Redis at {where}: ACL user {user!r} lacks a permission the router needs ({exc})"
    return f"Redis at {where}: {type(exc).__name__}: {exc}"


class LuaScript:
    """A Lua script run by SHA (EVALSHA); after a Redis restart or SCRIPT FLUSH the server no longer has
    it, and the call falls back to EVAL, which also caches it again."""

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __call__(self, client: redis.Redis, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            return client.eval(self.source, len(keys), *keys, *args)


class CircuitBreaker:
    """Keeps requests off an unreachable Redis.

    Closed: calls go through. The first failure opens it (logged once, with the cause); while open,
    `guard()` raises IndexUnavailable at once, so no request waits on a socket timeout. Every
    `retry_interval_s` a background thread probes (PING) and closes it when Redis answers again;
    requests never do the probing themselves.
    """

    def __init__(self, client: redis.Redis, retry_interval_s: float = 1.0, on_change: Callable[[bool], None] | None = None):
        self.client = client
        self.retry_interval_s = retry_interval_s
        self.on_change = on_change  # called with True when it closes (Redis back), False when it opens
        self._lock = threading.Lock()
        self._open = False
        self._reason = ""
        self._next_probe = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def reason(self) -> str:
        return self._reason

    def guard(self) -> None:
        if not self._open:
            return
        with self._lock:
            if self._open and not self._probing and time.monotonic() >= self._next_probe:
                self._probing = True
                threading.Thread(target=self._probe, name="moray-redis-probe", daemon=True).start()
        raise IndexUnavailable(self._reason)

    # A change of state and its notification happen under the lock: notified outside it, a close that lost
    # the CPU between the two could report "up" after a later open had reported "down" (the up gauge then
    # read 1 while the breaker was open).

    def failure(self, exc: BaseException) -> IndexUnavailable:
        """Opens the breaker; returns the IndexUnavailable to raise."""
        reason = describe(self.client, exc)
        with self._lock:
            was_open, self._open, self._reason = self._open, True, reason
            self._next_probe = time.monotonic() + self.retry_interval_s
            if not was_open:
                log.warning("KV index unavailable, routing by load only until it returns: %s", reason)
                if self.on_change:
                    self.on_change(False)
        return IndexUnavailable(reason)

    def success(self) -> None:
        if self._open:
            with self._lock:
                was_open, self._open = self._open, False
                if was_open:
                    log.warning("KV index reachable again; KV-aware routing resumes")
                    if self.on_change:
                        self.on_change(True)

    def _probe(self) -> None:
        try:
            self.client.ping()
        except RedisError as e:
            with self._lock:
                self._reason = describe(self.client, e)
                self._next_probe = time.monotonic() + self.retry_interval_s
        else:
            self.success()
        finally:
            self._probing = False

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs one Redis operation under the breaker: IndexUnavailable instead of any Redis error."""
        self.guard()
        try:
            out = fn()
        except RedisError as e:
            raise self.failure(e) from e
        self.success()
        return out
