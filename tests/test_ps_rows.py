"""Parameter servers move the rows of embedding tables (ps_service/rows.py, ``pull_rows``, row pushes).

- ``Optimizer.update_rows`` and ``sparse_exact``: rows updated alone equal the dense update bit for bit
  for plain SGD and Adagrad, and are refused for rules where a zero gradient moves a row;
- the server: row pulls and row pushes checked with errors that say what is wrong (and it keeps
  serving), a row update never writes into an array a reply still sends, sync rounds of rows;
- the strategies (tasks as threads over the ``local`` transport): ``gather`` returns exactly the rows
  (partitioned table, duplicates) and moves rows, not the table; per-variable staleness; training by
  rows equals training densely (SGD, Adagrad: the row path; Adam, momentum: densified on the server)
  under async and under sync with two workers (weighted means);
- real processes over ``zmq`` (2 ps, 1 worker): the same training, bit for bit the local one, with the
  bytes per step of rows, and ``table.value`` afterwards the full current table.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import stratagem
from stratagem import ConfigurationError, IndexedSlices
from stratagem.ps_service import rows as ps_rows
from stratagem.launch.launcher import launch
from stratagem.ps_service.protocol import RemoteError
from stratagem.ps_service.consistency import SyncRound
from stratagem.training.sparse import densify
from stratagem.core.transport import SendHandle

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import embedding_model as model  # noqa: E402
from ps_harness import ok, run_cluster, push_grads  # noqa: E402
from test_parameter_server import Cluster  # noqa: E402
from test_ps import ASYNC, SGD1, Service  # noqa: E402

pytestmark = pytest.mark.timeout(60)


# -- the optimizer's row update -----------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: stratagem.optimizers.SGD(0.3),
    lambda: stratagem.optimizers.Adagrad(0.1),
    lambda: stratagem.optimizers.Adagrad(0.1, initial_accumulator_value=0.0),
], ids=["sgd", "adagrad", "adagrad-zero-accumulator"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_update_rows_equals_the_dense_update_bit_for_bit(make, dtype):
    rng = np.random.default_rng(0)
    start = rng.normal(size=(50, 3)).astype(dtype)
    rows_opt, dense_opt = make(), make()
    assert rows_opt.sparse_exact
    by_rows, dense = start.copy(), start.copy()
    for _ in range(4):
        rows = np.unique(rng.integers(0, 50, 12))
        grad = rng.normal(size=(len(rows), 3)).astype(dtype)
        rows_opt.iterations += 1
        dense_opt.iterations += 1
        rows_opt.update_rows("t", by_rows, rows, grad)
        dense_opt.update_array("t", dense, densify(IndexedSlices(grad, rows, dense.shape)))
    np.testing.assert_array_equal(by_rows, dense)
    for slot in rows_opt.slot_names():
        np.testing.assert_array_equal(rows_opt.get_slot("t", slot), dense_opt.get_slot("t", slot))


def test_rules_that_move_untouched_rows_are_not_sparse_exact_and_update_rows_refuses_them():
    class Clipped(stratagem.optimizers.SGD):
        def _update(self, xp, w, g, slots, t):
            super()._update(xp, w, g / max(1.0, float(np.linalg.norm(g))), slots, t)

    for opt in (stratagem.optimizers.SGD(0.1, momentum=0.9), stratagem.optimizers.Adam(),
                stratagem.optimizers.Adagrad(initial_accumulator_value=0.0, epsilon=0.0), Clipped(0.1)):
        assert not opt.sparse_exact, opt
    opt = stratagem.optimizers.Adam()
    opt.iterations = 1
    with pytest.raises(ConfigurationError, match="densify the gradient"):
        opt.update_rows("t", np.zeros((3, 2), np.float32), np.array([0]), np.ones((1, 2), np.float32))
    sgd = stratagem.optimizers.SGD(0.1)
    sgd.iterations = 1
    with pytest.raises(ConfigurationError, match="rows repeat"):
        sgd.update_rows("t", np.zeros((3, 2), np.float32), np.array([1, 1]), np.ones((2, 2), np.float32))
    with pytest.raises(ConfigurationError, match=r"must be \(1,\) \+ \(2,\)"):
        sgd.update_rows("t", np.zeros((3, 2), np.float32), np.array([1]), np.ones((1, 3), np.float32))


def test_a_sync_round_of_rows_is_the_dense_weighted_mean_bit_for_bit():
    rng = np.random.default_rng(4)
    shape = (30, 2)
    sparse_round, dense_round = SyncRound(), SyncRound()
    for k, weight in enumerate((0.3, 0.5, 0.2)):
        rows = np.unique(rng.integers(0, 30, 10))
        grad = IndexedSlices(rng.normal(size=(len(rows), 2)).astype(np.float32), rows, shape)
        # the second replica's gradient of "mixed" comes dense: that piece's sum turns dense
        mixed = densify(grad) if k == 1 else grad
        sparse_round.add(f"worker:{k}", ["t", "mixed"], [grad, mixed], weight, None)
        dense_round.add(f"worker:{k}", ["t", "mixed"], [densify(grad), densify(grad)], weight, None)
    names, grads = sparse_round.mean()
    dense_names, dense_grads = dense_round.mean()
    assert names == dense_names == ["t", "mixed"]
    assert isinstance(grads[0], IndexedSlices) and not isinstance(grads[1], IndexedSlices)
    np.testing.assert_array_equal(densify(grads[0]), dense_grads[0])
    np.testing.assert_array_equal(grads[1], dense_grads[1])


def test_split_rows_and_docstrings():
    import doctest
    assert doctest.testmod(ps_rows).failed == 0
    pieces = [stratagem.ps_service.placement.Piece("t/part_0", "t", 0, 0, 2, 0, 5, 0),
              stratagem.ps_service.placement.Piece("t/part_1", "t", 1, 1, 2, 5, 10, 0)]
    grad = IndexedSlices(np.arange(6.0).reshape(3, 2), [7, 5, 8], (10, 2)).merged()
    split = ps_rows.split_gradient(grad, pieces)
    assert [(p.name, rows.tolist(), values[:, 0].tolist()) for p, rows, values in split] == [
        ("t/part_0", [], []), ("t/part_1", [0, 2, 3], [2.0, 0.0, 4.0])]   # every piece, empty ones too


# -- the server ---------------------------------------------------------------------------------------------

@pytest.fixture
def service(closing):
    return lambda *args, **kwargs: closing(Service(*args, **kwargs))


def table_values():
    return {0: {"t": np.arange(20, dtype=np.float32).reshape(10, 2), "b": np.zeros(3, np.float32)}}


def test_bad_row_requests_get_errors_that_say_the_fix_and_the_server_keeps_serving(service):
    svc = service(ps=1)
    svc.init(ASYNC, table_values(), SGD1)
    client = svc.clients[0]
    bad_pulls = [
        ({0: (["t"], [np.array([10])])}, r"piece 't' has rows 0 to 9 .* got 10 to 10: send rows relative"),
        ({0: (["t"], [np.array([-1])])}, r"rows 0 to 9"),
        ({0: (["t"], [np.array([0.5])])}, r"rows of piece 't' must be a 1-D array of integers"),
        ({0: (["t"], [])}, r"1 piece name\(s\) but 0 row array\(s\)"),
        ({0: (["nope"], [np.array([0])])}, r"holds no piece 'nope'"),
    ]
    for request, message in bad_pulls:
        with pytest.raises(RemoteError, match=message):
            client.pull_rows(request)
    good = {0: ([], [])}
    bad_pushes = [
        ({0: (["t"], [np.array([1])], [np.ones((1, 3), np.float32)])},
         r"row gradient of piece 't' has shape \(1, 3\); 1 row\(s\) of a piece of shape \(10, 2\) need \(1, 2\)"),
        ({0: (["t"], [np.array([12])], [np.ones((1, 2), np.float32)])}, r"rows 0 to 9"),
        ({0: (["t"], [np.array([1])], [np.array([["a", "b"]])])}, r"dtype <U1; gradients are real numbers"),
        ({0: (["b"], [np.array([0])], [np.ones((1, 2), np.float32)])}, r"row gradient of piece 'b' has shape \(1, 2\)"),
    ]
    for rows, message in bad_pushes:
        with pytest.raises(RemoteError, match=message):
            push_grads(client, good, rows=rows)
    with pytest.raises(RemoteError, match=r"2 array\(s\) \(a row gradient is 2: rows, values\), got 1"):
        client.call({0: stratagem.core.transport.Message({"op": "push", "rows": ["t"]}, [np.array([1])])})
    with pytest.raises(RemoteError, match="skip must be a list of piece names"):
        push_grads(client, good, pull=True, skip={0: [3]})
    # nothing was applied, and the server still serves
    stats = client.stats()[0]
    assert stats["updates"] == 0 and stats["step"] == 0
    reply = client.pull_rows({0: (["t"], [np.array([9, 0, 9])])})[0]
    assert reply.buffers[0].tolist() == [[18.0, 19.0], [0.0, 1.0], [18.0, 19.0]]
    push_grads(client, good, rows={0: (["t"], [np.array([3, 1, 3])], [np.ones((3, 2), np.float32)])})  # repeats sum
    assert client.pull()[0].buffers[0][[1, 3]].tolist() == [[1.0, 2.0], [4.0, 5.0]]


class Pending(SendHandle):
    """A reply that the transport has not finished sending."""
    finished = False

    def done(self):
        return self.finished

    def wait(self, timeout=None):
        self.finished = True


def test_a_row_update_never_writes_into_an_array_a_reply_still_sends(service):
    svc = service(ps=1)
    svc.init(ASYNC, table_values(), SGD1)
    client, server = svc.clients[0], svc.servers[0]
    rows = {0: (["t"], [np.array([2])], [np.ones((1, 2), np.float32)])}
    push_grads(client, {0: ([], [])}, rows=rows)
    current = server.values["t"]
    push_grads(client, {0: ([], [])}, rows=rows)
    assert server.values["t"] is current                 # nothing reads it: updated in place
    reply = Pending()
    server.replies.sent(reply, [current])                # (the server thread waits for a request)
    sent = current.copy()
    push_grads(client, {0: ([], [])}, rows=rows)
    assert server.values["t"] is not current             # a new version...
    np.testing.assert_array_equal(current, sent)         # ...and what the reply sends is untouched
    assert server.values["t"][2].tolist() == [4.0 - 3, 5.0 - 3] and server.values["t"][3].tolist() == [6.0, 7.0]
    reply.finished = True


def test_push_replies_leave_out_the_pieces_named_in_skip(service):
    svc = service(ps=1)
    svc.init(ASYNC, table_values(), SGD1)
    reply = push_grads(svc.clients[0], {0: (["b"], [np.ones(3, np.float32)])}, pull=True, skip={0: ["t"]})[0]
    assert reply.meta["names"] == ["b"] and reply.buffers[0].tolist() == [-1.0] * 3
    reply = push_grads(svc.clients[0], {0: ([], [])}, pull=True)[0]
    assert reply.meta["names"] == ["t", "b"]


# -- the strategies, tasks as threads --------------------------------------------------------------------------

TABLE = np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8)


def test_gather_returns_exactly_the_rows_and_moves_rows_not_the_table():
    wanted = np.array([999, 3, 500, 3, 0, 499, 999])         # both pieces, repeats, any order

    def body(strategy, rank):
        with strategy.scope():
            table = stratagem.Variable(TABLE, name="table")
            bias = stratagem.Variable(np.zeros(4, np.float32), name="bias")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        cached = table.gather([7])                            # fresh after the initial pull: the cache
        opt.apply_gradients([(np.ones(4, np.float32), bias)])     # its reply leaves the gathered table out
        traffic = strategy.transport.traffic
        pulls = {i: s["pulls"] for i, s in strategy.ps_stats().items()}
        before = traffic.snapshot()
        got = table.gather(wanted)
        moved = traffic.snapshot() - before
        first_piece_only = table.gather([1, 2])               # only ps:0 asked
        stats = strategy.ps_stats()
        return (got, moved.sent_bytes(), moved.received_bytes(), pulls,
                {i: s["pulls"] for i, s in stats.items()}, {i: s["row_pulls"] for i, s in stats.items()},
                first_piece_only, [(p.ps, p.lo, p.hi) for p in strategy.pieces("table")], cached)

    got, sent, received, pulls_before, pulls, row_pulls, first, pieces, cached = ok(
        run_cluster(2, 1, body, partition_bytes=10_000))["worker:0"]
    assert pieces == [(0, 0, 500), (1, 500, 1000)]
    np.testing.assert_array_equal(got, TABLE[wanted])
    np.testing.assert_array_equal(first, TABLE[[1, 2]])
    np.testing.assert_array_equal(cached, TABLE[[7]])
    assert got.flags.owndata or got.base is not None
    distinct = len(set(wanted.tolist()))
    assert received == distinct * 8 * 4                          # each distinct row once, nothing else
    assert sent == distinct * 8                                  # their int64 indices
    assert pulls == pulls_before                                 # no pull of the table
    assert row_pulls == {0: 2, 1: 1}


def test_per_variable_staleness_dense_reads_and_push_replies():
    """A table read by rows is left out of pulls and push replies; reading its value pulls it, in
    place, and makes it dense-read again."""
    def body(strategy, rank):
        with strategy.scope():
            table = stratagem.Variable(TABLE, name="table")
            w = stratagem.Variable(np.zeros(8, np.float32), name="w")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        view = table.value
        traffic = strategy.transport.traffic
        figures = []
        for step in range(3):
            rows = table.gather([step, 10])
            before = traffic.snapshot()
            opt.apply_gradients([(IndexedSlices(np.ones((2, 8), np.float32), [step, 10], TABLE.shape), table),
                                 (rows.sum(axis=0), w)])
            figures.append((traffic.snapshot() - before).received_bytes())
            w.value                                        # dense-read w: no pull (the push brought it)
        pulls = strategy.ps_stats()[0]["pulls"]
        stale_view = view.copy()
        full = table.value                                 # pulls the table, into the same buffer
        after = strategy.ps_stats()[0]["pulls"]
        before = traffic.snapshot()
        opt.apply_gradients([(np.zeros((1000, 8), np.float32), table)])
        dense_reply = (traffic.snapshot() - before).received_bytes()
        return figures, pulls, after, stale_view, full is view, view.copy(), dense_reply, w.numpy()

    figures, pulls, after, stale_view, same, full, dense_reply, w = ok(run_cluster(1, 1, body))["worker:0"]
    expected = TABLE.copy()
    expected[[0, 1, 2]] -= 1.0
    expected[10] -= 3.0
    np.testing.assert_array_equal(full, expected)
    assert same and not np.array_equal(stale_view, expected)     # refreshed in place on the dense read
    assert figures == [8 * 4] * 3                                 # push replies: w only, not the table
    assert after == pulls + 1 and dense_reply == TABLE.nbytes + 8 * 4   # dense again: the push brings it
    assert w.shape == (8,)


def run_embedding(optimizer: str, *, sparse: bool, mode: str = "async", workers: int = 1, steps: int = 12,
                  rows: int = 7, **options):
    def body(strategy, rank):
        with strategy.scope():
            table, w, opt = model.create(optimizer)
        batches = model.global_batches(0, steps, rows)
        if workers > 1:
            batches = strategy.distribute_dataset(batches)
        for ids, y in batches:
            model.train_step(table, w, opt, ids, y, sparse=sparse)
        return table.numpy(), w.numpy(), strategy.acks
    results = ok(run_cluster(2, workers, body, mode=mode, partition_bytes=16 << 10, **options))
    return results


@pytest.mark.parametrize("optimizer, mode, options", [
    ("sgd", "async", {}), ("adagrad", "async", {}), ("adam", "async", {}), ("momentum", "async", {}),
    ("sgd", "async", {"pull_with_push": False}), ("adagrad", "bounded", {"staleness": 1}),
], ids=["sgd", "adagrad", "adam", "momentum", "sgd-no-pull-with-push", "adagrad-bounded"])
def test_training_by_rows_equals_training_densely(optimizer, mode, options):
    """SGD and Adagrad update rows on the server, Adam and momentum densify them there: every one
    ends bit for bit where the dense training (and the local one) ends."""
    by_rows = run_embedding(optimizer, sparse=True, mode=mode, **options)["worker:0"]
    dense = run_embedding(optimizer, sparse=False, mode=mode, **options)["worker:0"]
    local = model.reference(optimizer, 12, 7)
    for got, want, name in zip(by_rows[:2], dense[:2], ("table", "w")):
        np.testing.assert_array_equal(got, want, err_msg=name)
    np.testing.assert_array_equal(by_rows[0], local[0])
    np.testing.assert_array_equal(by_rows[1], local[1])
    assert not np.array_equal(by_rows[0], model.create(optimizer)[0].numpy())   # it did train


def test_sync_with_two_workers_by_rows_equals_the_dense_weighted_mean():
    """7 rows per global batch over 2 workers (4 and 3): the weighted mean of row gradients."""
    by_rows = run_embedding("adagrad", sparse=True, mode="sync", workers=2)
    dense = run_embedding("adagrad", sparse=False, mode="sync", workers=2)
    for task in ("worker:0", "worker:1"):
        np.testing.assert_array_equal(by_rows[task][0], dense[task][0])
        np.testing.assert_array_equal(by_rows[task][1], dense[task][1])
        assert by_rows[task][2] == {0: {"applied": 12}, 1: {"applied": 12}}
    assert by_rows["ps:0"]["updates"] == by_rows["ps:1"]["updates"] == 12
    np.testing.assert_array_equal(by_rows["worker:0"][0], by_rows["worker:1"][0])


def embedding_step(table, opt, strategy, ids):
    """A parameter_server step (module level: it travels by name): gather rows, push rows."""
    rows = table.gather(ids)
    before = strategy.transport.traffic.snapshot()
    opt.apply_gradients([(IndexedSlices(np.ones_like(rows), ids, table.shape), table)])
    return rows, (strategy.transport.traffic.snapshot() - before).received_bytes()


def test_parameter_server_steps_gather_rows_and_push_rows():
    c = Cluster(ps=2, workers=1, partition_bytes=10_000)
    try:
        s = c.coordinator
        with s.scope():
            table = stratagem.Variable(TABLE, name="table")
            opt = stratagem.optimizers.SGD(learning_rate=1.0)
        ids = np.array([5, 900, 5])
        results = [s.schedule(embedding_step, args=(table, opt, s, ids)) for _ in range(3)]
        s.join()
        steps = [r.fetch() for r in results]
        gathered = s.run(lambda_free_gather, args=(table, ids))     # on a worker, after the steps
        on_coordinator = table.gather(ids)                          # the coordinator reads rows fresh
        full = table.numpy()
    finally:
        c.close()
    for k, (rows, received) in enumerate(steps):
        # rows 5 (twice per step: the gradients merged) and 900 as of the step's start
        np.testing.assert_array_equal(rows, TABLE[ids] - np.array([[2.0], [1.0], [2.0]], np.float32) * k)
        assert received == 0                                       # the reply leaves the table out
    expected = TABLE.copy()
    expected[5] -= 6.0
    expected[900] -= 3.0
    np.testing.assert_array_equal(gathered, expected[ids])
    np.testing.assert_array_equal(on_coordinator, expected[ids])
    np.testing.assert_array_equal(full, expected)


def lambda_free_gather(table, ids):
    return table.gather(ids)


# -- real processes over zmq -------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_training_by_rows_over_zmq_is_the_local_training_and_moves_rows(tmp_path):
    steps, rows = 20, 16
    stdout, stderr = io.StringIO(), io.StringIO()
    result = launch([sys.executable, str(SCRIPTS / "ps_rows_train.py"), str(tmp_path), "sgd", str(steps), str(rows)],
                    workers=1, ps=2, timeout=90, output=stdout, error_output=stderr, grace=5.0,
                    env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    log = stdout.getvalue() + stderr.getvalue()
    assert result.ok, log
    assert not any(r.stopped_by_launcher for r in result.tasks), log
    saved = np.load(tmp_path / "worker_0.npz")
    table, w = model.reference("sgd", steps, rows)
    np.testing.assert_array_equal(saved["table"], table)       # table.value after the sparse steps
    np.testing.assert_array_equal(saved["w"], w)
    figures = json.loads((tmp_path / "worker_0.json").read_text())
    assert figures["pieces"] == [0, 1]
    # per step at most rows * BAG distinct rows come and go (+ their indices, + w): far below the table
    most = rows * model.BAG * (model.DIM * 4 + 8) + model.DIM * 4
    assert figures["received_per_step"] <= most and figures["sent_per_step"] <= most + 4 * model.DIM
    assert figures["received_per_step"] < figures["table_bytes"] / 20
    assert all(s["pulls"] == 1 for s in figures["stats"].values())            # the initial pull only
    assert sum(s["row_pulls"] for s in figures["stats"].values()) >= steps - 1
    assert all(s["updates"] == s["applied"] == steps for s in figures["stats"].values())


def test_bad_gathers_and_sparse_gradients_are_refused_before_anything_moves():
    def body(strategy, rank):
        with strategy.scope():
            table = stratagem.Variable(TABLE, name="table")
            opt = stratagem.optimizers.SGD(1.0)
        with pytest.raises(ConfigurationError, match="rows 0 to 999"):
            table.gather([1000])
        with pytest.raises(ConfigurationError, match=r"for shape \(10, 8\), the variable is \(1000, 8\)"):
            opt.apply_gradients([(IndexedSlices(np.ones((1, 8)), [0], (10, 8)), table)])
        return strategy.ps_stats()[0]["pushes"]
    assert ok(run_cluster(1, 1, body))["worker:0"] == 0
