"""The hierarchical all-reduce (``stratagem.communicator(hierarchical=...)``,
:mod:`stratagem.collectives.hierarchical`): inside each host, then between hosts, then inside again.

- Its results are the flat ring's (within floating-point reassociation; exact for integers), the same
  bits on every rank, on layouts of several shapes, lengths shorter than the groups, every op, into
  ``out=`` and in place.
- ``auto`` picks it for bandwidth-bound sizes only, where the members span hosts; it then moves the
  traffic it promises: each host's link carries the tensor once each way, the flat ring 1.5 times.
- Layouts that cannot work are refused, naming the problem and the fix; ranks that disagree about the
  layout raise ``CollectiveMismatchError``; a lost member is named by every rank, on both "hosts".
- The plain script a user writes runs under ``stratagem launch --hosts 2 --tasks-per-host 2`` over
  ``shm`` with ``remote='zmq'`` (shared memory inside a host, zmq between hosts), ending normally and
  by a mismatch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from stratagem.collectives.communicator import Communicator
from stratagem.core.cluster import ClusterSpec, TaskId
from stratagem.core.errors import CollectiveMismatchError, ConfigurationError, PeerLostError
from stratagem.testing.hosts import why_no_hosts
from stratagem.testing.world import local_world, transport_world

pytestmark = pytest.mark.timeout(60)
SCRIPT = Path(__file__).parent / "scripts" / "hierarchical_allreduce.py"
RECV_TIMEOUT = 10.0


def run_ranks(items, fn, timeout: float = 30.0):
    """``fn(item)`` for every item in its own thread: ``(results, errors)`` in order; a hang fails."""
    results, errors = [None] * len(items), [None] * len(items)

    def body(i):
        try:
            results[i] = fn(items[i])
        except BaseException as exc:  # handed to the test
            errors[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout} s"
    return results, errors


def run_all(items, fn):
    results, errors = run_ranks(items, fn)
    for error in errors:
        if error is not None:
            raise error
    return results


def inputs(size: int, length: int, dtype, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-3, 4, length).astype(dtype) if np.dtype(dtype).kind != "f"
            else rng.standard_normal(length).astype(dtype) for _ in range(size)]


LAYOUTS = {"2x2": [[0, 1], [2, 3]], "2x3 interleaved": [[0, 2, 4], [1, 3, 5]], "3x2": [[0, 1], [2, 3], [4, 5]],
           "1x4": [[0, 1, 2, 3]], "4x1": [[0], [1], [2], [3]]}


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_results_are_the_flat_rings_on_every_rank(layout, op):
    groups = LAYOUTS[layout]
    size = sum(map(len, groups))
    comms = local_world(size, hierarchical=groups, chunk_bytes=64, timeout=RECV_TIMEOUT)  # 16-float chunks
    try:
        for length, dtype in ((0, np.float32), (1, np.float32), (5, np.int32), (1001, np.float32), (1001, np.int64)):
            xs = inputs(size, length, dtype)
            ours = run_all(comms, lambda c: c.allreduce(xs[c.rank], op=op, algorithm="hierarchical"))
            flat = run_all(comms, lambda c: c.allreduce(xs[c.rank], op=op, algorithm="ring"))
            for result in ours:
                assert result.tobytes() == ours[0].tobytes(), "ranks differ in their bits"
            assert ours[0].dtype == flat[0].dtype and ours[0].shape == flat[0].shape == (length,)
            if ours[0].dtype.kind == "f":
                np.testing.assert_allclose(ours[0], flat[0], rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(ours[0], flat[0])
    finally:
        for c in comms:
            c.close()


def test_into_out_and_in_place_give_the_same_bits():
    comms = local_world(4, hierarchical=[[0, 2], [1, 3]], chunk_bytes=256, timeout=RECV_TIMEOUT)
    try:
        xs = [x.reshape(7, 13) for x in inputs(4, 91, np.float32, seed=3)]
        fresh = run_all(comms, lambda c: c.allreduce(xs[c.rank], algorithm="hierarchical"))
        outs = [np.empty_like(x) for x in xs]
        into = run_all(comms, lambda c: c.allreduce(xs[c.rank], algorithm="hierarchical", out=outs[c.rank]))
        mine = [x.copy() for x in xs]
        inplace = run_all(comms, lambda c: c.allreduce(mine[c.rank], algorithm="hierarchical", out=mine[c.rank]))
        for rank in range(4):
            assert into[rank] is outs[rank] and inplace[rank] is mine[rank]
            assert fresh[rank].shape == (7, 13)
            assert fresh[rank].tobytes() == outs[rank].tobytes() == mine[rank].tobytes()
    finally:
        for c in comms:
            c.close()


def _sent(comms, fn) -> list[dict[int, int]]:
    """Run ``fn`` on every rank; the payload bytes each rank sent to each other rank meanwhile."""
    before = [c.transport.traffic.snapshot() for c in comms]
    run_all(comms, fn)
    sent = []
    for c, b in zip(comms, before):
        delta = (c.transport.traffic.snapshot() - b).peers
        sent.append({c.members.index(peer): counts[0] for peer, counts in delta.items() if counts[0]})
    return sent


def test_auto_goes_hierarchical_for_large_tensors_across_hosts_and_moves_a_third_less_between_them():
    n = 1 << 18                      # 1 MiB of float32: bandwidth-bound at 4 ranks
    groups = [[0, 1], [2, 3]]
    comms = local_world(4, hierarchical=groups, timeout=RECV_TIMEOUT)
    try:
        x = np.ones(n, np.float32)
        auto = _sent(comms, lambda c: c.allreduce(x))
        # each rank talks to its host's other member and to its own local rank on the other host, never
        # to the third: 0 -> 1 (the reduce-scatter's and all-gather's half each), 0 -> 2 (a quarter, twice)
        assert auto[0] == {1: 2 * x.nbytes // 2, 2: 2 * x.nbytes // 4}
        assert auto[3] == {2: 2 * x.nbytes // 2, 1: 2 * x.nbytes // 4}
        ring = _sent(comms, lambda c: c.allreduce(x, algorithm="ring"))
        across = lambda sent, a, b: sum(sent[r].get(p, 0) for r in groups[a] for p in groups[b])  # noqa: E731
        assert across(auto, 0, 1) == across(auto, 1, 0) == x.nbytes                     # S each way
        assert across(ring, 0, 1) == across(ring, 1, 0) == 3 * x.nbytes // 2              # 1.5 S each way
        small = _sent(comms, lambda c: c.allreduce(np.ones(8, np.float32)))              # latency-bound: flat
        assert set(small[0]) == {1, 2, 3}
    finally:
        for c in comms:
            c.close()
    # hierarchical=True finds the hosts from the addresses: here one host, so auto stays flat (pairwise)
    comms = local_world(4, hierarchical=True, timeout=RECV_TIMEOUT)
    try:
        assert set(_sent(comms, lambda c: c.allreduce(np.ones(n, np.float32)))[0]) == {1, 2, 3}
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("option, message", [
    ([[0, 1], [2]], r"every host needs the same number of members, but the hosts have 2 \(0, 1\), 1 \(2\); "
                    r"place as many tasks on every host \(stratagem launch --tasks-per-host K\)"),
    ([[0, 1], [1, 2]], r"must name every rank 0..2 once \(repeated: \[1\]\)"),
    ([[0, 5], [1, 2]], r"not ranks of this communicator: \[5\]"),
    ([["worker:0", "worker:9"], [1, 2]], r"'worker:9' is neither a rank nor a member of the communicator"),
    ("host0", r"hierarchical must be True .*, False, or the members of each host as lists"),
])
def test_layouts_that_cannot_work_are_refused_with_the_fix(option, message):
    with pytest.raises(ConfigurationError, match=message):
        local_world(3, hierarchical=option)


def test_an_elastic_communicator_refuses_a_layout_of_hosts():
    from stratagem.collectives.elastic import ElasticCommunicator
    from stratagem.transports.local import LocalTransport

    cluster = ClusterSpec({"worker": ["local:1", "local:2"]})
    transport = LocalTransport(cluster, TaskId("worker", 0), **LocalTransport.world_options())
    try:
        with pytest.raises(ConfigurationError, match=r"members change .* \(leave hierarchical off\)"):
            ElasticCommunicator(transport, hierarchical=[[0], [1]])
    finally:
        transport.close()


def test_asking_for_the_algorithm_without_a_layout_says_how():
    (comm,) = local_world(1)
    try:
        with pytest.raises(ConfigurationError, match=r"algorithm='hierarchical' needs to know which members share "
                                                     r"a host: make the communicator with hierarchical=True"):
            comm.allreduce(np.ones(3), algorithm="hierarchical")
        assert comm.allreduce(np.ones(3)).tolist() == [1.0, 1.0, 1.0]   # refused before anything moved
    finally:
        comm.close()


def _world(transport: str, layouts, **options):
    """Communicators over real ``transport`` endpoints (loopback), rank r with ``hierarchical=layouts[r]``."""
    cm = transport_world(transport, len(layouts), timeout=RECV_TIMEOUT, peer_timeout=5.0, **options)
    world = cm.__enter__()
    # 16 KiB chunks: a 256 KiB all-reduce is 8 blocks, overlapped (a helper thread crosses the hosts)
    comms = [Communicator(t, hierarchical=layout, timeout=RECV_TIMEOUT, chunk_bytes=16 << 10)
             for t, layout in zip(world, layouts)]
    return cm, comms


def test_ranks_that_disagree_about_the_hosts_raise_a_mismatch():
    cm, comms = _world("zmq", [[[0, 1], [2, 3]]] * 3 + [[[0, 2], [1, 3]]], linger=0.5)
    try:
        _, errors = run_ranks(comms, lambda c: c.allreduce(np.ones(64, np.float32), algorithm="hierarchical"))
        assert any(isinstance(e, CollectiveMismatchError) for e in errors), errors
        for error in errors:   # every rank stops, none waits out its timeout
            assert isinstance(error, (CollectiveMismatchError, PeerLostError)), errors
    finally:
        cm.__exit__(None, None, None)


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_member_lost_mid_call_is_named_by_every_rank_on_both_hosts(transport):
    options = {"linger": 0.5} if transport == "zmq" else {}
    cm, comms = _world(transport, [[[0, 1], [2, 3]]] * 4, **options)
    dead = comms[3].task

    def run(c):
        c.barrier()   # every pair connected: the death is a lost connection, as mid-training
        if c.rank == 3:
            c.transport.abort()
            return None
        return c.allreduce(np.ones(1 << 16, np.float32), algorithm="hierarchical")

    try:
        _, errors = run_ranks(comms, run)
        for rank in range(3):
            assert isinstance(errors[rank], PeerLostError) and errors[rank].task == dead, (rank, errors[rank])
    finally:
        cm.__exit__(None, None, None)


# -- the plain script on emulated hosts ---------------------------------------------------------------

needs_hosts = pytest.mark.skipif(bool(why_no_hosts()), reason=str(why_no_hosts()))


def _launch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATAGEM_", "TF_CONFIG"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # On a hang subprocess.run SIGKILLs the launcher: its tasks and namespaces die with it.
    return subprocess.run([sys.executable, "-m", "stratagem", "launch", "--hosts", "2", "--tasks-per-host", "2",
                           "--worker", "4", "--timeout", "40", "--", sys.executable, str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=50, env=env)


@needs_hosts
def test_the_plain_script_runs_on_two_hosts_with_shared_memory_inside_each():
    done = _launch()
    assert done.returncode == 0, done.stdout + done.stderr
    reports = {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^\[(worker:\d)\] (\{.*\})$", done.stdout, re.M)}
    assert set(reports) == {f"worker:{i}" for i in range(4)}, done.stdout
    half = 2 << 20   # bytes of half the 4 MiB tensor
    for task, report in reports.items():
        rank = int(task[-1])
        local, cross = rank ^ 1, (rank + 2) % 4
        assert report["sum_exact"] and report["mean_exact"] and report["small"] == [10.0] * 3, report
        # the shard of 2 MiB goes once each way to the other host; the local peer gets the rest
        assert report["sent"] == {f"worker:{local}": 2 * half, f"worker:{cross}": half}, report
        # shared memory only inside the host, both ways
        assert report["rings"] == sorted([f"worker:{rank}->worker:{local}", f"worker:{local}->worker:{rank}"]), report


@needs_hosts
def test_the_plain_script_ends_by_a_mismatch_on_every_task():
    done = _launch("mismatch")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "CollectiveMismatchError" in done.stdout + done.stderr, done.stdout + done.stderr
    assert "first failure" in done.stdout + done.stderr
