"""A broadcast whose ranks disagree raises ``CollectiveMismatchError`` on every rank, the root included
(issue #23, item 7). Before, the root only sent: a receiver that passed another shape or dtype raised,
but the root returned normally, and when every rank named itself the root no rank raised at all and
the replicas silently went on with different values.

Now every rank of a broadcast first tells every other one which call it makes (root, dtype and shape
as far as it knows them; :func:`stratagem.collectives.algorithms.broadcast`). The plain script runs
as every task of a three-task cluster, each an independent process, over zmq and grpc; the
in-process tests cover the algorithms and world sizes.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from stratagem.core.errors import CollectiveMismatchError
from stratagem.testing.strategy_contract import report, run_tasks
from stratagem.testing.world import local_world

SCRIPT = Path(__file__).parent / "scripts" / "broadcast_disagreement.py"

pytestmark = pytest.mark.timeout(120)

needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None,
                                reason="grpcio is not installed (pip install 'stratagem[grpc]')")


@pytest.mark.parametrize("transport, case", [
    ("zmq", "shape"), ("zmq", "roots"), pytest.param("grpc", "dtype", marks=needs_grpc),
])
def test_every_process_raises_when_the_ranks_disagree_about_a_broadcast(transport, case):
    results = run_tasks([f"worker:{i}" for i in range(3)], [sys.executable, str(SCRIPT), transport, case])
    for task, (code, out, _) in results.items():
        assert code == 1 and "CollectiveMismatchError" in out and "returned" not in out, report(results)
    if case != "roots":   # the root names the rank that disagrees, and what it called
        _, out, _ = results["worker:0"]
        assert "rank 2 (/job:worker/task:2)" in out and "broadcast(root=0" in out, report(results)


def _run(comms, fn) -> tuple[list, list]:
    """``fn(comm)`` on every rank, each in its own thread: the results and the errors, in rank order."""
    results, errors = [None] * len(comms), [None] * len(comms)

    def body(rank):
        try:
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[rank] = exc
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(comms))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "a rank is still in its broadcast (deadlock?)"
    return results, errors


def _disagree(size: int, fn) -> list:
    comms = local_world(size, timeout=20)
    try:
        results, errors = _run(comms, fn)
    finally:
        for c in comms:
            c.close()
    for rank, error in enumerate(errors):
        assert isinstance(error, CollectiveMismatchError), f"rank {rank} returned {results[rank]!r} / raised {error!r}"
    return errors


@pytest.mark.parametrize("size", [2, 5])
@pytest.mark.parametrize("length", [16, 100_000])   # direct, and scatter + all-gather
def test_a_receiver_with_another_shape_makes_every_rank_raise(size, length):
    def call(c):
        wrong = c.rank == size - 1
        return c.broadcast(np.zeros(length + wrong if c.rank else length, np.float32) if c.rank != 1 or wrong
                           else None, root=0)
    errors = _disagree(size, call)
    assert f"rank {size - 1} (/job:worker/task:{size - 1}) called broadcast(root=0, float32, ({length + 1},))" \
           in str(errors[0])


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_that_each_name_themselves_the_root_all_raise(size):
    _disagree(size, lambda c: c.broadcast(np.full(8, c.rank, np.float32), root=c.rank))


def test_two_roots_among_agreeing_receivers_all_raise():
    _disagree(4, lambda c: c.broadcast(np.ones(8) if c.rank in (0, 3) else None, root=3 if c.rank == 3 else 0))


@pytest.mark.parametrize("algorithm", ["binomial_tree", "scatter_allgather"])
def test_the_chosen_algorithms_agree_first_too(algorithm):
    _disagree(3, lambda c: c.broadcast(np.ones(1000, np.float32 if c.rank < 2 else np.int32), algorithm=algorithm))


def test_receivers_without_an_array_learn_from_the_root_and_the_communicator_goes_on():
    comms = local_world(4, timeout=20)
    try:
        for root in range(4):
            for length in (0, 3, 50_000):
                data = np.arange(length, dtype=np.int16) + root
                results, errors = _run(comms, lambda c: c.broadcast(data if c.rank == root else None, root=root))
                assert errors == [None] * 4, errors
                for got in results:
                    assert got.dtype == np.int16 and np.array_equal(got, data)
    finally:
        for c in comms:
            c.close()
