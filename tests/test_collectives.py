"""Collectives over real transports: N ranks as N threads of one process.

The numerics matrix runs over the ``local`` transport only (the algorithms do not depend on the
transport); the behaviour tests (mismatch detection, lost peers, barrier, broadcast...) run over every
transport in ``TRANSPORTS`` whose module is importable.
"""

from __future__ import annotations

import doctest
import importlib
import sys
import threading
import time
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stratagem.collectives import algorithms as coll
from stratagem.collectives import session as cs
from stratagem.collectives import communicator as communicator_module
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.collectives.communicator import Communicator, open_communicator
from stratagem.testing.world import local_world
from stratagem.core.errors import (
    CollectiveMismatchError,
    CommunicationError,
    ConfigurationError,
    PeerLostError,
    TransportClosed,
)
from stratagem.core.transport import NativeCollective, Transport
from stratagem.testing.world import local_cluster
from stratagem.transports.local import LocalFabric, LocalTransport

#: Seconds any single receive may wait; tests that expect an error assert it came well before this.
RECV_TIMEOUT = 10.0
#: Seconds a whole multi-rank call may take before the test declares a hang.
RUN_TIMEOUT = 30.0
TRANSPORTS = ["local", "zmq", "shm"]
#: Extra constructor options per transport. zmq: close() lingers up to ``linger`` seconds on a
#: GOODBYE queued to a peer that has closed already, which would add seconds per test.
TRANSPORT_OPTIONS = {"zmq": {"linger": 0.5}}
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
OPS = ["sum", "mean", "min", "max", "prod"]


# -- running ranks as threads ------------------------------------------------------------------------

def run_ranks(comms, fn, *, timeout=RUN_TIMEOUT, return_exceptions=False):
    """Run ``fn(comm)`` for every rank in its own thread; return the results in rank order.

    Re-raises the first rank's error, or with ``return_exceptions`` returns ``(results, errors)``.
    A rank still running after ``timeout`` fails the test (a hang is a bug, never a pass).
    """
    results = [None] * len(comms)
    errors: list[BaseException | None] = [None] * len(comms)

    def body(index):
        try:
            results[index] = fn(comms[index])
        except BaseException as exc:  # handed to the test thread
            errors[index] = exc

    threads = [threading.Thread(target=body, args=(i,), name=f"rank-{i}", daemon=True) for i in range(len(comms))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    if hung:
        pytest.fail(f"ranks {hung} still running after {timeout} s (deadlock?)")
    if return_exceptions:
        return results, errors
    for error in errors:
        if error is not None:
            raise error
    return results


# -- worlds ------------------------------------------------------------------------------------------

def _transport_class(name: str) -> type[Transport]:
    if name == "local":
        return LocalTransport
    try:
        from stratagem.plugins.manager import plugin_manager

        cls = plugin_manager().transport_class(name)
        cls.check_usable()
    except Exception as exc:  # not written yet, or its library is missing here
        pytest.skip(f"transport {name!r} is not usable here: {type(exc).__name__}: {exc}")
    return cls


def _close_all(comms) -> None:
    """Close every rank at once, as separate processes would: a socket transport closed one by one may
    wait on a peer that is already gone."""
    threads = [threading.Thread(target=comm.close, daemon=True) for comm in comms]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RUN_TIMEOUT)


def _build_world(cls: type[Transport], size: int, transport_options: dict | None = None,
                 **options) -> list[Communicator]:
    if cls.in_process:
        cluster = ClusterSpec({"worker": [f"local:{i + 1}" for i in range(size)]})
    else:
        cluster = local_cluster(size)
    shared = {**cls.world_options(), **TRANSPORT_OPTIONS.get(cls.name, {}), **(transport_options or {})}
    transports = [cls(cluster, TaskId("worker", i), timeout=RECV_TIMEOUT, peer_timeout=5.0, **shared)
                  for i in range(size)]
    for transport in transports:
        transport.start()
    options.setdefault("timeout", RECV_TIMEOUT)
    return [Communicator(t, owns_transport=True, **options) for t in transports]


@pytest.fixture(params=TRANSPORTS)
def make_world(request):
    """``make_world(size, **communicator_options)`` over each transport; closed after the test."""
    cls = _transport_class(request.param)
    made: list[Communicator] = []

    def factory(size, **options):
        comms = _build_world(cls, size, **options)
        made.extend(comms)
        return comms

    yield factory
    _close_all(made)


