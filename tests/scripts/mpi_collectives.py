"""The mpi transport's native collectives (and its message pieces), checked inside an MPI job.

    mpiexec -n N python tests/scripts/mpi_collectives.py

Every rank can make every rank's input (seeded by rank), so each checks its result against numpy
(the core algorithm's semantics) and that every rank holds the same bits. Prints ``CHECKS n`` and,
for each failure, a ``FAIL ...`` line; exits 1 if anything failed. It also checks that a
mismatched call raises ``CollectiveMismatchError`` on every rank and a skipped call a timeout.
Run by tests/test_mpi_transport.py.
"""

from __future__ import annotations

import sys
import traceback

import ml_dtypes
import numpy as np

import stratagem
from stratagem.collectives.communicator import Communicator
from stratagem.core.errors import CollectiveMismatchError, TransportTimeout
from stratagem.core.wire import DTYPES

failures: list[str] = []
checks = 0


def check(ok: bool, what: str) -> None:
    global checks
    checks += 1
    if not ok:
        failures.append(what)
        print(f"FAIL rank {comm.rank}: {what}", flush=True)


def inputs(dtype, shape, rank: int, special: bool = False) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = max(info.min, -5), min(info.max, 6)
        return rng.integers(low, high, size=shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    values = rng.standard_normal(shape)
    if special and values.size >= 4:
        flat = values.reshape(-1)
        flat[0] = 0.0 if rank % 2 else -0.0      # signed zeros
        flat[1] = -0.0
        flat[2] = np.inf if rank == 0 else -np.inf
    return values.astype(dtype)


def reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    dtype = arrays[0].dtype
    if op == "mean" and dtype.kind in "iub":
        arrays = [a.astype(np.float64) for a in arrays]
    ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = ufunc(out, a)
    if op == "mean":
        out = out / out.dtype.type(len(arrays))
    return out


def close_enough(got: np.ndarray, want: np.ndarray, op: str) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype.kind in "iub":
        return bool(np.array_equal(got, want))
    tolerance = 0.05 if got.dtype.itemsize <= 2 else 1e-4
    return bool(np.allclose(got.astype(np.complex128 if got.dtype.kind == "c" else np.float64),
                            want.astype(np.complex128 if want.dtype.kind == "c" else np.float64),
                            rtol=tolerance, atol=tolerance, equal_nan=True))


def same_bits_everywhere(result: np.ndarray, what: str) -> None:
    raw = np.ascontiguousarray(result).reshape(-1).view(np.uint8)
    gathered = comm.allgather(raw)
    check(all(np.array_equal(gathered[0], row) for row in gathered), f"{what}: ranks hold different bits")


def test_allreduce() -> None:
    size = comm.size
    for name, dtype in DTYPES.items():
        for op in ("sum", "mean", "prod", "min", "max"):
            if dtype == np.bool_ and op in ("sum", "prod"):
                continue
            if np.dtype(dtype).kind == "c" and op in ("min", "max"):
                continue  # numpy's complex order: covered by core
            for shape in [(7, 5), (0,), (), (size - 1,)]:
                mine = inputs(dtype, shape, comm.rank, special=op in ("min", "max"))
                want = reference(op, [inputs(dtype, shape, r, special=op in ("min", "max")) for r in range(size)])
                got = comm.allreduce(mine, op=op)
                what = f"allreduce({op}, {name}, {shape})"
                check(close_enough(got, want, op), f"{what}: got {got!r}, want {want!r}")
                same_bits_everywhere(got, what)
    # float min/max: signed zeros order (-0 < +0) and NaN propagates as numpy does
    x = np.array([0.0, -0.0, 1.0, np.nan if comm.rank == size - 1 else 2.0], np.float32)
    got = comm.allreduce(x, op="max")
    check(np.isnan(got[3]) and got[2] == 1.0, f"allreduce(max) with a NaN on one rank: {got}")
    same_bits_everywhere(got, "allreduce(max) with NaN")
    zeros = np.array([0.0 if comm.rank == 0 else -0.0], np.float64)
    lo, hi = comm.allreduce(zeros, op="min"), comm.allreduce(zeros, op="max")
    if size > 1:
        check(np.signbit(lo[0]) and not np.signbit(hi[0]), f"min/max of +0 and -0: {lo}, {hi}")
    same_bits_everywhere(lo, "min of signed zeros")
    # out= and out=x
    x = inputs(np.float32, (1000,), comm.rank)
    want = reference("sum", [inputs(np.float32, (1000,), r) for r in range(size)])
    out = np.empty_like(x)
    check(comm.allreduce(x, out=out) is out and close_enough(out, want, "sum"), "allreduce(out=buffer)")
    before = x.copy()
    comm.allreduce(x, op="sum")
    check(np.array_equal(x, before), "allreduce modified its input")
    check(comm.allreduce(x, out=x) is x and close_enough(x, want, "sum"), "allreduce(out=x) in place")
    noisy = np.random.default_rng(comm.rank).standard_normal(5000).astype(np.float32)  # order-dependent sums
    by_out = comm.allreduce(noisy, out=np.empty_like(noisy))
    check(comm.allreduce(noisy, out=noisy).tobytes() == by_out.tobytes(),
          "allreduce(out=x) gives other bits than allreduce(out=buffer)")
    big = np.full((3 << 20) + 1, comm.rank + 1, np.float32)  # 12 MB, an odd length
    got = comm.allreduce(big, op="sum")
    check(bool((got == size * (size + 1) / 2).all()), "allreduce of 12 MB")


def test_reduce_scatter() -> None:
    size = comm.size
    for length in (0, 1, size - 1, size, 5 * size + 3):
        for name, op in (("int64", "sum"), ("float32", "mean"), ("bfloat16", "max"), ("float16", "sum")):
            dtype = DTYPES[name]
            mine = inputs(dtype, (length,), comm.rank)
            want = np.array_split(reference(op, [inputs(dtype, (length,), r) for r in range(size)]), size)[comm.rank]
            got = comm.reduce_scatter(mine, op=op)
            check(close_enough(got, want, op), f"reduce_scatter({op}, {name}, L={length}): {got} vs {want}")


def test_allgather_broadcast_barrier() -> None:
    size = comm.size
    for dtype in (np.int8, np.float64, ml_dtypes.bfloat16, np.complex128, np.bool_):
        for shape in [(3, 2), (0,), ()]:
            got = comm.allgather(inputs(dtype, shape, comm.rank))
            want = np.stack([inputs(dtype, shape, r) for r in range(size)])
            check(got.dtype == want.dtype and np.array_equal(got, want), f"allgather({np.dtype(dtype)}, {shape})")
    for root in range(size):
        for dtype in (np.float32, ml_dtypes.bfloat16):
            value = inputs(dtype, (4, 3), root)
            got = comm.broadcast(value if comm.rank == root else None, root=root)
            check(got.dtype == value.dtype and np.array_equal(got, value), f"broadcast(root={root}, None)")
            mine = np.zeros((4, 3), dtype)
            got = comm.broadcast(value if comm.rank == root else mine, root=root)
            check(np.array_equal(got, value) and (comm.rank == root or not mine.any()), "broadcast into an array")
    comm.barrier()
    empty = comm.broadcast(np.zeros((0, 2), np.int32) if comm.rank == 0 else None)
    check(empty.shape == (0, 2), "broadcast of an empty array")


def test_failures() -> None:
    # Different collectives at the same step: every rank raises, naming both calls.
    bad = Communicator(comm.transport, name="mismatch", timeout=30)
    try:
        if bad.rank == 0:
            bad.allreduce(np.zeros(3, np.float32))
        else:
            bad.broadcast(None, root=0)
        check(False, "a mismatched collective did not raise")
    except CollectiveMismatchError as exc:
        text = str(exc)
        check("allreduce" in text and "broadcast" in text and "rank 0" in text, f"mismatch message: {text}")
    # A shape mismatch, likewise.
    shapes = Communicator(comm.transport, name="shapes", timeout=30)
    try:
        shapes.allreduce(np.zeros(3 + (shapes.rank == shapes.size - 1), np.float32))
        check(False, "a shape mismatch did not raise")
    except CollectiveMismatchError as exc:
        check("(3,)" in str(exc) and "(4,)" in str(exc), f"shape mismatch message: {exc}")
    # A rank that skips a collective: the others time out instead of hanging.
    late = Communicator(comm.transport, name="late", timeout=0.5)   # rank 0 never comes: any timeout is waited out whole
    late.barrier()
    if late.rank != 0:
        try:
            late.allreduce(np.ones(4))
            check(False, "a collective that rank 0 skipped did not time out")
        except TransportTimeout as exc:
            check("allreduce" in str(exc), f"timeout message: {exc}")
    comm.barrier()  # everyone again, on the healthy communicator


def test_message_pieces() -> None:
    """Buffers bigger than an MPI message are sent in pieces (1 GiB; made tiny here to test it)."""
    from stratagem.core.transport import Message
    from stratagem.transports.mpi import progress as mpi

    saved, mpi.MAX_PIECE_BYTES = mpi.MAX_PIECE_BYTES, 4097
    try:
        t = comm.transport
        right, left = comm.members[(comm.rank + 1) % comm.size], comm.members[(comm.rank - 1) % comm.size]
        buffers = [np.arange(100_000, dtype=np.float32) * comm.rank, np.zeros((0, 3)), np.array(5, np.int16),
                   np.arange(3001).astype(ml_dtypes.bfloat16), np.ones(4097, np.uint8)]
        t.send(right, "pieces", Message({"from": comm.rank}, buffers))
        got = t.recv(left, "pieces", timeout=60)
        want = [np.arange(100_000, dtype=np.float32) * ((comm.rank - 1) % comm.size), *buffers[1:]]
        check(got.meta == {"from": (comm.rank - 1) % comm.size} and len(got.buffers) == len(want)
              and all(g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
                      for g, w in zip(got.buffers, want)), "a message sent in pieces")
    finally:
        mpi.MAX_PIECE_BYTES = saved
    comm.barrier()


def test_accepted_and_declined_calls() -> None:
    """With MPI's count limit made tiny: a broadcast beyond it moves in pieces, a reduction or
    all-gather beyond it is declined (core runs it), NaN propagates through min and max natively,
    and every call, accepted or declined, is numbered once (a mismatch names the same number)."""
    from stratagem.transports.mpi import collectives as natives

    size = comm.size
    saved, natives.MAX_COUNT = natives.MAX_COUNT, 1000
    counted = Communicator(comm.transport, name="counted", timeout=30)
    try:
        value = inputs(np.float32, (2500,), 0)
        got = counted.broadcast(value if counted.rank == 0 else None)
        check(np.array_equal(got, value), "a broadcast in pieces of MAX_COUNT elements")
        mine = inputs(np.float64, (1500,), counted.rank)
        got = counted.allreduce(mine)            # declined: core's ring
        want = reference("sum", [inputs(np.float64, (1500,), r) for r in range(size)])
        check(close_enough(got, want, "sum"), "a declined all-reduce (beyond MAX_COUNT)")
        got = counted.allgather(np.full(600, counted.rank, np.int16))  # declined when 600 * size > 1000
        check(np.array_equal(got, np.stack([np.full(600, r, np.int16) for r in range(size)])), "a declined allgather")
        x = np.array([1.0, np.nan if counted.rank == 0 else 2.0, -np.nan if counted.rank == size - 1 else 0.5],
                     np.float32)
        for op in ("min", "max"):
            got = counted.allreduce(x, op=op)
            want = reference(op, [np.array([1.0, np.nan if r == 0 else 2.0, -np.nan if r == size - 1 else 0.5],
                                           np.float32) for r in range(size)])
            check(np.array_equal(np.isnan(got), np.isnan(want)) and close_enough(got, want, op),
                  f"allreduce({op}) with NaNs on two ranks: {got} vs {want}")
            same_bits_everywhere(got, f"allreduce({op}) with NaNs")
        def holes(rank):
            return np.where(np.arange(2 * size) == rank, np.nan, 1.0)
        got = counted.reduce_scatter(holes(counted.rank), op="min")
        want = np.array_split(reference("min", [holes(r) for r in range(size)]), size)[counted.rank]
        check(np.array_equal(got, want, equal_nan=True), f"reduce_scatter(min) with NaNs: {got} vs {want}")
        try:   # the 7th call: rank 0 all-reduces, the others all-gather
            if counted.rank == 0:
                counted.allreduce(np.zeros(3, np.int8))
            else:
                counted.allgather(np.zeros(3, np.int8))
            check(False, "a mismatched 7th call did not raise")
        except CollectiveMismatchError as exc:
            check("#7" in str(exc), f"the mismatch does not name call #7: {exc}")
    finally:
        natives.MAX_COUNT = saved
    comm.barrier()


def main() -> int:
    global comm
    comm = stratagem.communicator("mpi", timeout=60)
    print(f"MODE rank {comm.rank}: blocking_collectives={comm.transport.blocking_collectives}", flush=True)
    for test in (test_allreduce, test_reduce_scatter, test_allgather_broadcast_barrier, test_message_pieces,
                 test_accepted_and_declined_calls, test_failures):
        try:
            test()
        except Exception:  # a crash is a failure too; keep the other ranks' checks going
            failures.append(f"{test.__name__} raised")
            print(f"FAIL rank {comm.rank}: {test.__name__} raised\n{traceback.format_exc()}", flush=True)
            raise
    print(f"CHECKS rank {comm.rank}: {checks} checks, {len(failures)} failed", flush=True)
    comm.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
