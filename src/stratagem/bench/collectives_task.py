"""One rank of ``stratagem bench collectives`` (started by it, one process per rank; not run by hand).

    python -m stratagem.bench.collectives_task BACKEND SPEC OUT

``BACKEND`` is how this rank talks to the others:

- ``stratagem``: ``stratagem.communicator(transport=...)``; the world comes from the environment
  (``STRATAGEM_CONFIG`` under :func:`stratagem.launch.launcher.launch`, the MPI rank variables under
  :func:`stratagem.launch.mpi.launch_mpi` for the ``mpi`` transport);
- ``gloo``: ``torch.distributed`` over gloo, rank and world size read from ``STRATAGEM_CONFIG`` (the
  ranks are started by ``launch()``), rendezvous through a file, so no socket listens beyond the
  loopback interface gloo itself binds (``GLOO_SOCKET_IFNAME=lo``);
- ``mpi4py``: ``MPI.COMM_WORLD`` under ``launch_mpi``;
- ``pyzmq``: a plain pyzmq ring (:mod:`stratagem.bench.pyzmq_ring`), all-reduce only.

``SPEC`` is a JSON file: ``{"label", "collective": "allreduce" | "broadcast" | "allgather",
"timeout", "sizes": [{"bytes", "warmup", "iters"}, ...], "stratagem": {"transport", communicator
options..., "transport_options"}, "gloo_store": PATH}``. Rank 0 rewrites ``OUT`` (JSON) after every
size, so a job stopped half-way still reports the sizes it finished, and prints one progress line
per size on stdout (:data:`PROGRESS_MARK` and a JSON object) for the parent's live display.

Timing, the same for every backend: before each iteration every rank enters the backend's own
barrier, then times its own call with ``time.perf_counter``; after a size's iterations the times are
max-reduced over the ranks with the backend's own all-reduce, so an iteration's time is the slowest
rank's (barrier exit skew included, as in a training step). The inputs depend on the rank (rank r
contributes ``(r + 1) * (i % 251 + 1)`` at element i), so every result is known exactly in float32; the
first warm-up result and the last timed one are compared element by element on every rank, and the
verdict is agreed over the ranks.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from stratagem.bench.pyzmq_ring import PyzmqBackend

#: Starts a progress line on rank 0's stdout; the rest of the line is a JSON object.
PROGRESS_MARK = "@stratagem-bench "
#: The collectives measured, with the bus-bandwidth factor of each (as nccl-tests define it):
#: busbw = algbw * factor(n), where algbw = bytes / time and bytes is the result's size on a rank.
COLLECTIVES = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "allgather": lambda n: (n - 1) / n,
}
PATTERN_PERIOD = 251  # prime, so a segment put at the wrong offset almost surely shows


def elements_per_rank(collective: str, nbytes: int, world: int) -> int:
    """float32 elements each rank contributes for a result of ``nbytes`` (all-gather: a 1/world share)."""
    count = nbytes // 4
    return count // world if collective == "allgather" else count


def _pattern(count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.int64) % PATTERN_PERIOD + 1).astype(np.float32)


def _inputs(collective: str, rank: int, world: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's input and the result every rank must get."""
    pattern = _pattern(count)
    if collective == "allreduce":
        return pattern * np.float32(rank + 1), pattern * np.float32(world * (world + 1) // 2)
    if collective == "broadcast":  # root 0 sends the pattern; the others' buffers start at zero
        return (pattern if rank == 0 else np.zeros_like(pattern)), pattern
    return pattern * np.float32(rank + 1), np.stack([pattern * np.float32(r + 1) for r in range(world)])


# -- backends: rank, size, setup(collective, x), refill(), call() -> result, as_numpy(result),
#    barrier(), max_over_ranks(float64 array), describe(), close(clean) ---------------------------------

class StratagemBackend:
    """stratagem's communicator; cupy buffers when the transport keeps them on the GPU (nccl)."""

    def __init__(self, spec: dict):
        import stratagem

        options = dict(spec.get("stratagem") or {})
        transport = options.pop("transport", "zmq")
        options.setdefault("timeout", spec.get("timeout", 120))
        if not options.get("transport_options"):
            options.pop("transport_options", None)
        self.comm = stratagem.communicator(transport=transport, **options)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.xp = np
        if getattr(self.comm.transport, "device_buffers", False):
            import cupy

            self.xp = cupy

    def describe(self) -> dict:
        t = self.comm.transport
        return {"transport": t.name, "chunk_bytes": self.comm.chunk_bytes, "small_bytes": self.comm.small_bytes,
                "zero_copy_bytes": getattr(t, "zero_copy_bytes", None), "device_buffers": self.xp is not np,
                "call": {"allreduce": "comm.allreduce(x, op='sum', out=buffer) (out of place, reused buffer)",
                         "broadcast": "comm.broadcast(x, root=0) (a new array)",
                         "allgather": "comm.allgather(x) (a new array)"}[self.collective]}

    def setup(self, collective: str, x: np.ndarray) -> None:
        self.collective = collective
        self.x = self.xp.asarray(x)
        # The all-reduce result goes into a buffer reused across iterations (as a training loop's
        # fusion buffer is), like mpi4py's preallocated recvbuf and gloo's in-place tensor.
        self.out = self.xp.empty_like(self.x)

    def refill(self) -> None:  # stratagem never modifies its input
        pass

    def call(self):
        if self.collective == "allreduce":
            result = self.comm.allreduce(self.x, op="sum", out=self.out)
        elif self.collective == "broadcast":
            result = self.comm.broadcast(self.x, root=0)
        else:
            result = self.comm.allgather(self.x)
        if self.xp is not np:  # a GPU call may return before the device is done: time the work
            self.xp.cuda.get_current_stream().synchronize()
        return result

    def as_numpy(self, result) -> np.ndarray:
        return result if self.xp is np else self.xp.asnumpy(result)

    def barrier(self) -> None:
        self.comm.barrier()

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        return np.asarray(self.as_numpy(self.comm.allreduce(self.xp.asarray(a), op="max")))

    def close(self, clean: bool = True) -> None:
        try:
            if clean:  # nobody leaves while a peer still needs it for the last max-reduce
                self.comm.barrier()
        finally:
            self.comm.close()


class MpiBackend:
    """mpi4py's buffer interface on numpy arrays (``Allreduce``, ``Bcast``, ``Allgather``)."""

    def __init__(self, spec: dict):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def describe(self) -> dict:
        return {"library": self.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
                "call": {"allreduce": "Allreduce(sendbuf, recvbuf, op=MPI.SUM) (out of place)",
                         "broadcast": "Bcast(buf, root=0) (in place)",
                         "allgather": "Allgather(sendbuf, recvbuf)"}[self.collective]}

    def setup(self, collective: str, x: np.ndarray) -> None:
        self.collective = collective
        self.send = x
        self.recv = (np.empty((self.size, *x.shape), x.dtype) if collective == "allgather"
                     else np.empty_like(x))

    def refill(self) -> None:
        pass

    def call(self):
        if self.collective == "allreduce":
            self.comm.Allreduce(self.send, self.recv, op=self.MPI.SUM)
            return self.recv
        if self.collective == "broadcast":
            self.comm.Bcast(self.send, root=0)
            return self.send
        self.comm.Allgather(self.send, self.recv)
        return self.recv

    def as_numpy(self, result) -> np.ndarray:
        return result

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=self.MPI.MAX)
        return out

    def close(self, clean: bool = True) -> None:
        pass


