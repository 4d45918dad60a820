"""The base Transport's close/abort template: each transport implements only ``_shutdown(graceful)``, and
the base runs it once, whichever of close() and abort() comes first and from however many threads. The
transport contract (stratagem.testing.contract) checks the same on every real transport; here a minimal
subclass counts the calls, which a real transport cannot show."""

from __future__ import annotations

import threading

from stratagem.core.transport import Transport
from stratagem.testing.world import local_cluster


class Counting(Transport):
    """A transport whose only job is to record how it was ended (slowly, so that calls overlap)."""

    name = "counting"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shutdowns: list[bool] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def start(self) -> None:
        pass

    def send(self, dst, tag, msg, timeout=None) -> None:
        raise NotImplementedError

    def recv(self, src, tag, timeout=None):
        raise NotImplementedError

    def _shutdown(self, graceful: bool) -> None:
        self.shutdowns.append(graceful)
        self.inside.set()
        self.release.wait(10)


def make() -> Counting:
    transport = Counting(local_cluster(1), "worker:0")
    transport.release.set()
    return transport


def test_a_second_close_does_nothing():
    t = make()
    t.close()
    t.close()
    assert t.shutdowns == [True]


def test_close_after_abort_does_nothing_and_abort_after_close_neither():
    aborted = make()
    aborted.abort()
    aborted.close()
    assert aborted.shutdowns == [False]  # no goodbye after a crash-like end
    closed = make()
    closed.close()
    closed.abort()
    assert closed.shutdowns == [True]


def test_the_exit_hook_closes_once_too():
    t = make()
    t.close()
    t._end_at_exit(None)
    assert t.shutdowns == [True]


def test_calls_from_many_threads_end_it_once_and_none_waits_for_the_first():
    t = Counting(local_cluster(1), "worker:0")
    first = threading.Thread(target=t.close)
    first.start()
    assert t.inside.wait(10)             # the first call is inside _shutdown...
    others = [threading.Thread(target=t.abort if i % 2 else t.close) for i in range(8)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(10)
    assert not any(thread.is_alive() for thread in others)  # ...and the others returned meanwhile
    t.release.set()
    first.join(10)
    assert t.shutdowns == [True]