@pytest.fixture
def make_local_world():
    """Like ``make_world`` but over the in-process transport only (for the numerics matrix)."""
    made: list[Communicator] = []

    def factory(size, **options):
        comms = _build_world(LocalTransport, size, **options)
        made.extend(comms)
        return comms

    yield factory
    _close_all(made)


# -- data and references -----------------------------------------------------------------------------

def make_inputs(size, shape, dtype, op, seed=0):
    """One input per rank, with values whose reductions are exact where that is possible."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    inputs = []
    for _ in range(size):
        if dtype == np.bool_:
            values = rng.random(count) < 0.5
        elif op == "prod":
            choices = [1, 2, 3] if dtype.kind == "u" else ([-1, 1, 2] if dtype.kind == "i" else [-1.0, 1.0, 2.0, 0.5])
            values = rng.choice(choices, count)
        elif dtype.kind == "u":
            values = rng.integers(0, 9, count)
        elif dtype.kind == "c":
            values = rng.integers(-4, 5, count) + 1j * rng.integers(-4, 5, count)
        else:
            values = rng.integers(-4, 5, count)
        inputs.append(np.asarray(values).astype(dtype).reshape(shape))
    return inputs


def reference(inputs, op):
    """numpy's reduction over the stacked inputs, computed wide, in the dtype the collective returns."""
    stacked = np.stack(inputs)
    dtype = stacked.dtype
    if op == "mean":
        wide = stacked.astype(np.complex128 if dtype.kind == "c" else np.float64)
        return wide.mean(axis=0).astype(coll.working_dtype("mean", dtype))
    if dtype.kind in "iu":
        wide = stacked.astype(np.int64)  # integer wrap-around is the same modulo 2**bits
    elif dtype.kind == "c":
        wide = stacked.astype(np.complex128)
    elif dtype.kind == "b":
        wide = stacked
    else:
        wide = stacked.astype(np.float64)
    reducer = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op]
    return reducer(wide, axis=0).astype(dtype)


def assert_matches(result, expected):
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype
    if expected.dtype.kind in "fc" or expected.dtype == BFLOAT16:
        eps = float(ml_dtypes.finfo(expected.dtype).eps if expected.dtype == BFLOAT16 else np.finfo(expected.dtype).eps)
        rtol = 8 * eps  # a few roundings: the reduction order differs from numpy's
        np.testing.assert_allclose(result.astype(np.complex128 if expected.dtype.kind == "c" else np.float64),
                                   expected.astype(np.complex128 if expected.dtype.kind == "c" else np.float64),
                                   rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(result, expected)


def assert_identical(results):
    first = results[0]
    for rank, result in enumerate(results):
        assert result.dtype == first.dtype and result.shape == first.shape
        assert result.tobytes() == first.tobytes(), f"rank {rank}'s result differs from rank 0's in its bits"


# -- all-reduce numerics ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise"])
@pytest.mark.parametrize("size", range(1, 9))
def test_allreduce_matches_numpy(make_local_world, size, algorithm, op):
    # Small chunks so the 100_003-element case really pipelines several chunks per ring segment.
    comms = make_local_world(size, chunk_bytes=64 << 10)
    for length in (0, 1, 7, 1000, 100_003):
        inputs = make_inputs(size, (length,), np.float32, op, seed=length)
        results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op=op, algorithm=algorithm))
        expected = reference(inputs, op)
        assert_identical(results)
        assert_matches(results[0], expected)


DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint32", "complex64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [3, 4])
def test_allreduce_dtypes(make_local_world, size, dtype):
    dtype = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    comms = make_local_world(size, chunk_bytes=256)
    for op in OPS:
        if dtype.kind == "c" and op in ("min", "max"):
            continue  # complex ordering is numpy's lexicographic one; not a training use case
        for algorithm in ("ring", "recursive_doubling", "direct", "pairwise"):
            inputs = make_inputs(size, (5, 41), dtype, op, seed=size)
            results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op=op, algorithm=algorithm))
            assert_identical(results)
            assert_matches(results[0], reference(inputs, op))


