"""This process's started transports, by task: a communicator beside a strategy shares its transport.

A task's address (``host:port``) can be bound once per process. A script that makes a strategy and
then ``stratagem.communicator()`` (or the other way round) for the same task therefore gets the
started transport of the first as the second's: the same connections and peers, each user under its
own message tags (a strategy's communicator is named ``strategy.<name>``, ``stratagem.communicator()``'s
``world``). The first keeps owning it (it closes it); the second only uses it.

Shared only where binding again would collide: a transport with a fixed address. The in-process
transport (``local``), tasks without an address (MPI) and ephemeral ports (``:0``, a world of one)
bind their own. A request for another transport than the one running, or with ``transport_options``
(they would not apply to a started transport), is refused, naming the fix.

The table is process-wide by nature (one process, one address per task), like the lifecycle's; it
holds weak references, and a closed transport is never handed out.
"""

from __future__ import annotations

import threading
import weakref

from stratagem.core.errors import ConfigurationError

_LOCK = threading.Lock()
_HELD: dict[tuple, weakref.ref] = {}


def _key(cluster, task) -> tuple:
    return cluster.cluster_id, str(task)


def shareable(transport) -> bool:
    """True for a transport bound to a fixed address, which a second user in this process must share."""
    if transport.in_process:
        return False
    address = transport.cluster.jobs[transport.task.job][transport.task.index]
    return address is not None and not address.endswith(":0")


def hold(transport) -> None:
    """Record ``transport`` (started) as this process's for its task, for a later user to share."""
    if not shareable(transport):
        return
    with _LOCK:
        _HELD[_key(transport.cluster, transport.task)] = weakref.ref(transport)


def shared(name: str, cluster, task, transport_options, *, who: str):
    """The started transport of this process for ``task`` of ``cluster``, or ``None``.

    ``name`` is the transport plugin asked for; ``who`` says what asks (for the error messages).
    """
    with _LOCK:
        ref = _HELD.get(_key(cluster, task))
        transport = ref() if ref is not None else None
        if transport is None or transport.closed:
            _HELD.pop(_key(cluster, task), None)
            return None
    if transport.name != name:
        raise ConfigurationError(
            f"{who} asks for transport {name!r}, but this process already runs {task} over {transport.name!r} "
            f"(a strategy or communicator made earlier), and a task's address can be bound once: use "
            f"transport={transport.name!r} to share it"
        )
    if transport_options:
        raise ConfigurationError(
            f"{who} would share the {transport.name!r} transport this process already runs for {task}, so "
            f"transport_options cannot apply: leave them out (they belong to whatever made it first)"
        )
    return transport
