"""transport_kit.reading.SharedReader: the turn-taking of a transport's readers, over a real pipe and real
threads (the zmq and shm transports' own suites exercise it under real traffic)."""

from __future__ import annotations

import os
import select
import threading
import time

import pytest

from stratagem.transport_kit.reading import SharedReader

pytestmark = pytest.mark.timeout(30)


class PipeSource:
    """What a transport reads: a pipe; ``pump`` reads what is there, waiting up to its timeout."""

    def __init__(self):
        self.r, self.w = os.pipe2(os.O_NONBLOCK)
        self.readers: list[str] = []       # the thread that read each byte
        self.lock = threading.Lock()
        self.fail_with: Exception | None = None

    def pump(self, timeout: float) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        select.select([self.r], [], [], timeout)
        try:
            data = os.read(self.r, 4096)
        except BlockingIOError:
            return
        with self.lock:
            self.readers.extend(threading.current_thread().name for b in data if b != 0)

    def wake(self) -> None:
        os.write(self.w, b"\0")   # a wake-up byte, not counted as data

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


@pytest.fixture
def source():
    s = PipeSource()
    yield s
    s.close()


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_a_waiting_recv_reads_itself_and_the_background_reads_when_nobody_waits(source):
    crashes = []
    # A grace far longer than the loop below, however the scheduler runs it: with the transports'
    # 20 ms, a waiter descheduled for longer lets the background read in between (12 of 20 under load).
    reader = SharedReader("reader-under-test", source.pump, source.wake, lambda: crashes.append(1), grace=5.0)
    reader.start()
    try:
        os.write(source.w, b"\1")
        wait_for(lambda: source.readers)                  # nobody waits: the background thread read it
        assert source.readers == ["reader-under-test"]
        # A waiter keeps reading itself (its grace keeps the background away): everything it sends
        # itself comes back through its own reads, but the first, which the background may read
        # before the waiter's first turn has told it to stay away.
        mine = threading.current_thread().name
        for _ in range(20):
            os.write(source.w, b"\1")
            while not reader.for_waiter(1.0):
                pass
        assert source.readers.count(mine) >= 19, source.readers
        assert crashes == []
    finally:
        reader.stop()
    assert reader.for_waiter(0.1) is False and reader.read_now() is False   # stopped: nobody reads


def test_after_read_follows_every_read_by_a_caller_once_the_lock_is_free(source):
    # The shm transport wakes its other waiters there: they must find the lock free and what was read.
    seen = []
    reader = SharedReader("after-read", source.pump, source.wake, lambda: None, grace=10.0,
                          after_read=lambda: seen.append((reader.lock.locked(), len(source.readers))))
    os.write(source.w, b"\1")
    assert reader.read_now() is True
    os.write(source.w, b"\1")
    assert reader.for_waiter(1.0) is True
    assert seen == [(False, 1), (False, 2)]
    with reader.lock:                                  # another thread reads: no read, no call
        assert reader.read_now() is False and reader.for_waiter(0.1) is False
    assert len(seen) == 2


def test_a_crashing_background_reader_is_reported_never_silent(source, caplog):
    crashed = threading.Event()
    source.fail_with = RuntimeError("broken frame")
    reader = SharedReader("crasher", source.pump, source.wake, crashed.set, grace=0.0)
    with caplog.at_level("ERROR", logger="stratagem.transport_kit.reading"):
        reader.start()
        assert crashed.wait(10)
    reader.stop()
    assert "crasher: the background reader crashed" in caplog.text and "broken frame" in caplog.text


def test_a_nudge_ends_the_background_readers_stay_away(source):
    # After a recv() read, the background thread stays away for its grace (long, so that its wake-ups
    # cost nothing while recv() calls read); something that needs reading with no recv() waiting (a
    # new connection's handshake) nudges it, and it reads at once instead of after the grace.
    reader = SharedReader("nudged", source.pump, source.wake, lambda: None, grace=60.0)
    reader.start()
    try:
        while not reader.for_waiter(0.01):                # a recv() read: the grace starts
            pass
        time.sleep(0.2)   # a background read that began before it ends (BACKGROUND_POLL); then it stays away
        os.write(source.w, b"\1")
        time.sleep(0.3)
        assert source.readers == []                       # staying away (no recv() reads either)
        reader.nudge()
        wait_for(lambda: source.readers, timeout=5.0)     # well within the 60 s grace
        assert source.readers == ["nudged"]
    finally:
        reader.stop(timeout=5.0)
    # stop() ends even a stay-away at once (its join waits 5 s of the 60 s grace)
    assert "nudged" not in [t.name for t in threading.enumerate()]