def test_allreduce_bool(make_local_world):
    comms = make_local_world(3)
    inputs = make_inputs(3, (9,), np.bool_, "max")
    for op in ("min", "max", "mean"):
        results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op=op))
        assert_matches(results[0], reference(inputs, op))
    assert results[0].dtype == np.float64  # mean of bools is a fraction, as np.mean gives
    for op in ("sum", "prod"):  # numpy would count into int64: the caller must say what they mean
        with pytest.raises(ConfigurationError, match="ambiguous.*op='max'"):
            comms[0].allreduce(inputs[0], op=op)


def test_mean_of_integers_is_float64(make_local_world):
    comms = make_local_world(4)
    inputs = [np.full(6, rank, np.int32) for rank in range(4)]
    results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op="mean"))
    assert results[0].dtype == np.float64
    np.testing.assert_array_equal(results[0], np.full(6, 1.5))


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise", "auto"])
def test_zero_d_inputs(make_local_world, algorithm):
    comms = make_local_world(3)
    results = run_ranks(comms, lambda c: c.allreduce(np.float32(c.rank + 1), algorithm=algorithm))
    assert all(r.shape == () and r.dtype == np.float32 and r == 6 for r in results)
    gathered = run_ranks(comms, lambda c: c.allgather(np.array(c.rank * 1.5)))
    np.testing.assert_array_equal(gathered[2], [0.0, 1.5, 3.0])
    shared = run_ranks(comms, lambda c: c.broadcast(np.array(7, np.int16) if c.rank == 2 else None, root=2))
    assert all(s.shape == () and s.dtype == np.int16 and s == 7 for s in shared)
    segments = run_ranks(comms, lambda c: c.reduce_scatter(np.int64(c.rank)))
    assert [s.tolist() for s in segments] == [[3], [], []]


@pytest.mark.parametrize("size", [3, 5, 6, 7, 8])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise"])
def test_results_are_bitwise_identical_across_ranks(make_local_world, size, algorithm):
    # Random normals make float addition order-sensitive, so only a canonical order gives equal bits.
    comms = make_local_world(size, chunk_bytes=4096)
    rng = np.random.default_rng(size)
    for dtype in (np.float32, np.float16, BFLOAT16):
        for op, scale, offset in (("sum", 100.0, 0.0), ("mean", 100.0, 0.0), ("prod", 0.1, 1.0)):
            inputs = [(rng.standard_normal(10_007) * scale + offset).astype(dtype) for _ in range(size)]
            assert_identical(run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op=op, algorithm=algorithm)))


def test_inputs_are_never_modified(make_local_world):
    comms = make_local_world(4, chunk_bytes=512)
    inputs = [np.arange(1000, dtype=np.float64) * (rank + 1) for rank in range(4)]
    originals = [x.copy() for x in inputs]
    for x in inputs:
        x.setflags(write=False)  # any write would raise

    def everything(c):
        x = inputs[c.rank]
        outs = [c.allreduce(x, algorithm="ring"), c.allreduce(x, algorithm="recursive_doubling"),
                c.allreduce(x, op="mean"), c.reduce_scatter(x), c.allgather(x), c.broadcast(x, root=1)]
        return [not np.shares_memory(out, x) for out in outs]

    assert all(all(flags) for flags in run_ranks(comms, everything))
    for x, original in zip(inputs, originals):
        np.testing.assert_array_equal(x, original)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise"])
def test_allreduce_into_out_and_in_place(make_world, algorithm):
    comms = make_world(3, chunk_bytes=256)
    inputs = [np.arange(1001, dtype=np.float32) * (rank + 1) for rank in range(3)]
    expected = inputs[0] * 6

    def into_out(c):
        out = np.full(1001, -1, np.float32)
        returned = c.allreduce(inputs[c.rank], algorithm=algorithm, out=out)
        in_place = inputs[c.rank].copy()
        again = c.allreduce(in_place, algorithm=algorithm, out=in_place)
        return returned is out, out, again is in_place, in_place

    for is_out, out, is_in_place, in_place in run_ranks(comms, into_out):
        assert is_out and is_in_place
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(in_place, expected)


