#!/usr/bin/env python3
"""A plain pyzmq ring all-reduce (float32 sum), the reference for the zmq transport's small-message latency.

    stratagem launch --worker 2 -- python benchmarks/plain_pyzmq_ring.py 4K [ITERS]

No stratagem code runs in the ranks (``stratagem launch`` only starts them and hands out the addresses in
``STRATAGEM_CONFIG``): each rank binds a PAIR socket at its own address for its left neighbour and connects a
PAIR socket to its right neighbour, and every step sends to the right and receives from the left. Up to
64 KiB the whole vector goes round the ring (n - 1 steps, each adding what arrived in place: the fewest
messages), above it the classic ring (reduce-scatter then all-gather, 2(n - 1) steps of 1/n of the
vector). Small messages are copied on both ends (cheaper than tracking a zero-copy frame); large ones go
by reference (``copy=False``). Timing is the bench's: a barrier (n - 1 empty steps round the ring), then
each rank times its call; the times are max-reduced over the ranks and rank 0 prints the median and min.
It serves to check the bench's ``pyzmq`` baseline (``stratagem bench collectives --baselines pyzmq``),
which runs the same ring.
"""
import json, os, statistics, sys, time

import numpy as np
import zmq

SMALL = 64 << 10

config = json.loads(os.environ["STRATAGEM_CONFIG"])
jobs = config["cluster"]
addresses = jobs.get("chief", []) + jobs.get("worker", [])
rank = (0 if config["task"]["type"] == "chief" else len(jobs.get("chief", []))) + config["task"]["index"]
n = len(addresses)
ctx = zmq.Context()
inbound, outbound = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
inbound.bind(f"tcp://{addresses[rank]}")
outbound.connect(f"tcp://{addresses[(rank + 1) % n]}")


def step(payload, copy=True, sent=None):
    """Send ``payload`` right, return what came from the left. ``sent``: collect the tracker of a send
    by reference (its memory must not change until the tracker is done)."""
    if copy:
        outbound.send(payload)
        return inbound.recv()
    sent.append(outbound.send(payload, copy=False, track=True))
    return inbound.recv(copy=False)


def barrier():
    for _ in range(n - 1):
        step(b"")


def allreduce(x, out, op=np.add):
    if x.nbytes <= SMALL:  # the whole vector round the ring, added in place
        out[...] = x
        travelling = x
        for _ in range(n - 1):
            travelling = np.frombuffer(step(travelling), x.dtype)
            op(out, travelling, out=out)
        return out
    bounds = [i * x.size // n for i in range(n + 1)]
    seg = lambda k: slice(bounds[k % n], bounds[k % n + 1])
    out[...] = x
    sent = []
    for s in range(n - 1):  # reduce-scatter: after it, rank r holds the sum of segment r + 1
        got = step(out[seg(rank - s)], False, sent)
        op(out[seg(rank - s - 1)], np.frombuffer(got, x.dtype), out=out[seg(rank - s - 1)])
    for tracker in sent:  # the all-gather overwrites what they read
        tracker.wait()
    sent.clear()
    for s in range(n - 1):  # all-gather
        got = step(out[seg(rank + 1 - s)], False, sent)
        out[seg(rank - s)] = np.frombuffer(got, x.dtype)
    for tracker in sent:
        tracker.wait()
    return out


if __name__ == "__main__":
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = sys.argv[1] if len(sys.argv) > 1 else "4K"
    nbytes = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    pattern = (np.arange(nbytes // 4) % 251 + 1).astype(np.float32)
    x, out = pattern * np.float32(rank + 1), np.empty(nbytes // 4, np.float32)
    barrier()
    for _ in range(max(2, iters // 10)):
        allreduce(x, out)
    assert np.array_equal(out, pattern * np.float32(n * (n + 1) // 2)), "wrong result"
    times = np.empty(iters)
    for i in range(iters):
        barrier()
        started = time.perf_counter()
        allreduce(x, out)
        times[i] = time.perf_counter() - started
    slowest = allreduce(times, np.empty_like(times), np.maximum)
    if rank == 0:
        print(f"plain pyzmq ring {text} np={n}: median {statistics.median(slowest) * 1e6:.1f} us, "
              f"min {slowest.min() * 1e6:.1f} us ({iters} iterations)")
    barrier()
    inbound.close(linger=0)
    outbound.close(linger=1000)
    ctx.term()
