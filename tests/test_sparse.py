"""Sparse gradients (``IndexedSlices``) and row reads (``Variable.gather``): checked, and everywhere
that moves whole arrays, exactly the dense update."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import stratagem
from stratagem import ClusterSpec, ConfigurationError, IndexedSlices
from stratagem.training.sparse import densify
from stratagem.strategies.mirrored.strategy import MirroredStrategy
from stratagem.transports.local import LocalFabric

pytestmark = pytest.mark.timeout(60)


def test_indexed_slices_are_checked_with_errors_that_say_the_fix():
    with pytest.raises(ConfigurationError, match="1-D array of integers"):
        IndexedSlices(np.ones((2, 3)), np.array([[0, 1]]), (4, 3))
    with pytest.raises(ConfigurationError, match=r"must be \(2, 3\)"):
        IndexedSlices(np.ones((2, 4)), np.array([0, 1]), (4, 3))
    with pytest.raises(ConfigurationError, match="rows of the variable, 0 to 3"):
        IndexedSlices(np.ones((1, 3)), np.array([4]), (4, 3))
    with pytest.raises(ConfigurationError, match="rows of the variable"):
        IndexedSlices(np.ones((1, 3)), np.array([-1]), (4, 3))


def test_merged_sums_repeated_rows_and_densify_matches_add_at():
    rng = np.random.default_rng(0)
    values, indices = rng.normal(size=(50, 3)), rng.integers(0, 10, 50)
    slices = IndexedSlices(values, indices, (10, 3))
    expected = np.zeros((10, 3))
    np.add.at(expected, indices, values)
    np.testing.assert_allclose(densify(slices), expected)
    merged = slices.merged()
    assert list(merged.indices) == sorted(set(indices.tolist()))
    np.testing.assert_allclose(densify(merged), expected)


def test_gather_reads_rows_and_refuses_bad_indices():
    table = stratagem.Variable(np.arange(20.0, dtype=np.float32).reshape(10, 2), name="table")
    rows = table.gather(np.array([7, 2, 7]))
    assert rows.tolist() == [[14.0, 15.0], [4.0, 5.0], [14.0, 15.0]]
    rows[:] = -1                                   # a copy: the table is unchanged
    assert table.numpy()[7].tolist() == [14.0, 15.0]
    with pytest.raises(ConfigurationError, match="rows 0 to 9"):
        table.gather([10])
    with pytest.raises(ConfigurationError, match="1-D array of integers"):
        table.gather([[1]])
    with pytest.raises(ConfigurationError, match="scalar"):
        stratagem.Variable(np.float32(1.0), name="s").gather([0])


@pytest.mark.parametrize("make_optimizer", [
    lambda: stratagem.optimizers.SGD(0.1, momentum=0.9),
    lambda: stratagem.optimizers.Adam(0.01),
], ids=["momentum", "adam"])
def test_a_sparse_gradient_applied_locally_is_exactly_the_dense_one(make_optimizer):
    rng = np.random.default_rng(1)
    start = rng.normal(size=(20, 4)).astype(np.float32)
    sparse_var, dense_var = stratagem.Variable(start, name="a"), stratagem.Variable(start, name="b")
    sparse_opt, dense_opt = make_optimizer(), make_optimizer()
    for _ in range(3):
        indices = rng.integers(0, 20, 8)
        values = rng.normal(size=(8, 4)).astype(np.float32)
        sparse_opt.apply_gradients([(IndexedSlices(values, indices, (20, 4)), sparse_var)])
        dense_opt.apply_gradients([(densify(IndexedSlices(values, indices, (20, 4))), dense_var)])
    np.testing.assert_array_equal(sparse_var.numpy(), dense_var.numpy())


def test_a_sparse_gradient_for_another_shape_is_refused():
    var = stratagem.Variable(np.zeros((5, 2), np.float32), name="t")
    opt = stratagem.optimizers.SGD(1.0)
    with pytest.raises(ConfigurationError, match=r"for shape \(6, 2\), the variable is \(5, 2\)"):
        opt.apply_gradients([(IndexedSlices(np.ones((1, 2), np.float32), [0], (6, 2)), var)])


def test_mirrored_replicas_all_reduce_sparse_gradients_as_the_dense_mean():
    """Each replica's rows differ; every replica ends with the mean of the densified gradients."""
    cluster, fabric = ClusterSpec({"worker": ["local:0", "local:1"]}), LocalFabric()
    start = np.zeros((6, 2), np.float32)
    grads = [IndexedSlices(np.ones((2, 2), np.float32), [0, 3], (6, 2)),
             IndexedSlices(np.full((2, 2), 3.0, np.float32), [3, 5], (6, 2))]
    out, errors = [None, None], [None, None]

    def replica(rank: int) -> None:
        try:
            with MirroredStrategy("local", cluster=cluster, task=f"worker:{rank}",
                                  transport_options={"fabric": fabric, "timeout": 20}) as strategy:
                with strategy.scope():
                    table = stratagem.Variable(start, name="table")
                    opt = stratagem.optimizers.SGD(1.0)
                strategy.run(lambda: opt.apply_gradients([(grads[rank], table)]))
                out[rank] = table.numpy()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc

    threads = [threading.Thread(target=replica, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [None, None]
    expected = start - (densify(grads[0]) + densify(grads[1])) / 2
    np.testing.assert_array_equal(out[0], expected)
    np.testing.assert_array_equal(out[1], expected)