@pytest.mark.parametrize("transport", ["local", "zmq", "grpc", "shm"])
def test_in_place_gives_the_bits_of_out_of_place(transport):
    """``allreduce(x, out=x)`` (what Horovod and DDP do with gradients) gives, on every rank, the very
    bits of ``allreduce(x, out=buf)``: floats whose sum depends on the order of the additions, 3 ranks,
    small and 1.2 MB tensors, every algorithm (shm: its native arenas take the 1.2 MB ones)."""
    cls = _transport_class(transport)
    comms = _build_world(cls, 3, transport_options={"native_allreduce_bytes": 1 << 20} if transport == "shm" else None,
                         chunk_bytes=64 << 10)   # several chunks per segment
    try:
        algorithms = ["auto"] if transport == "shm" else ["auto", "ring", "recursive_doubling"]
        cases = [(n, algorithm) for n in (1001, 300_001) for algorithm in algorithms]
        rng = np.random.default_rng(5)
        inputs = {(n, rank): rng.standard_normal(n).astype(np.float32) for n in (1001, 300_001) for rank in range(3)}

        def both(c):
            pairs = []
            for n, algorithm in cases:
                out = c.allreduce(inputs[(n, c.rank)], algorithm=algorithm, out=np.empty(n, np.float32))
                x = inputs[(n, c.rank)].copy()
                assert c.allreduce(x, algorithm=algorithm, out=x) is x
                pairs.append((out.tobytes(), x.tobytes()))
            return pairs

        results = run_ranks(comms, both)
        for i, (n, algorithm) in enumerate(cases):
            assert len({pair[0] for pair in (r[i] for r in results)}) == 1, (n, algorithm)   # every rank alike
            for rank in range(3):
                assert results[rank][i][1] == results[rank][i][0], (transport, n, algorithm, rank)
        if transport == "shm":   # the native path ran: it books its traffic under no peer
            assert all(c.transport.traffic.snapshot().sent_bytes() > c.transport.traffic.snapshot().sent_bytes(
                native=False) for c in comms)
    finally:
        _close_all(comms)


def test_a_bad_out_is_refused_before_anything_is_sent(make_local_world):
    (comm,) = make_local_world(1)
    x = np.ones(10, np.float32)
    bad = {
        "float32(11,)": np.empty(11, np.float32),
        "float64": np.empty(10, np.float64),
        "contiguous": np.empty(20, np.float32)[::2],
    }
    with pytest.raises(ConfigurationError, match="float32\\(11,\\)"):
        comm.allreduce(x, out=bad["float32(11,)"])
    with pytest.raises(ConfigurationError, match="float64"):
        comm.allreduce(x, out=bad["float64"])
    with pytest.raises(ConfigurationError, match="contiguous"):
        comm.allreduce(x, out=bad["contiguous"])
    base = np.ones(20, np.float32)
    with pytest.raises(ConfigurationError, match="overlaps"):
        comm.allreduce(base[:10], out=base[5:15])
    with pytest.raises(ConfigurationError, match="float64"):
        comm.allreduce(np.arange(10), op="mean", out=np.empty(10, np.int64))  # mean of ints is float64
    np.testing.assert_array_equal(comm.allreduce(x, out=np.empty(10, np.float32)), x)  # still usable


def test_non_contiguous_and_multidimensional_inputs(make_local_world):
    comms = make_local_world(3, chunk_bytes=128)
    inputs = [np.asfortranarray(np.arange(60, dtype=np.float32).reshape(3, 4, 5) + rank)[:, ::2] for rank in range(3)]
    results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], algorithm="ring"))
    assert results[0].shape == (3, 2, 5)
    assert_matches(results[0], reference(inputs, "sum"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 8), length=st.integers(0, 300), op=st.sampled_from(OPS),
       algorithm=st.sampled_from(["ring", "recursive_doubling", "direct", "pairwise", "auto"]),
       dtype=st.sampled_from([np.float64, np.int32]), chunk_bytes=st.sampled_from([8, 64, 1 << 20]))
def test_allreduce_property(make_local_world, size, length, op, algorithm, dtype, chunk_bytes):
    comms = make_local_world(size, chunk_bytes=chunk_bytes, small_bytes=256)
    inputs = make_inputs(size, (length,), dtype, op, seed=length)
    results = run_ranks(comms, lambda c: c.allreduce(inputs[c.rank], op=op, algorithm=algorithm))
    assert_identical(results)
    assert_matches(results[0], reference(inputs, op))
    for comm in comms:
        comm.close()


