"""Build worlds of connected transports for tests: free ports, in-process worlds, rank threads.

    >>> from stratagem.testing.world import transport_world, run_ranks
    >>> with transport_world("local", 3) as world:
    ...     run_ranks(world, lambda rank, t: (rank, str(t.task)))
    [(0, '/job:worker/task:0'), (1, '/job:worker/task:1'), (2, '/job:worker/task:2')]
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

import numpy as np

from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import ConfigurationError
from stratagem.transport_kit.ports import reserve_ports
from stratagem.core.transport import Message

#: Seconds the helpers below wait by default.
WAIT = 20.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago on ``host``, drawn from below the
    kernel's ephemeral range so that no outgoing connection takes one before it is bound again
    (see :mod:`stratagem.transport_kit.ports`)."""
    _, held = reserve_ports(host, count)
    try:
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def local_cluster(jobs: dict[str, int] | int, host: str = "127.0.0.1") -> ClusterSpec:
    """A cluster on this machine with a free port per task: ``local_cluster({"worker": 2, "ps": 1})``."""
    if isinstance(jobs, int):
        jobs = {"worker": jobs}
    ports = iter(free_ports(sum(jobs.values()), host))
    return ClusterSpec({job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in jobs.items()})


@contextlib.contextmanager
def transport_world(name: str, size: int | dict[str, int], **options) -> Iterator[list]:
    """Start one endpoint of transport ``name`` per task of a fresh local cluster, in this process.

    Yields the started transports (ordered as ``cluster.tasks()``) and closes them all on exit.
    """
    from stratagem.plugins.manager import plugin_manager

    manager = plugin_manager()
    cls = manager.transport_class(name)
    cluster = local_cluster(size)
    shared = cls.world_options()
    world = []
    try:
        for task in cluster.tasks():
            world.append(manager.create_transport(name, cluster=cluster, task=task, **shared, **options))
        for transport in world:
            transport.start()
        yield world
    finally:
        for transport in world:
            with contextlib.suppress(Exception):
                transport.close()


def run_ranks(world: list, fn: Callable, timeout: float = 60.0, args_for=None) -> list:
    """Run ``fn(rank, transport)`` on every endpoint in its own thread; return the results in rank
    order, or raise the first error (by rank). Threads that outlive ``timeout`` raise ``TimeoutError``."""
    results: list = [None] * len(world)
    errors: list = [None] * len(world)

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world[rank])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"rank-{r}") for r in range(len(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    for exc in errors:
        if exc is not None:
            raise exc
    if stuck:
        raise TimeoutError(f"ranks {stuck} did not finish within {timeout} s")
    return results


def wait_for(predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Poll ``predicate`` until it is true (``True``) or ``timeout`` seconds pass (``False``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def still_serves(a, b, timeout: float = WAIT) -> bool:
    """True if transport ``a`` can still deliver a message to ``b`` (after a hostile peer, say);
    raises what ``recv`` raises otherwise."""
    a.send(b.task, "ok", Message({"still": "serving"}, [np.arange(4)]))
    return b.recv(a.task, "ok", timeout=timeout).meta == {"still": "serving"}


def local_world(size: int, **options) -> list:
    """``size`` communicators over the in-process transport, one per rank of a ``worker`` world.

    For single-process multi-replica runs, examples and tests: drive each rank from its own thread.
    ``options`` go to every Communicator; each owns (and closes) its transport.

    >>> comms = local_world(2)
    >>> [(c.rank, str(c.task)) for c in comms]
    [(0, '/job:worker/task:0'), (1, '/job:worker/task:1')]
    >>> for c in comms: c.close()
    """
    from stratagem.collectives.communicator import Communicator
    from stratagem.transports.local import LocalTransport

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigurationError(f"a local world needs size >= 1, got {size!r}")
    cluster = ClusterSpec({"worker": [f"local:{i + 1}" for i in range(size)]})
    fabric = LocalTransport.world_options()
    transport_options = {"timeout": options["timeout"]} if options.get("timeout") is not None else {}
    comms = []
    for index in range(size):
        transport = LocalTransport(cluster, TaskId("worker", index), **fabric, **transport_options)
        transport.start()
        comms.append(Communicator(transport, owns_transport=True, **options))
    return comms
