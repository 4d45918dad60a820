"""The threads that run the ``grpc`` transport's server method (:mod:`stratagem.transports.grpc.transport`).

gRPC's synchronous server runs each call on a thread of the executor it is given, and a streaming
call holds its thread for as long as the stream lives: here, as long as the peer task runs. With
``concurrent.futures.ThreadPoolExecutor`` those threads are joined when the interpreter exits, so a
script that ended without closing its transport waited forever for its peers' streams to end (and
its peers, still connected, never learnt that it was gone). :class:`DaemonExecutor` runs each call
on a daemon thread instead: a process exits when its script does, and the operating system's
closing of its sockets tells every peer at once. ``close()`` still ends every call promptly; this is
the defence for when it is never called.

gRPC uses only ``submit`` (and the returned future's ``add_done_callback``), so that is all this
implements. The server's ``maximum_concurrent_rpcs`` bounds how many calls (and so threads) run at
once.

    >>> pool = DaemonExecutor("doc")
    >>> pool.submit(sum, [1, 2, 3]).result(timeout=5)
    6
"""

from __future__ import annotations

import threading
from concurrent import futures
from itertools import count


class DaemonExecutor(futures.Executor):
    """Runs each submitted call on a new daemon thread (gRPC calls here are few and long-lived, so a
    thread per call costs nothing worth pooling)."""

    def __init__(self, name: str):
        self._name = name
        self._numbers = count()
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError(f"{self._name}: cannot run new calls after shutdown")
            number = next(self._numbers)
        thread = threading.Thread(target=_run, args=(future, fn, args, kwargs), daemon=True,
                                  name=f"{self._name}-{number}")
        thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls. Running ones are not waited for: they end when their streams do."""
        with self._lock:
            self._shutdown = True


def _run(future: futures.Future, fn, args, kwargs) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)


def close_in_background(channel, name: str) -> None:
    """Close a gRPC channel on a daemon thread. ``Channel.close()`` waits until every operation of
    its calls has completed, even of cancelled calls: a message being written to a peer that stopped
    reading (a stopped process, a dead host) completes only when keepalive drops the connection,
    seconds later. The calls are cancelled before this, so nothing is lost by not waiting."""
    threading.Thread(target=channel.close, daemon=True, name=name).start()
