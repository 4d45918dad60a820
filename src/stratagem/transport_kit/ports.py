"""Choosing ports for a local cluster's tasks.

A port the kernel hands out for ``bind(0)`` comes from its *ephemeral* range, the same range it
draws from for the local end of every outgoing connection. Between the moment we probe such a port
and the moment the task binds it, any process on the machine that opens a connection may be given
it, and the task then fails to bind. Ports are therefore drawn at random from *below* the ephemeral
range, where the kernel never assigns ports on its own, and held open together until handed over.

    >>> ip, held = reserve_ports("127.0.0.1", 2)
    >>> ports = [s.getsockname()[1] for s in held]
    >>> len(set(ports)) == 2 and all(MIN_PORT <= p < ephemeral_range()[0] for p in ports)
    True
    >>> for s in held: s.close()
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket

from stratagem.core.errors import ConfigurationError

#: Lowest port drawn: above the well-known and most registered service ports.
MIN_PORT = 20000
#: Random draws before falling back to a kernel-chosen (ephemeral) port.
_ATTEMPTS = 64


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux), or the common default elsewhere."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def reserve_ports(host: str, count: int) -> tuple[str, list[socket.socket]]:
    """Bind ``count`` sockets on ``host`` at distinct free ports below the ephemeral range.

    Returns the address bound and the open sockets; close each just before its task binds the port.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"cannot resolve host {host!r} ({exc}); give an address of this machine, e.g. 127.0.0.1"
        ) from None
    low = ephemeral_range()[0]
    rng = random.SystemRandom()
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            held.append(_bind_one(family, sockaddr, low, rng))
    except OSError as exc:
        for sock in held:
            sock.close()
        raise ConfigurationError(
            f"cannot bind a port on {host!r} ({exc}); the host must be an address of this machine"
        ) from None
    return sockaddr[0], held


def _bind_one(family, sockaddr, low: int, rng: random.Random) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if low > MIN_PORT + 1:
            for _ in range(_ATTEMPTS):
                try:
                    sock.bind((sockaddr[0], rng.randrange(MIN_PORT, low), *sockaddr[2:]))
                    return sock
                except OSError:
                    continue
        sock.bind((sockaddr[0], 0, *sockaddr[2:]))  # everything below was taken: let the kernel choose
        return sock
    except BaseException:
        sock.close()
        raise


def bind_host(address_host: str, explicit: str | None = None) -> str:
    """Where a task binds: ``explicit``, else ``STRATAGEM_BIND_HOST``, else the host of its cluster
    address if that is an IP of this machine (or localhost), else every interface (a Kubernetes
    service name resolves to a virtual IP that no pod can bind).

    >>> bind_host("worker-1.svc"), bind_host("localhost"), bind_host("10.0.0.7", "127.0.0.1")
    ('0.0.0.0', '127.0.0.1', '127.0.0.1')
    """
    if explicit or os.environ.get("STRATAGEM_BIND_HOST"):
        return explicit or os.environ["STRATAGEM_BIND_HOST"]
    if address_host in ("localhost", "127.0.0.1", "::1"):
        return "::1" if address_host == "::1" else "127.0.0.1"
    try:
        ipaddress.ip_address(address_host)
        return address_host
    except ValueError:
        return "0.0.0.0"


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host: ``[::1]:2222``."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
