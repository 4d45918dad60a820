"""Settings of the ``grpc`` transport (:mod:`stratagem.transports.grpc.transport`): the method it serves,
message sizes, keepalive and connection options, TLS material and the bind address. Nothing here
imports grpc: options are plain ``(name, value)`` pairs.

    >>> dict(channel_options(peer_timeout=30.0))["grpc.keepalive_time_ms"]
    3000
"""

from __future__ import annotations


from stratagem.core.errors import ConfigurationError

SERVICE = "stratagem.Transport"
METHOD = "Stream"
#: The full name of the one gRPC method every task serves.
FULL_METHOD = f"/{SERVICE}/{METHOD}"
#: The largest piece a frame is cut into (gRPC's own default receive limit): ``chunk_bytes`` is at most this.
MAX_MESSAGE_BYTES = 4 << 20
#: The default size of the messages a frame is cut into (larger ones cost more in gRPC's allocator).
DEFAULT_CHUNK_BYTES = 1 << 20
#: What a task accepts in one gRPC message: the largest chunk plus slack (for a frame's head riding with
#: the first piece of a large buffer: ``grpc_framing.HEAD_ROOM``); gRPC refuses anything larger
#: (RESOURCE_EXHAUSTED) from its length prefix, before reading it.
MAX_RECEIVE_BYTES = MAX_MESSAGE_BYTES + (64 << 10)


def keepalive_ms(peer_timeout: float) -> tuple[int, int]:
    """The keepalive ping interval and how long an unanswered ping waits (ms): gRPC's threads ping
    every tenth of ``peer_timeout`` (needing neither the GIL nor the user's step) and drop the
    connection when a ping stays unanswered ``peer_timeout``, so a silent peer is lost at least
    ``peer_timeout`` after the last thing heard from it and at most a tenth of it later (or a second:
    gRPC sends at most one ping a second). A ping waits behind the data already written to its
    connection, so a link on which one message takes longer than ``peer_timeout`` may be taken for a
    loss (``benchmarks/link_stalls.py``).

    >>> keepalive_ms(30.0)
    (3000, 30000)
    """
    total = int(peer_timeout * 1000)
    interval = max(100, total // 10)
    return interval, max(interval, total)


def server_options(peer_timeout: float) -> list[tuple]:
    interval, timeout = keepalive_ms(peer_timeout)
    return [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
        ("grpc.keepalive_time_ms", interval),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.http2.ping_timeout_ms", timeout),  # else an unanswered ping waits a minute
        ("grpc.keepalive_permit_without_calls", 1),
        # Our peers ping as often as we do: do not count that as abuse.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", max(50, interval // 2)),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def channel_options(peer_timeout: float, server_name: str | None = None) -> list[tuple]:
    interval, timeout = keepalive_ms(peer_timeout)
    options = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
        ("grpc.keepalive_time_ms", interval),
        ("grpc.keepalive_timeout_ms", timeout),
        ("grpc.http2.ping_timeout_ms", timeout),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A peer that is not up yet is retried quickly (the call waits for it: wait_for_ready).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.use_local_subchannel_pool", 1),  # a connection of our own per peer, never shared
        ("grpc.enable_retries", 0),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


def load_tls(cert, key, ca, client_auth: bool) -> dict | None:
    """Read the TLS material (PEM files); None without TLS. Errors name the option and the file."""
    if cert is None and key is None:
        if ca is not None or client_auth:
            raise ConfigurationError("TLS needs this task's certificate: give tls_cert and tls_key "
                                     "(tls_ca and tls_client_auth only add to them)")
        return None
    if cert is None or key is None:
        raise ConfigurationError("give both tls_cert and tls_key (PEM files), or neither")
    if client_auth and ca is None:
        raise ConfigurationError("tls_client_auth=True needs tls_ca, the CA that signed the client certificates")
    return {"cert": _read_pem(cert, "tls_cert"), "key": _read_pem(key, "tls_key"),
            "ca": _read_pem(ca, "tls_ca") if ca is not None else None, "client_auth": bool(client_auth)}


def _read_pem(path, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigurationError(f"{option}={path!r} cannot be read: {exc}") from None
