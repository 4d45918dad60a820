"""The ``pyzmq`` baseline of ``stratagem bench collectives``: a plain pyzmq ring all-reduce.

What a careful user of bare pyzmq would write, with none of stratagem's machinery (no handshake, no
fingerprints, no reader thread): each rank binds a PAIR socket at its own cluster address for its left
neighbour and connects a PAIR socket to its right one; every step sends right and receives from the
left. Up to :data:`SMALL_BYTES` the whole vector goes round the ring (n - 1 steps, each adding what
arrived in place: the fewest messages and wake-ups), above it the classic ring (reduce-scatter then
all-gather, 2(n - 1) steps of 1/n of the vector, sent by reference). It is the reference of issue 14's
"4 KB all-reduce latency within 1.5x a plain pyzmq ring"; ``benchmarks/plain_pyzmq_ring.py`` is the same
ring as a stand-alone script (no stratagem import at all), to check this baseline's figures against.

All-reduce only (the bench skips it for other collectives).
"""

from __future__ import annotations

import numpy as np

#: Vectors up to this many bytes go whole round the ring; larger ones take the bandwidth-optimal ring.
SMALL_BYTES = 64 << 10


class PyzmqRing:
    """The ring between this rank and its neighbours (addresses in rank order)."""

    def __init__(self, addresses: list[str], rank: int):
        import zmq

        self.zmq, self.rank, self.size = zmq, rank, len(addresses)
        self.ctx = zmq.Context()
        self.inbound, self.outbound = self.ctx.socket(zmq.PAIR), self.ctx.socket(zmq.PAIR)
        self.inbound.bind(f"tcp://{addresses[rank]}")
        self.outbound.connect(f"tcp://{addresses[(rank + 1) % self.size]}")

    def step(self, payload, sent: list | None = None):
        """Send ``payload`` right; return what came from the left. With ``sent``, by reference: the
        tracker goes into ``sent`` and ``payload`` must not change until it is done."""
        if sent is None:  # small: copying is cheaper than tracking
            self.outbound.send(payload)
            return self.inbound.recv()
        sent.append(self.outbound.send(payload, copy=False, track=True))
        return self.inbound.recv(copy=False)

    def barrier(self) -> None:
        """n - 1 empty steps: after step k a rank knows the k ranks on its left have entered."""
        for _ in range(self.size - 1):
            self.step(b"")

    def allreduce(self, x: np.ndarray, out: np.ndarray, op: np.ufunc = np.add) -> np.ndarray:
        n, rank = self.size, self.rank
        out[...] = x
        if x.nbytes <= SMALL_BYTES:
            travelling = x
            for _ in range(n - 1):
                travelling = np.frombuffer(self.step(travelling), x.dtype)
                op(out, travelling, out=out)
            return out
        bounds = [i * x.size // n for i in range(n + 1)]

        def seg(k: int) -> slice:
            return slice(bounds[k % n], bounds[k % n + 1])

        sent: list = []
        for s in range(n - 1):  # reduce-scatter: rank r ends holding the sum of segment r + 1
            got = np.frombuffer(self.step(out[seg(rank - s)], sent), x.dtype)
            op(out[seg(rank - s - 1)], got, out=out[seg(rank - s - 1)])
        for tracker in sent:  # the all-gather overwrites what they read
            tracker.wait()
        sent.clear()
        for s in range(n - 1):
            out[seg(rank - s)] = np.frombuffer(self.step(out[seg(rank + 1 - s)], sent), x.dtype)
        for tracker in sent:
            tracker.wait()
        return out

    def close(self) -> None:
        self.inbound.close(linger=0)
        self.outbound.close(linger=1000)
        self.ctx.term()


class PyzmqBackend:
    """The bench backend (see :mod:`stratagem.bench.collectives_task`) over :class:`PyzmqRing`."""

    def __init__(self, spec: dict):
        from stratagem.core.cluster import ClusterResolver

        resolved = ClusterResolver.from_env()
        replicas = resolved.cluster.replicas()
        self.rank, self.size = replicas.index(resolved.task), len(replicas)
        self.ring = PyzmqRing([resolved.cluster.address(t) for t in replicas], self.rank)

    def describe(self) -> dict:
        import zmq

        return {"pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(),
                "call": f"a PAIR-socket ring: the whole vector round the ring up to {SMALL_BYTES} bytes, "
                        f"else reduce-scatter + all-gather (out of place, reused buffer)"}

    def setup(self, collective: str, x: np.ndarray) -> None:
        if collective != "allreduce":
            raise ValueError("the pyzmq baseline runs all-reduce only")
        self.collective, self.x, self.out = collective, x, np.empty_like(x)

    def refill(self) -> None:
        pass

    def call(self):
        return self.ring.allreduce(self.x, self.out)

    def as_numpy(self, result) -> np.ndarray:
        return result

    def barrier(self) -> None:
        self.ring.barrier()

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        return self.ring.allreduce(a, np.empty_like(a), np.maximum)

    def close(self, clean: bool = True) -> None:
        try:
            if clean:
                self.ring.barrier()
        finally:
            self.ring.close()
