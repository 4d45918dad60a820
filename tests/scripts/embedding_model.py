"""A small embedding model for the row tests (tests/test_ps_rows.py, tests/scripts/ps_rows_train.py).

Bags of ``BAG`` ids (repeats within a batch, so row gradients are merged) are mean-pooled through a
``VOCAB x DIM`` table and scored by a dense weight vector ``w``. ``train_step(..., sparse=True)`` reads
the table with ``gather`` and pushes an ``IndexedSlices`` gradient; ``sparse=False`` reads
``table.value`` and applies the densified gradient, the same numbers as a dense model.
"""

from __future__ import annotations

import numpy as np

import stratagem
from stratagem import IndexedSlices
from stratagem.training.sparse import densify

VOCAB, DIM, BAG = 2000, 8, 3

OPTIMIZERS = {
    "sgd": lambda: stratagem.optimizers.SGD(learning_rate=0.5),
    "adagrad": lambda: stratagem.optimizers.Adagrad(learning_rate=0.2),
    "adam": lambda: stratagem.optimizers.Adam(learning_rate=0.05),
    "momentum": lambda: stratagem.optimizers.SGD(learning_rate=0.2, momentum=0.9),
}


def create(optimizer: str = "sgd", seed: int = 0):
    """The table, the weights and the optimizer (inside the caller's scope, if any)."""
    rng = np.random.default_rng(seed)
    table = stratagem.Variable(rng.normal(0.0, 0.1, (VOCAB, DIM)).astype(np.float32), name="table")
    w = stratagem.Variable(rng.normal(0.0, 1.0, DIM).astype(np.float32), name="w")
    return table, w, OPTIMIZERS[optimizer]()


def global_batches(seed: int, steps: int, rows: int):
    """``steps`` batches ``(ids (rows, BAG), targets (rows,))``; ids skewed to the first rows."""
    rng = np.random.default_rng(1000 + seed)
    for _ in range(steps):
        ids = np.minimum(rng.zipf(1.3, (rows, BAG)) - 1, VOCAB - 1).astype(np.int64)
        yield ids, rng.normal(size=rows).astype(np.float32)


def train_step(table, w, opt, ids, y, *, sparse: bool = True) -> float:
    n = len(ids)
    flat = ids.reshape(-1)
    rows = table.gather(flat) if sparse else table.value[flat]
    emb = rows.reshape(n, BAG, DIM).mean(axis=1, dtype=np.float32)
    weights = w.value.copy()
    err = emb @ weights - y
    d_pred = (2.0 * err / n).astype(np.float32)
    d_rows = np.repeat((d_pred[:, None] * weights[None, :]) / np.float32(BAG), BAG, axis=0).astype(np.float32)
    grad = IndexedSlices(d_rows, flat, table.shape)
    opt.apply_gradients([(grad if sparse else densify(grad), table), ((emb.T @ d_pred).astype(np.float32), w)])
    return float(np.mean(err * err))


def reference(optimizer: str, steps: int, rows: int, seed: int = 0):
    """The same training in this process, no strategy: ``(table, w)`` after ``steps`` steps."""
    table, w, opt = create(optimizer, seed)
    for ids, y in global_batches(seed, steps, rows):
        train_step(table, w, opt, ids, y, sparse=True)
    return table.numpy(), w.numpy()
