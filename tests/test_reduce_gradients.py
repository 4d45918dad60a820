"""``strategy.reduce_gradients``: the replicas' gradients reduced as ``apply_gradients`` reduces them,
not applied (the hook the torch and JAX adapters use to run an update rule of their own).

Replicas are threads of one process over the ``local`` transport (a real all-reduce through its
mailboxes); the parameter-server strategies refuse it with the reason.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import stratagem
from stratagem.core.cluster import ClusterSpec
from stratagem.core.errors import ConfigurationError
from stratagem.strategies.ps.between_graph import BetweenGraphStrategy
from stratagem.strategies.mirrored.strategy import MirroredStrategy
from stratagem.transports.local import LocalFabric

pytestmark = pytest.mark.timeout(60)


def run_replicas(n: int, body) -> list:
    cluster, fabric = ClusterSpec({"worker": [f"local:{i}" for i in range(n)]}), LocalFabric()
    results, errors = [None] * n, []

    def replica(index):
        try:
            with MirroredStrategy("local", cluster=cluster, task=f"worker:{index}",
                                  transport_options={"fabric": fabric, "timeout": 30}) as strategy:
                results[index] = body(strategy, index)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    return results


def test_mirrored_reduces_to_the_batch_weighted_mean_and_leaves_variables_alone():
    def body(strategy, index):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(3, np.float32), name="w")
            b = stratagem.Variable(np.zeros(2, np.float64), name="b")
        # One global batch of 5 rows: shards of 2, 2 and 1 rows.
        (rows,), = strategy.distribute_dataset([(np.arange(5),)])
        grads = [np.full(3, float(index + 1), np.float32), np.full(2, 10.0 * (index + 1))]
        reduced = strategy.reduce_gradients(zip(grads, [w, b]))
        return [r.copy() for r in reduced], w.numpy(), len(rows), strategy._step

    results = run_replicas(3, body)
    assert [r[2] for r in results] == [2, 2, 1]
    expected_w = (2 * 1 + 2 * 2 + 1 * 3) / 5.0          # each replica weighted by its rows
    for reduced, w, _, step in results:
        np.testing.assert_allclose(reduced[0], np.full(3, expected_w, np.float32), rtol=1e-6)
        np.testing.assert_allclose(reduced[1], np.full(2, 10 * expected_w), rtol=1e-12)
        assert reduced[0].dtype == np.float32 and reduced[1].dtype == np.float64
        np.testing.assert_array_equal(w, np.zeros(3, np.float32))    # nothing applied
        assert step == 1                                              # counted as a step (for save)


def test_mirrored_refuses_variables_of_another_strategy_and_none():
    def body(strategy, index):
        with strategy.scope():
            w = stratagem.Variable(np.zeros(2), name="w")
        outsider = stratagem.Variable(np.zeros(2), name="outsider")
        for pairs in ([(np.ones(2), outsider)], [(None, w)]):
            with pytest.raises(ConfigurationError, match="created in this strategy's scope"):
                strategy.reduce_gradients(pairs)
        return True

    assert run_replicas(2, body) == [True, True]


def test_parameter_servers_refuse_it_naming_where_gradients_go():
    cluster, fabric = ClusterSpec({"worker": ["local:0"], "ps": ["local:1"]}), LocalFabric()
    outcome = {}

    def task(name):
        with BetweenGraphStrategy("local", cluster=cluster, task=name, exit_after_serving=False,
                                  transport_options={"fabric": fabric, "timeout": 30}) as strategy:
            if name.startswith("ps"):
                return
            with strategy.scope():
                w = stratagem.Variable(np.zeros(2, np.float32), name="w")
            try:
                strategy.reduce_gradients([(np.ones(2, np.float32), w)])
            except ConfigurationError as exc:
                outcome["error"] = str(exc)

    threads = [threading.Thread(target=task, args=(t,)) for t in ("ps:0", "worker:0")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not any(t.is_alive() for t in threads)
    assert "reduced and applied on the ps tasks" in outcome["error"]