# -- other collectives ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 6])
@pytest.mark.parametrize("algorithm", ["binomial_tree", "scatter_allgather", "auto"])
def test_broadcast_from_every_root(make_world, size, algorithm):
    comms = make_world(size, chunk_bytes=1024, small_bytes=2048)
    for root in range(size):
        for length in (0, 5, 3001):
            data = np.random.default_rng(root).standard_normal(length).astype(np.float32)

            def share(c, template):
                if c.rank == root:
                    return c.broadcast(data, root=root, algorithm=algorithm)
                return c.broadcast(np.zeros_like(data) if template else None, root=root)

            for template in (True, False):
                results = run_ranks(comms, lambda c: share(c, template))
                for result in results:
                    assert result.dtype == np.float32 and result.shape == (length,)
                    np.testing.assert_array_equal(result, data)


def test_broadcast_checks_the_receivers_template(make_world):
    comms = make_world(2)
    _, errors = run_ranks(comms, lambda c: c.broadcast(np.zeros(4 if c.rank == 0 else 5, np.float32)),
                          return_exceptions=True)
    assert isinstance(errors[1], CollectiveMismatchError)
    assert "rank 0" in str(errors[1]) and "(4,)" in str(errors[1]) and "(5,)" in str(errors[1])


@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_allgather(make_world, size):
    comms = make_world(size, chunk_bytes=64)
    for shape, dtype in (((0,), np.float32), ((3,), np.int64), ((2, 3), BFLOAT16), ((), np.uint8)):
        inputs = [np.full(shape, rank + 1).astype(dtype) for rank in range(size)]
        results = run_ranks(comms, lambda c: c.allgather(inputs[c.rank]))
        assert_identical(results)
        assert results[0].shape == (size, *shape) and results[0].dtype == dtype
        np.testing.assert_array_equal(results[0], np.stack(inputs))


@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_reduce_scatter_segments(make_world, size):
    comms = make_world(size, chunk_bytes=32)
    for length in (0, 1, 5, 13, 1000):
        inputs = make_inputs(size, (length,), np.int32, "sum", seed=length)
        for op in ("sum", "mean", "max"):
            results = run_ranks(comms, lambda c: c.reduce_scatter(inputs[c.rank], op=op))
            expected = np.array_split(reference(inputs, op).reshape(-1), size)
            for rank in range(size):
                assert_matches(results[rank], expected[rank])


def test_barrier_synchronises(make_world):
    comms = make_world(3)
    delay = 0.4

    def late_or_not(c):
        start = time.monotonic()
        if c.rank == 1:
            time.sleep(delay)
        c.barrier()
        return time.monotonic() - start

    elapsed = run_ranks(comms, late_or_not)
    assert all(e >= delay * 0.9 for e in elapsed), f"a rank left the barrier before rank 1 arrived: {elapsed}"


def test_single_rank_world_is_local_and_counts_calls(make_world):
    (comm,) = make_world(1)
    assert (comm.rank, comm.size) == (0, 1)
    np.testing.assert_array_equal(comm.allreduce(np.arange(3), op="mean"), [0.0, 1.0, 2.0])
    comm.barrier()
    assert comm._session.seq == 2


# -- mismatch detection ---------------------------------------------------------------------------------

def _all_mismatched(comms, fn):
    _, errors = run_ranks(comms, fn, return_exceptions=True)
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveMismatchError), f"rank {rank} raised {error!r}, not a mismatch"
    return errors


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise"])
def test_mismatched_shapes_raise_on_every_rank(make_world, algorithm):
    comms = make_world(3)
    start = time.monotonic()
    errors = _all_mismatched(comms, lambda c: c.allreduce(np.zeros(11 if c.rank == 2 else 10, np.float32),
                                                          algorithm=algorithm))
    assert time.monotonic() - start < RECV_TIMEOUT / 2  # detected, not timed out
    text = " | ".join(map(str, errors))
    assert "allreduce(sum, float32, (11,)) as collective #1" in text
    assert "allreduce(sum, float32, (10,)) as collective #1" in text
    assert "rank 2 (/job:worker/task:2)" in text


