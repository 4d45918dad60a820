"""advise's convergence probe: the bench models trained in this process, sync and async, to their
target loss (stratagem.advise.convergence). Deterministic in the seed, so the properties below are
exact, not statistical."""

from __future__ import annotations

import numpy as np
import pytest

from stratagem.advise import convergence
from stratagem.advise.probe import convergence_from_dict
from stratagem.bench.models import build_model

pytestmark = pytest.mark.timeout(60)


def test_a_sync_global_batch_takes_no_fewer_updates_on_the_linear_model():
    # The linear model's gradient is nearly noise-free: averaging k batches does not shorten the way to
    # the target, so k replicas take at least as many updates as one, and k times the rows or more.
    # (A real property of this model, measured by real training.)
    model = build_model("linear")
    rows = {k: convergence.rows_to_target(model, 0, "sync", k, 0.002, 1_000_000) for k in (1, 2, 4)}
    updates = {k: r / (k * model.batch_size) for k, r in rows.items()}
    assert rows[1] > 0 and updates[2] >= updates[1] and updates[4] >= updates[2]


def test_staleness_that_diverges_is_reported_as_not_reached():
    # Plain SGD at lr 0.2 on the linear model: a gradient 3 updates stale overshoots and diverges.
    model = build_model("linear")
    assert convergence.rows_to_target(model, 0, "async", 1, 0.002, 1_000_000) == \
        convergence.rows_to_target(model, 0, "sync", 1, 0.002, 1_000_000)      # no staleness: the same run
    assert convergence.rows_to_target(model, 0, "async", 4, 0.002, 1_000_000) is None
    with np.errstate(all="raise"):   # and without a numpy warning leaking out of the divergence
        assert convergence.rows_to_target(model, 0, "async", 8, 0.002, 200_000) is None


def test_a_sparse_model_trains_on_the_rows_its_batches_read():
    model = build_model("embedding")
    rows = convergence.rows_to_target(model, 0, "sync", 2, model.target_loss, 1_000_000)
    assert rows is not None and rows % (2 * model.batch_size) == 0


def test_measure_returns_what_the_cost_model_reads():
    model = build_model("mlp")
    doc = convergence.measure(model, 0, counts=(1, 2), budget_s=30)
    assert doc["target_loss"] == model.target_loss
    assert [k for k, _ in doc["sync"]] == [1, 2] and [k for k, _ in doc["async"]] == [1, 2]
    figures = convergence_from_dict(doc)
    assert figures.rows("sync", 2) == (float(doc["sync"][1][1]), False)
    assert figures.rows("async", 1) == (float(doc["async"][0][1]), False)


def test_without_a_target_the_model_aims_at_half_its_first_loss():
    class NoTarget:
        name, batch_size, learning_rate = "quadratic", 8, 0.1

        def init_params(self, seed):
            return {"w": np.full(4, 3.0, np.float32)}

        def batch(self, seed, replica, step, rows):
            return (np.zeros((rows, 4), np.float32),)

        def loss_and_grads(self, params, batch):
            w = params["w"]
            return float(w @ w), {"w": 2 * w}

        def sparse_rows(self, batch):
            return {}

    model = NoTarget()
    assert convergence.target_of(model, 0) == pytest.approx(18.0)
    # w shrinks by 0.8 per update: the loss by 0.64; half of 36 is reached within a few updates
    assert 0 < convergence.rows_to_target(model, 0, "sync", 1, 18.0, 10_000) <= 10 * 8
