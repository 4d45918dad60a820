"""One rank of the all-reduce benchmark (started by benchmarks/allreduce.py; not run by hand).

Modes (first argument):

    stratagem SPEC OUT        one rank under ``stratagem.core.launcher.launch`` (STRATAGEM_CONFIG set)
    mpi4py SPEC OUT           one rank under ``mpiexec``
    gloo-spawn SPEC OUT N     start N ``gloo-rank`` processes (rendezvous over tcp://127.0.0.1) and reap them
    gloo-rank SPEC OUT N RANK PORT|file:PATH

SPEC is a JSON file: ``{"sizes": [{"bytes", "warmup", "repeats"}, ...], "label", "timeout",
"stratagem": {communicator options, "transport", "transport_options"}}``. Rank 0 writes OUT (JSON):
for each size, the per-iteration times (max over ranks) and whether the result was correct.

Timing, identical for every backend: before each iteration every rank enters the backend's own
barrier; each rank then times its own call with ``time.perf_counter``; after all iterations of a
size the per-iteration times are max-reduced over the ranks with the backend's own all-reduce, so
the figure for one iteration is the slowest rank's. The input is rank-dependent
(``(rank + 1) * (i % 251 + 1)``), so a correct sum is ``n(n+1)/2 * (i % 251 + 1)`` exactly in
float32; the first warm-up result and the last timed result of every size are checked element by
element, and the verdict is agreed over all ranks.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

PATTERN_PERIOD = 251  # prime, so a segment put at the wrong offset almost surely shows


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _pattern(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) % PATTERN_PERIOD + 1).astype(np.float32)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when its parent dies (Linux), so nothing is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


# -- backends: each offers rank, size, barrier(), prepare(size), allreduce() -> result,
#    as_numpy(result), max_over_ranks(float64 array) -> array, close() ------------------------------

class StratagemBackend:
    def __init__(self, spec: dict):
        import stratagem

        opts = dict(spec.get("stratagem") or {})
        transport = opts.pop("transport", "zmq")
        transport_options = opts.pop("transport_options", None) or {}
        opts.setdefault("timeout", spec.get("timeout", 120))
        if transport_options:
            self.comm = stratagem.communicator(transport=transport, transport_options=transport_options, **opts)
        else:
            self.comm = stratagem.communicator(transport=transport, **opts)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.x = None

    def describe(self) -> dict:
        t = self.comm.transport
        return {"call": "allreduce(x, op='sum', out=preallocated) (out of place)",
                "chunk_bytes": self.comm.chunk_bytes, "small_bytes": self.comm.small_bytes,
                "zero_copy_bytes": getattr(t, "zero_copy_bytes", None), "transport": t.name}

    def prepare(self, pattern: np.ndarray) -> None:
        self.x = pattern * np.float32(self.rank + 1)
        # The result goes into a buffer reused across iterations (as a training loop's fusion
        # buffer is), like mpi4py's preallocated recvbuf and gloo's in-place tensor.
        self.out = np.empty_like(self.x)

    def refill(self) -> None:  # the input is never modified: nothing to do
        pass

    def barrier(self) -> None:
        self.comm.barrier()

    def allreduce(self):
        return self.comm.allreduce(self.x, op="sum", out=self.out)

    def as_numpy(self, result) -> np.ndarray:
        return result

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        return self.comm.allreduce(a, op="max")

    def close(self, clean: bool = True) -> None:
        try:
            if clean:
                self.comm.barrier()
        finally:
            self.comm.close()


class MpiBackend:
    def __init__(self, spec: dict):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def describe(self) -> dict:
        return {"call": "Allreduce(sendbuf, recvbuf, op=MPI.SUM) (out of place, as stratagem)",
                "library": self.MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]}

    def prepare(self, pattern: np.ndarray) -> None:
        self.send = pattern * np.float32(self.rank + 1)
        self.recv = np.empty_like(self.send)

    def refill(self) -> None:
        pass

    def barrier(self) -> None:
        self.comm.Barrier()

    def allreduce(self):
        self.comm.Allreduce(self.send, self.recv, op=self.MPI.SUM)
        return self.recv

    def as_numpy(self, result) -> np.ndarray:
        return result

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        out = np.empty_like(a)
        self.comm.Allreduce(a, out, op=self.MPI.MAX)
        return out

    def close(self, clean: bool = True) -> None:
        pass


class GlooBackend:
    def __init__(self, spec: dict, size: int, rank: int, rendezvous: str):
        import datetime

        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        torch.set_num_threads(1)
        if rendezvous.startswith("file:"):
            init_method = "file://" + rendezvous[len("file:"):]
        else:
            init_method = f"tcp://127.0.0.1:{int(rendezvous)}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=float(spec.get("timeout", 120))))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.init_method = init_method.split(":")[0]

    def describe(self) -> dict:
        return {"call": "dist.all_reduce(tensor) (in place; the input is restored before each "
                        "iteration, outside the timed region)", "init": self.init_method}

    def prepare(self, pattern: np.ndarray) -> None:
        self.src = self.torch.from_numpy(pattern * np.float32(self.rank + 1))
        self.t = self.src.clone()

    def refill(self) -> None:
        self.t.copy_(self.src)

    def barrier(self) -> None:
        self.dist.barrier()

    def allreduce(self):
        self.dist.all_reduce(self.t)
        return self.t

    def as_numpy(self, result) -> np.ndarray:
        return result.numpy()

    def max_over_ranks(self, a: np.ndarray) -> np.ndarray:
        t = self.torch.from_numpy(a.copy())
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.numpy()

    def close(self, clean: bool = True) -> None:
        self.dist.destroy_process_group()


# -- the measurement loop, shared by every backend ---------------------------------------------------

def _check(backend, result, expected: np.ndarray) -> bool:
    return bool(np.array_equal(backend.as_numpy(result), expected))


def measure(backend, spec: dict, out_path: str) -> None:
    label = spec.get("label", "?")
    results = []
    for entry in spec["sizes"]:
        nbytes, warmup, repeats = int(entry["bytes"]), int(entry["warmup"]), int(entry["repeats"])
        n = nbytes // 4
        pattern = _pattern(n)
        expected = pattern * np.float32(backend.size * (backend.size + 1) // 2)
        backend.prepare(pattern)
        del pattern
        ok = True
        for i in range(warmup):
            backend.refill()
            backend.barrier()
            result = backend.allreduce()
            if i == 0:
                ok = _check(backend, result, expected)
            result = None
        times = np.empty(repeats, dtype=np.float64)
        result = None
        for i in range(repeats):
            result = None
            backend.refill()
            backend.barrier()
            t0 = time.perf_counter()
            result = backend.allreduce()
            times[i] = time.perf_counter() - t0
        if repeats:
            ok = ok and _check(backend, result, expected)
        result = None
        del expected
        slowest = backend.max_over_ranks(times)
        wrong = backend.max_over_ranks(np.array([0.0 if ok else 1.0]))
        ok = bool(wrong[0] == 0.0)
        results.append({"bytes": nbytes, "warmup": warmup, "repeats": repeats, "correct": ok,
                        "times_s": [float(t) for t in slowest]})
        if backend.rank == 0:
            med = statistics.median(slowest) if repeats else float("nan")
            _log(f"  {label} np={backend.size} {nbytes:>10} B: median {med * 1e6:10.1f} us, "
                 f"min {min(slowest) * 1e6:10.1f} us over {repeats}"
                 + ("" if ok else "   WRONG RESULT"))
    if backend.rank == 0:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"label": label, "np": backend.size, "backend_info": backend.describe(),
                       "sizes": results}, f)
        os.replace(out_path + ".tmp", out_path)


def _gloo_spawn(spec_path: str, out_path: str, n: int) -> int:
    """Start n gloo ranks, wait for them (with the job's timeout), and reap every one."""
    import socket

    with open(spec_path) as f:
        spec = json.load(f)
    if os.environ.get("BENCH_GLOO_RENDEZVOUS") == "file":
        rendezvous = "file:" + os.path.join(os.path.dirname(os.path.abspath(out_path)), "gloo-store")
    else:
        with socket.socket() as s:  # we are in a private network namespace: only loopback exists
            s.bind(("127.0.0.1", 0))
            rendezvous = str(s.getsockname()[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", WORLD_SIZE=str(n))
    procs = []
    deadline = time.monotonic() + float(spec.get("job_timeout", 600))
    try:
        for rank in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "gloo-rank", spec_path, out_path, str(n),
                 str(rank), rendezvous],
                env=dict(env, RANK=str(rank)), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        status = 0
        pending = list(procs)
        while pending:
            for p in list(pending):
                rc = p.poll()
                if rc is not None:
                    pending.remove(p)
                    if rc != 0:
                        _log(f"gloo rank {procs.index(p)} exited with {rc}; stopping the others")
                        return 1
            if time.monotonic() > deadline:
                _log("gloo job timed out; stopping the ranks")
                return 124
            time.sleep(0.05)
        return status
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: list[str]) -> int:
    mode, spec_path, out_path = argv[0], argv[1], argv[2]
    if mode == "gloo-spawn":
        return _gloo_spawn(spec_path, out_path, int(argv[3]))
    with open(spec_path) as f:
        spec = json.load(f)
    if mode == "stratagem":
        backend = StratagemBackend(spec)
    elif mode == "mpi4py":
        backend = MpiBackend(spec)
    elif mode == "gloo-rank":
        backend = GlooBackend(spec, int(argv[3]), int(argv[4]), argv[5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    clean = False
    try:
        measure(backend, spec, out_path)
        clean = True
    finally:
        backend.close(clean)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