def test_mismatched_op_names_both_ranks(make_world):
    comms = make_world(2)
    errors = _all_mismatched(comms, lambda c: c.allreduce(np.ones(4), op="sum" if c.rank == 0 else "max"))
    # Both ranks detect it here (each receives from the other); each message names both calls.
    for error in errors:
        assert "rank 1 (/job:worker/task:1) called allreduce(max, float64, (4,))" in str(error)
        assert "rank 0 (/job:worker/task:0) called allreduce(sum, float64, (4,))" in str(error)


def test_a_rank_that_skips_a_call_is_a_mismatch(make_world):
    comms = make_world(3)

    def skipper(c):
        if c.rank != 2:
            c.barrier()  # rank 2 skips this
        return c.allreduce(np.ones(4, np.float32))

    errors = _all_mismatched(comms, skipper)
    text = str(errors[0])
    assert "barrier() as collective #1" in text and "allreduce(sum, float32, (4,)) as collective #1" in text


def test_mismatched_options_are_explained(make_world):
    comms = make_world(2)
    comms[1]._session.chunk_bytes = 4096  # as if rank 1 was configured differently
    errors = _all_mismatched(comms, lambda c: c.allreduce(np.ones(10_000, np.float32), algorithm="ring"))
    assert "chunk=" in str(errors[0]) and "same chunk_bytes" in str(errors[0])


def test_a_broken_communicator_refuses_further_calls(make_world):
    comms = make_world(2)
    _all_mismatched(comms, lambda c: c.allreduce(np.ones(3 + c.rank)))
    for comm in comms:
        with pytest.raises(CollectiveMismatchError, match="unusable"):
            comm.allreduce(np.ones(3))
        with pytest.raises(CollectiveMismatchError, match="unusable"):
            comm.barrier()


def test_validation_errors_leave_the_communicator_usable(make_world):
    comms = make_world(2)
    for bad in (dict(op="median"), dict(algorithm="tree")):
        with pytest.raises(ConfigurationError):
            comms[0].allreduce(np.ones(2), **bad)
    with pytest.raises(ConfigurationError, match="cannot be sent"):
        comms[0].allreduce(np.array(["a"], dtype=object))
    with pytest.raises(ConfigurationError, match="root must be a rank"):
        comms[0].broadcast(np.ones(2), root=2)
    with pytest.raises(ConfigurationError, match="must pass the array"):
        comms[0].broadcast(None, root=0)
    results = run_ranks(comms, lambda c: c.allreduce(np.ones(2)))
    np.testing.assert_array_equal(results[0], [2.0, 2.0])


# -- failures -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "direct", "pairwise"])
def test_a_dead_peer_is_named_by_every_rank(make_world, algorithm):
    comms = make_world(3)
    dead = comms[2].task

    def maybe_die(c):
        # A first call connects every pair, so the death is a lost connection, as mid-training; a
        # peer that was never reached is indistinguishable from one not started yet (a timeout).
        c.barrier()
        if c.rank == 2:
            c.transport.abort()
            return None
        return c.allreduce(np.ones(1000, np.float32), algorithm=algorithm)

    start = time.monotonic()
    _, errors = run_ranks(comms, maybe_die, return_exceptions=True)
    assert time.monotonic() - start < RECV_TIMEOUT
    for rank in (0, 1):
        assert isinstance(errors[rank], PeerLostError), f"rank {rank} raised {errors[rank]!r}"
        assert errors[rank].task == dead and str(dead) in str(errors[rank])


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_a_dead_peer_is_named_even_after_the_rank_that_met_it_left(make_world, algorithm):
    # Rank 0 meets rank 2's death, tells the others and leaves (as a script that does not catch the
    # error ends) before rank 1 even starts the call: rank 1 then finds rank 0 gone, but must still
    # name rank 2, from the notice rank 0 left behind, rather than blame rank 0.
    comms = make_world(3)
    dead = comms[2].task
    rank0_left = threading.Event()

    def run(c):
        c.barrier()
        if c.rank == 2:
            c.transport.abort()
            return None
        if c.rank == 1:
            assert rank0_left.wait(RECV_TIMEOUT)
        try:
            return c.allreduce(np.ones(1000, np.float32), algorithm=algorithm)
        finally:
            if c.rank == 0:
                c.close()
                rank0_left.set()

    _, errors = run_ranks(comms, run, return_exceptions=True)
    for rank in (0, 1):
        assert isinstance(errors[rank], PeerLostError), f"rank {rank} raised {errors[rank]!r}"
        assert errors[rank].task == dead and str(dead) in str(errors[rank]), f"rank {rank}: {errors[rank]}"