class GlooBackend:
    """``torch.distributed`` over gloo on CPU tensors (``all_reduce``, ``broadcast``, ``all_gather``)."""

    def __init__(self, spec: dict):
        import datetime

        import torch
        import torch.distributed as dist

        from stratagem.core.cluster import ClusterResolver

        resolved = ClusterResolver.from_env()
        replicas = resolved.cluster.replicas()
        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + spec["gloo_store"],
                                rank=replicas.index(resolved.task), world_size=len(replicas),
                                timeout=datetime.timedelta(seconds=float(spec.get("timeout", 120))))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def describe(self) -> dict:
        return {"torch": self.torch.__version__, "init": "file store",
                "call": {"allreduce": "dist.all_reduce(tensor) (in place; the input is restored before "
                                      "each iteration, outside the timed region)",
                         "broadcast": "dist.broadcast(tensor, src=0) (in place)",
                         "allgather": "dist.all_gather(list_of_tensors, tensor)"}[self.collective]}

    def setup(self, collective: str, x: np.ndarray) -> None:
        self.collective = collective
        self.src = self.torch.from_numpy(x)
        self.t = self.src.clone()
        self.parts = [self.torch.empty_like(self.t) for _ in range(self.size)]

    def refill(self) -> None:
        if self.collective == "allreduce":  # in place: the next iteration must start from the input
            self.t.copy_(self.src)

    def call(self):
        if self.collective == "allreduce":
            self.dist.all_reduce(self.t)
            return self.t
        if self.collective == "broadcast":
            self.dist.broadcast(self.t, src=0)
            return self.t
        self.dist.all_gather(self.parts, self.t)
        return self.parts

    def as_numpy(self, result) -> np.ndarray:
        return np.stack([p.numpy() for p in result]) if isinstance(result, list) else result.numpy()

    def barrier(self) -> None:
        self.dist.barrier()

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(a.copy())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def close(self, clean: bool = True) -> None:
        self.dist.destroy_process_group()


