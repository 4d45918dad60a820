#!/usr/bin/env python3
"""A plain TCP-socket ring all-reduce (float32 sum): the reference of ``hosts_allreduce.py``.

    stratagem launch --hosts 4 --link 1gbit --worker 4 -- python3 benchmarks/plain_tcp_ring.py 64M 5

No stratagem code in the ranks: each rank listens at its own address (from ``STRATAGEM_CONFIG``),
connects to its right neighbour and accepts its left one; each of the 2(n - 1) steps of the classic ring
(reduce-scatter, then all-gather, a 1/n segment a step) sends right in a thread while it receives from
the left, so both directions of the link are busy, and adds what arrived 4 MB at a time as the rest arrives. Run alone, rank 0 prints the median time of a call.
"""
import json, os, socket, statistics, sys, threading, time

import numpy as np

PIECE = 1 << 20  # elements received (and reduced) at a time


def connect(addresses, rank, timeout=60.0):
    """(left, right): the sockets from the left neighbour and to the right one."""
    host, port = addresses[rank].rsplit(":", 1)
    server = socket.create_server((host, int(port)))
    server.settimeout(timeout)
    right_host, right_port = addresses[(rank + 1) % len(addresses)].rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            right = socket.create_connection((right_host, int(right_port)), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    left, _ = server.accept()
    server.close()
    for s in (left, right):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(timeout)
    return left, right


def receive(sock, view):
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the left neighbour closed the ring")
        view = view[got:]


def allreduce(x, left, right, rank, n):
    out = x.copy()
    bounds = [i * x.size // n for i in range(n + 1)]
    segment = lambda k: out[bounds[k % n]:bounds[k % n + 1]]  # noqa: E731
    incoming = np.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), x.dtype)
    for step in range(2 * (n - 1)):
        mine, theirs = segment(rank - step), segment(rank - step - 1)
        sender = threading.Thread(target=right.sendall, args=(memoryview(mine).cast("B"),))
        sender.start()
        for start in range(0, theirs.size, PIECE):  # reduce each piece while the next one arrives
            got, into = incoming[start:start + PIECE], theirs[start:start + PIECE]
            if step < n - 1:
                receive(left, memoryview(got[:into.size]).cast("B"))
                into += got[:into.size]  # reduce-scatter
            else:
                receive(left, memoryview(into).cast("B"))  # all-gather: straight into place
        sender.join()
    return out


if __name__ == "__main__":
    config = json.loads(os.environ["STRATAGEM_CONFIG"])
    addresses, rank = config["cluster"]["worker"], config["task"]["index"]
    n, nbytes = len(addresses), int(sys.argv[1].rstrip("M")) << 20
    left, right = connect(addresses, rank)
    x = np.full(nbytes // 4, rank + 1, np.float32)
    times = []
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
        allreduce(np.zeros(n, np.float32), left, right, rank, n)  # a barrier
        started = time.perf_counter()
        result = allreduce(x, left, right, rank, n)
        times.append(time.perf_counter() - started)
    assert result[0] == result[-1] == n * (n + 1) / 2
    if rank == 0:
        print(f"plain TCP ring {sys.argv[1]} np={n}: median {statistics.median(times):.3f} s")