def test_closed_communicator_refuses_calls(make_world):
    comms = make_world(1)
    comms[0].close()
    with pytest.raises(TransportClosed, match="closed"):
        comms[0].allreduce(np.ones(1))


# -- integration points -----------------------------------------------------------------------------

def _two_ranks_over(cls: type[LocalTransport]) -> list[Communicator]:
    """A two-rank world over a LocalTransport subclass."""
    cluster = ClusterSpec({"worker": ["local:1", "local:2"]})
    fabric = LocalFabric()
    return [Communicator(cls(cluster, f"worker:{i}", fabric=fabric), timeout=RECV_TIMEOUT, owns_transport=True)
            for i in range(2)]


class _NativeLocal(LocalTransport):
    """A local transport that claims a native all-reduce for "max" only, to check the communicator
    asks it first and uses it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.native_calls = []

    def native_collectives(self):
        return {"allreduce": NativeCollective(self._allreduce, lambda session, x, op="sum", **_: op == "max")}

    def _allreduce(self, session, x, op="sum", algorithm="auto"):
        self.native_calls.append((session.rank, session.size, op, algorithm, session.seq))
        return np.full_like(x, 42)


def test_native_collectives_replace_core_algorithms_they_accept():
    comms = _two_ranks_over(_NativeLocal)
    try:
        results = run_ranks(comms, lambda c: (c.allreduce(np.ones(3), op="max"), c.allreduce(np.ones(3)),
                                              c.allreduce(np.ones(3), op="max"), c.barrier()))
        np.testing.assert_array_equal(results[1][0], [42, 42, 42])
        np.testing.assert_array_equal(results[1][1], [2, 2, 2])      # declined: core's sum
        # Asked before running, numbered once each (by the session), native or not.
        assert comms[0].transport.native_calls == [(0, 2, "max", "auto", 1), (0, 2, "max", "auto", 3)]
        assert comms[0]._session.seq == 4
    finally:
        for comm in comms:
            comm.close()


def test_a_native_that_is_not_a_native_collective_is_refused_by_name():
    class Bare(LocalTransport):
        def native_collectives(self):
            return {"allreduce": lambda session, x, **kwargs: x}

    with pytest.raises(ConfigurationError, match=r"Bare.native_collectives\(\) must map .*NativeCollective"):
        _two_ranks_over(Bare)


class _HostOnlyLocal(LocalTransport):
    device_buffers = False


def test_device_arrays_are_staged_through_the_host(monkeypatch):
    """A cupy array over a host-only transport goes to the host and comes back as a cupy array."""
    fake_cupy = types.ModuleType("cupy")

    class ndarray:  # a stand-in for cupy.ndarray: the communicator detects cupy by module name
        def __init__(self, host):
            self.host = np.asarray(host)

        dtype = property(lambda self: self.host.dtype)
        shape = property(lambda self: self.host.shape)

        def get(self):
            return self.host.copy()

    ndarray.__module__ = "cupy._core.core"
    fake_cupy.ndarray = ndarray
    fake_cupy.asarray = ndarray
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    comms = _two_ranks_over(_HostOnlyLocal)
    try:
        results = run_ranks(comms, lambda c: c.allreduce(ndarray(np.full(3, c.rank + 1.0))))
        assert all(type(r) is ndarray for r in results)
        np.testing.assert_array_equal(results[0].get(), [3.0, 3.0, 3.0])
        gathered = run_ranks(comms, lambda c: c.allgather(ndarray(np.array([c.rank]))))
        assert type(gathered[0]) is ndarray and gathered[0].get().tolist() == [[0], [1]]
    finally:
        for comm in comms:
            comm.close()


def test_communicator_options_are_checked():
    cluster = ClusterSpec({"worker": ["local:1"], "ps": ["local:2"]})
    transport = LocalTransport(cluster, "ps:0", **LocalTransport.world_options())
    with pytest.raises(ConfigurationError, match="not among the communicator's members"):
        Communicator(transport)
    with pytest.raises(ConfigurationError, match="distinct"):
        Communicator(transport, members=["ps:0", "ps:0"])
    with pytest.raises(ConfigurationError, match="chunk_bytes"):
        Communicator(transport, members=["ps:0"], chunk_bytes=0)
    with pytest.raises(ConfigurationError, match="timeout"):
        Communicator(transport, members=["ps:0"], timeout=-1)
    with Communicator(transport, members=["worker:0", "ps:0"], name="ps-group") as comm:
        assert (comm.rank, comm.size, comm.name) == (1, 2, "ps-group")
        assert comm.members == [TaskId("worker", 0), TaskId("ps", 0)]
    transport.close()


def test_open_communicator_refuses_unknown_options():
    with pytest.raises(ConfigurationError, match="unknown communicator option.*chunk_size.*known: members"):
        open_communicator("local", chunk_size=10)


def test_open_communicator_through_the_plugin_manager(monkeypatch):
    try:
        importlib.import_module("stratagem.plugins.manager").plugin_manager().transport_class("local")
    except Exception as exc:
        pytest.skip(f"the plugin manager is not usable yet: {type(exc).__name__}: {exc}")
    for var in ("STRATAGEM_CONFIG", "TF_CONFIG", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                "MV2_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    with open_communicator("local", transport_options=LocalTransport.world_options(), timeout=5) as comm:
        assert (comm.rank, comm.size) == (0, 1)
        np.testing.assert_array_equal(comm.allreduce(np.arange(3)), [0, 1, 2])
        transport = comm.transport
    with pytest.raises(TransportClosed):  # the communicator opened it, so it closed it
        transport.send(transport.task, "x", None)


def test_local_world_and_docstring_examples():
    comms = local_world(2, chunk_bytes=1024)
    assert [c.chunk_bytes for c in comms] == [1024, 1024]
    for comm in comms:
        comm.close()
    for module in (communicator_module, coll):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.__name__}: {result.failed} doctest example(s) failed"


def test_abort_notices_carry_the_same_error_kind():
    session = cs.CollectiveSession(None, [TaskId("worker", 0), TaskId("worker", 1)], 0, name="w",
                                     timeout=1.0, chunk_bytes=8, small_bytes=8)
    lost = cs._error_from_abort(session, {"abort": "lost", "task": "worker:1", "origin": 1, "reason": "gone"})
    assert isinstance(lost, PeerLostError) and lost.task == TaskId("worker", 1)
    failed = cs._error_from_abort(session, {"abort": "failed", "origin": 1, "reason": "TransportTimeout: x"})
    assert type(failed) is CommunicationError and "rank 1 (/job:worker/task:1)" in str(failed)


def _world_on_hosts(addresses):
    """Communicators over the in-process transport whose cluster addresses are ``addresses``."""
    from stratagem.collectives.communicator import Communicator
    from stratagem.core.cluster import ClusterSpec, TaskId
    from stratagem.transports.local import LocalTransport

    cluster = ClusterSpec({"worker": list(addresses)})
    fabric = LocalTransport.world_options()
    comms = []
    for index in range(len(addresses)):
        transport = LocalTransport(cluster, TaskId("worker", index), timeout=10, **fabric)
        transport.start()
        comms.append(Communicator(transport, owns_transport=True, timeout=10))
    return comms


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_large_allreduce_across_hosts_keeps_to_the_ring(hosts):
    """At 4 ranks a 1 MiB all-reduce on one host exchanges with every peer (pairwise: fewest dependent
    steps when ranks share cores); across hosts it sends only to the next rank (the ring: messages to
    every peer at once overflow a slow link's queue). Same bits either way."""
    import threading

    addresses = [f"host{i * hosts // 4}:{1000 + i}" for i in range(4)]
    comms = _world_on_hosts(addresses)
    try:
        xs = [np.full(1 << 18, r + 1, np.float32) for r in range(4)]
        before = [c.transport.traffic.snapshot() for c in comms]
        results = [None] * 4
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, comms[r].allreduce(xs[r])), daemon=True)
                   for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r is not None and (r == 10).all() for r in results)
        for rank, (c, b) in enumerate(zip(comms, before)):
            sent_to = {c.members.index(peer) for peer, counts in (c.transport.traffic.snapshot() - b).peers.items()
                       if counts[0]}
            assert sent_to == ({(rank + 1) % 4} if hosts == 2 else set(range(4)) - {rank})
    finally:
        for c in comms:
            c.close()