BACKENDS = {"stratagem": StratagemBackend, "mpi4py": MpiBackend, "gloo": GlooBackend, "pyzmq": PyzmqBackend}


# -- the measurement loop, the same for every backend ---------------------------------------------------

def measure(backend, spec: dict, out_path: str) -> None:
    """Run ``spec``'s sizes on ``backend``; rank 0 writes ``out_path`` after each size."""
    collective = spec.get("collective", "allreduce")
    results: list[dict] = []
    for index, entry in enumerate(spec["sizes"]):
        nbytes, warmup, iters = int(entry["bytes"]), int(entry["warmup"]), int(entry["iters"])
        count = elements_per_rank(collective, nbytes, backend.size)
        x, expected = _inputs(collective, backend.rank, backend.size, count)
        backend.setup(collective, x)
        ok = True
        for i in range(warmup):
            backend.refill()
            backend.barrier()
            result = backend.call()
            if i == 0:
                ok = bool(np.array_equal(backend.as_numpy(result), expected))
            result = None  # let a new-array backend free it before the next call allocates
        times = np.empty(iters, dtype=np.float64)
        for i in range(iters):
            result = None
            backend.refill()
            backend.barrier()
            started = time.perf_counter()
            result = backend.call()
            times[i] = time.perf_counter() - started
        if iters:
            ok = ok and bool(np.array_equal(backend.as_numpy(result), expected))
        result = x = expected = None
        slowest = backend.max_over_ranks(times)
        ok = bool(backend.max_over_ranks(np.array([0.0 if ok else 1.0]))[0] == 0.0)
        results.append({"bytes": nbytes, "data_bytes": count * 4 * (backend.size if collective == "allgather" else 1),
                        "warmup": warmup, "iters": iters, "correct": ok, "times_s": [float(t) for t in slowest]})
        if backend.rank == 0:
            _write(out_path, {"label": spec.get("label"), "np": backend.size, "collective": collective,
                              "backend_info": backend.describe(), "sizes": results})
            median = float(np.median(slowest)) if iters else None
            print(PROGRESS_MARK + json.dumps({"index": index, "bytes": nbytes, "median_s": median,
                                              "correct": ok}), flush=True)


def _write(path: str, doc: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] not in BACKENDS:
        print(f"usage: python -m stratagem.bench.collectives_task {{{','.join(BACKENDS)}}} SPEC OUT "
              f"(started by `stratagem bench collectives`)", file=sys.stderr)
        return 2
    kind, spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    backend = BACKENDS[kind](spec)
    clean = False
    try:
        measure(backend, spec, out_path)
        clean = True
    finally:
        backend.close(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main())
