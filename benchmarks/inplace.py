"""In place against out of place (issue #22, 5h): ``comm.allreduce(x, out=x)``, what Horovod and DDP do with
gradients, next to ``comm.allreduce(x, out=buf)``, **call by call in turn in one job** per transport.

    python3 benchmarks/inplace.py                                  # zmq, grpc, shm, mpi; 2 processes; 64M
    python3 benchmarks/inplace.py --transports shm,mpi --np 2 4 --size 64M --iters 12

Each rank cycles through the methods below, one call each per round, every call after a barrier, timed with
``time.perf_counter()`` and max-reduced over the ranks (an iteration's time is the slowest rank's):

- ``out, kept``: out of place, ``x`` never rewritten (what ``stratagem bench collectives`` times);
- ``out, rewritten``: out of place, ``x`` rewritten before the call (outside the timed region), as a
  backward pass writes the gradient buffer before every step;
- ``in place``: ``out=x``, ``x`` rewritten before the call (it must be: the call overwrites it);
- under ``--mpi`` also plain mpi4py on the same buffers in the same job: ``Allreduce(x, buf)`` and
  ``Allreduce(MPI.IN_PLACE, x)``, ``x`` rewritten, so Open MPI's own in-place cost is beside ours.

The first result of every method is checked against the known sum, and the in-place result against the
out-of-place one bit for bit. Prints per transport the median time and busbw (``2(n-1)/n x size / time``,
GB/s) of each method and in place / out of place (rewritten): the issue asks for >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def task(size: int, iters: int, warmup: int, result_path: str) -> None:
    import stratagem

    comm = stratagem.communicator(timeout=120)
    n, rank, world = size // 4, comm.rank, comm.size
    pattern = (np.arange(n, dtype=np.int64) % 251 + 1).astype(np.float32)
    fresh = pattern * np.float32(rank + 1)
    expected = pattern * np.float32(world * (world + 1) // 2)
    x, buf = fresh.copy(), np.empty(n, np.float32)

    def out_kept():
        comm.allreduce(x, op="sum", out=buf)
        return buf

    def out_rewritten():
        comm.allreduce(x, op="sum", out=buf)
        return buf

    def in_place():
        comm.allreduce(x, op="sum", out=x)
        return x

    methods = {"out, kept": (out_kept, False), "out, rewritten": (out_rewritten, True), "in place": (in_place, True)}
    if comm.transport.name == "mpi":
        from mpi4py import MPI

        plain = MPI.COMM_WORLD

        def mpi_out():
            plain.Allreduce(x, buf, op=MPI.SUM)
            return buf

        def mpi_in():
            plain.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
            return x

        methods.update({"mpi4py out": (mpi_out, True), "mpi4py in place": (mpi_in, True)})
    times = {name: [] for name in methods}
    first: dict[str, np.ndarray] = {}
    for i in range(warmup + iters):
        for name, (call, rewrite) in methods.items():
            if rewrite or i == 0:
                x[...] = fresh
            comm.barrier()
            started = time.perf_counter()
            result = call()
            elapsed = time.perf_counter() - started
            if name not in first:
                first[name] = result.copy()
            if i >= warmup:
                times[name].append(elapsed)
    wrong = [name for name, got in first.items() if not np.array_equal(got, expected)]
    if not np.array_equal(first["in place"].view(np.uint32), first["out, rewritten"].view(np.uint32)):
        wrong.append("in place differs from out of place")
    slowest = {name: comm.allreduce(np.array(ts), op="max") for name, ts in times.items()}
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"world": world, "transport": comm.transport.name, "wrong": wrong,
                       "median": {k: float(np.median(v)) for k, v in slowest.items()},
                       "min": {k: float(np.min(v)) for k, v in slowest.items()}}, f)
    comm.close()


def run(transport: str, workers: int, size: int, iters: int, warmup: int, timeout: float) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        launch = [sys.executable, "-m", "stratagem", "launch", "--worker", str(workers), "--timeout", str(timeout)]
        launch += ["--mpi"] if transport == "mpi" else ["--transport", transport]
        command = launch + ["--", sys.executable, os.path.abspath(__file__), "--task", str(size), str(iters),
                            str(warmup), result]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)
        if done.returncode != 0 or not os.path.exists(result):
            return {"transport": transport, "world": workers, "failed": (done.stdout + done.stderr)[-2000:]}
        with open(result) as f:
            return json.load(f)


def main() -> int:
    from stratagem.bench.units import parse_size

    if len(sys.argv) > 1 and sys.argv[1] == "--task":
        task(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="zmq,grpc,shm,mpi")
    parser.add_argument("--np", type=int, nargs="+", default=[2])
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    size = parse_size(args.size)
    status = 0
    print(f"{args.size} float32 sum all-reduce, medians (busbw GB/s), load {os.getloadavg()[0]:.1f}")
    for workers in args.np:
        for transport in args.transports.split(","):
            row = run(transport, workers, size, args.iters, args.warmup, args.timeout)
            if "failed" in row:
                print(f"np={workers} {transport}: FAILED\n{row['failed']}")
                status = 1
                continue
            busbw = 2 * (workers - 1) / workers * size / 1e9
            cells = "  ".join(f"{name} {t * 1e3:.1f} ms ({busbw / t:.2f})" for name, t in row["median"].items())
            ratio = row["median"]["out, rewritten"] / row["median"]["in place"]
            wrong = f"  WRONG: {', '.join(row['wrong'])}" if row["wrong"] else ""
            print(f"np={workers} {transport:5} {cells}  in/out speed {ratio:.2f}{wrong}")
            status |= bool(row["wrong"])
    return status


if __name__ == "__main__":
    sys.exit(main())
