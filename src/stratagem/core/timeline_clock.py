"""Putting every task's timeline on the reference task's clock: an NTP-style exchange over the transport.

Each task's events are stamped with its monotonic performance counter, tied once to its wall clock
(:func:`~stratagem.core.timeline.anchor`). On one host the wall clock is shared, so those stamps
already agree; across hosts the wall clocks differ by whatever NTP left (often milliseconds), so each
task measures its offset to a reference task (the cluster's chief) when its first strategy or
communicator starts, in a background thread, over the job's own transport:

    task                                  reference (chief)
      t0 = now  ── ping {seq, t0} ──►      t1 = now (received)
                ◄── {seq, t0, t1, t2} ──   t2 = now (replied)
      t3 = now

    offset = ((t1 - t0) + (t2 - t3)) / 2        round trip = (t3 - t0) - (t2 - t1)

``offset`` is what to add to the task's stamps to read them on the reference's clock. Whatever the
delays, the true offset lies within ``round trip / 2`` of it (a message cannot arrive before it was
sent), so of :data:`SAMPLES` pings the one with the shortest round trip is kept and its half round
trip is the precision recorded in the file (``uncertainty_ns``): tens to hundreds of microseconds on
a LAN or a loopback, a fraction of a step. (The offset relates the two tasks' timeline clocks
directly, so how precisely each tied its counter to its wall clock does not enter it.) Clock drift after the exchange is not corrected (NTP keeps
it to tens of parts per million: under 4 ms an hour).

The reference answers pings in a daemon thread until every other task of the cluster has sent its
last one (or :data:`WINDOW` seconds passed); a task that gets no answer (its reference records no
timeline) records why, and the merge then relies on the wall clocks alone.
"""

from __future__ import annotations

import threading
import time

from stratagem.core.errors import StratagemError, TransportTimeout
from stratagem.core.timeline import CLOCK_TAG_PREFIX
from stratagem.core.transport import Message

PING_TAG = CLOCK_TAG_PREFIX + ".ping"
REPLY_TAG = CLOCK_TAG_PREFIX + ".reply"
#: Pings per task; the shortest round trip wins.
SAMPLES = 8
#: Seconds between pings (lets a busy reference catch up, spreads the samples).
SPACING = 0.005
#: Seconds a task waits for its first reply (the reference may still be starting), then for each one.
FIRST_REPLY_TIMEOUT = 60.0
REPLY_TIMEOUT = 5.0
#: Seconds the reference answers before it gives up on tasks that never pinged.
WINDOW = 120.0


def offset_and_round_trip(t0: int, t1: int, t2: int, t3: int) -> tuple[float, int]:
    """The NTP estimate from one exchange (see the module doc).

    >>> offset_and_round_trip(1_000, 6_100, 6_200, 1_300)   # reference 5 us ahead, 100 ns each way
    (5000.0, 200)
    """
    return ((t1 - t0) + (t2 - t3)) / 2, (t3 - t0) - (t2 - t1)


def synchronise(recorder, transport) -> threading.Thread | None:
    """Start measuring ``recorder``'s offset to the reference over ``transport`` (a daemon thread);
    on the reference itself, start answering the others. Returns the thread (``None``: nothing to do)."""
    reference = transport.cluster.chief
    others = [task for task in transport.cluster.tasks() if task != reference]
    if transport.task == reference:
        recorder.clock = {"status": "reference", "reference": str(reference), "offset_ns": 0, "uncertainty_ns": 0}
        if not others:
            return None
        target, args = _answer, (recorder, transport, set(others))
    else:
        recorder.clock = {"status": "measuring", "reference": str(reference)}
        target, args = _measure, (recorder, transport, reference)
    thread = threading.Thread(target=target, args=args, name="stratagem-timeline-clock", daemon=True)
    thread.start()
    return thread


def _answer(recorder, transport, waiting: set) -> None:
    deadline = time.monotonic() + WINDOW
    while time.monotonic() < deadline:
        waiting -= set(transport.lost_peers())   # a task that died will not ping again
        if not waiting:
            return
        try:
            ping = transport.recv(None, PING_TAG, timeout=1.0)
        except TransportTimeout:
            continue
        except (StratagemError, OSError):
            return  # the transport closed: the job is over
        received = recorder.clock_now()
        meta = ping.meta
        try:
            transport.send(ping.src, REPLY_TAG, Message({"seq": meta.get("seq"), "t0": meta.get("t0"),
                                                         "t1": received, "t2": recorder.clock_now()}))
        except (StratagemError, OSError):
            continue
        if meta.get("last"):
            waiting.discard(ping.src)


def _measure(recorder, transport, reference) -> None:
    best = None
    samples = 0
    try:
        for seq in range(SAMPLES):
            t0 = recorder.clock_now()
            transport.send(reference, PING_TAG, Message({"seq": seq, "t0": t0, "last": seq == SAMPLES - 1}))
            deadline = time.monotonic() + (FIRST_REPLY_TIMEOUT if seq == 0 else REPLY_TIMEOUT)
            while True:   # a reply to an earlier ping that timed out is skipped
                reply = transport.recv(reference, REPLY_TAG, timeout=max(0.01, deadline - time.monotonic()))
                if reply.meta.get("seq") == seq:
                    break
            t3 = recorder.clock_now()
            offset, round_trip = offset_and_round_trip(t0, int(reply.meta["t1"]), int(reply.meta["t2"]), t3)
            samples += 1
            if best is None or round_trip < best[1]:
                best = (offset, round_trip)
            time.sleep(SPACING)
    except (StratagemError, OSError, KeyError, TypeError, ValueError) as exc:
        if best is None:
            recorder.clock = {"status": "failed", "reference": str(reference),
                              "error": f"{type(exc).__name__}: {exc}"}
            return
    recorder.clock = {"status": "measured", "reference": str(reference), "offset_ns": int(round(best[0])),
                      "uncertainty_ns": max(0, best[1]) // 2, "round_trip_ns": best[1],
                      "samples": samples}
