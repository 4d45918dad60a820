"""The models ``stratagem bench`` trains, and the small interface your own model follows.

Built-in models, each stressing something else (numpy, float32, synthetic data drawn from a fixed
"teacher", so the loss falls the same way on every run):

========== ===================================================== ============================
name       what                                                  stresses
========== ===================================================== ============================
linear     y = 0.1 x + 0.3, W and b (the classic tutorial)       latency: 8 bytes of parameters
mlp        MLP 256-512-512-10, softmax, 256 rows per replica     compute (1.6 MB, ~600 MFLOP)
wide       one 4096x512 layer, 8 rows per replica                communication (8 MB, ~100 MFLOP)
embedding  100k x 16 embedding, bags of 8 ids, 64 rows           sparse rows: 6.4 MB table, ~2K rows touched
========== ===================================================== ============================

**Your own model**: ``stratagem bench --model package.module:build``, where ``build()`` (no arguments)
returns an object with these attributes (duck-typed; :class:`BenchModel` is a base to start from)::

    name: str                  # shown in the table
    batch_size: int            # rows per replica per step
    learning_rate: float       # plain SGD
    init_params(seed) -> {name: float32 array}
    batch(seed, replica, step, rows) -> tuple of arrays      # deterministic in its arguments
    loss_and_grads(params, batch) -> (float loss, {name: gradient})
    sparse_rows(batch) -> {name: sorted unique row ids}      # optional: which rows of which
                                                             # parameters a batch reads
    target_loss: float | None                                # optional: time-to-target's target
    test_accuracy(params, seed) -> float                     # optional: accuracy on held-out data

For a parameter named in ``sparse_rows``, ``params[name]`` holds only those rows (in that order) and
its gradient is the gradient of those rows: strategies that can move just the rows do (the parameter
servers), the others move the whole table. Every replica calls ``batch`` with its own ``replica``
index, so the data is the same for every strategy. ``test_accuracy`` (the ``mlp``'s: the fraction of
4096 points drawn apart from every batch that it classifies right) is measured after the last step
under ``mirrored`` and ``between_graph`` (``test_accuracy`` in ``--json``, "test acc" in the table).

    >>> model = build_model("linear")
    >>> params = model.init_params(seed=0)
    >>> loss, grads = model.loss_and_grads(params, model.batch(0, replica=0, step=0, rows=4))
    >>> sorted(grads), grads["W"].shape, loss > 0
    (['W', 'b'], (1,), True)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.sparse import IndexedSlices

REQUIRED = ("name", "batch_size", "learning_rate", "init_params", "batch", "loss_and_grads")


class BenchModel:
    """Base class for bench models (see the module doc); subclasses fill in the methods."""

    name = "model"
    batch_size = 64
    learning_rate = 0.1
    #: The loss whose first crossing the bench times (None: half the first step's loss).
    target_loss = None
    #: ``test_accuracy(params, seed) -> float``, the accuracy on held-out data (None: the model has none).
    test_accuracy = None

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def batch(self, seed: int, replica: int, step: int, rows: int) -> tuple:
        raise NotImplementedError

    def loss_and_grads(self, params: dict, batch: tuple) -> tuple[float, dict]:
        raise NotImplementedError

    def sparse_rows(self, batch: tuple) -> dict[str, np.ndarray]:
        return {}


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# -- linear -----------------------------------------------------------------------------------------

class Linear(BenchModel):
    """y = 0.1 x + 0.3 learnt by W and b (TensorFlow's first tutorial). The learning rate leaves room
    for stale gradients: at 0.5 (the largest stable rate of one process) asynchronous workers diverge."""

    name, batch_size, learning_rate, target_loss = "linear", 100, 0.2, 0.002

    def init_params(self, seed):
        return {"W": _f32(_rng(seed, 1).uniform(-1.0, 1.0, 1)), "b": np.zeros(1, np.float32)}

    def batch(self, seed, replica, step, rows):
        x = _rng(seed, 2, replica, step).random(rows, dtype=np.float32)
        return x, _f32(x * 0.1 + 0.3)

    def loss_and_grads(self, params, batch):
        x, y = batch
        error = params["W"] * x + params["b"] - y
        return float(np.mean(error * error)), {"W": _f32(np.mean(2.0 * error * x, keepdims=True)),
                                               "b": _f32(np.mean(2.0 * error, keepdims=True))}


# -- mlp --------------------------------------------------------------------------------------------

def _softmax_xent(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy and its gradient with respect to the logits."""
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    probs = exp / exp.sum(axis=1, keepdims=True)
    rows = np.arange(len(labels))
    loss = float(-np.mean(np.log(probs[rows, labels] + 1e-12)))
    probs[rows, labels] -= 1.0
    return loss, probs / len(labels)


class MLP(BenchModel):
    """A 256-512-512-10 ReLU MLP classifying points by a fixed random linear teacher (compute-bound)."""

    name, batch_size, learning_rate, target_loss = "mlp", 256, 0.05, 2.2
    sizes = (256, 512, 512, 10)

    def init_params(self, seed):
        rng, params = _rng(seed, 3), {}
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            # He initialisation, but a small last layer so the first loss is ~log(10), not above it
            std = np.sqrt(2.0 / fan_in) if i < len(self.sizes) - 2 else 0.01
            params[f"w{i}"] = _f32(rng.normal(0.0, std, (fan_in, fan_out)))
            params[f"b{i}"] = np.zeros(fan_out, np.float32)
        return params

    def _teacher(self, seed):
        return _f32(_rng(seed, 4).normal(size=(self.sizes[0], self.sizes[-1])))

    def batch(self, seed, replica, step, rows):
        x = _f32(_rng(seed, 5, replica, step).normal(size=(rows, self.sizes[0])))
        return x, np.argmax(x @ self._teacher(seed), axis=1).astype(np.int64)

    def loss_and_grads(self, params, batch):
        x, labels = batch
        layers = len(self.sizes) - 1
        activations = [x]
        for i in range(layers):
            z = activations[-1] @ params[f"w{i}"] + params[f"b{i}"]
            activations.append(np.maximum(z, 0.0) if i < layers - 1 else z)
        loss, delta = _softmax_xent(activations[-1], labels)
        grads = {}
        for i in reversed(range(layers)):
            grads[f"w{i}"] = _f32(activations[i].T @ delta)
            grads[f"b{i}"] = _f32(delta.sum(axis=0))
            if i:
                delta = (delta @ params[f"w{i}"].T) * (activations[i] > 0)
        return loss, grads

    #: Points in the test set (drawn by their own key: no batch of any replica or step holds them).
    test_rows = 4096

    def test_accuracy(self, params, seed):
        x = _f32(_rng(seed, 11).normal(size=(self.test_rows, self.sizes[0])))
        labels = np.argmax(x @ self._teacher(seed), axis=1)
        layers = len(self.sizes) - 1
        for i in range(layers):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < layers - 1:
                x = np.maximum(x, 0.0)
        return float(np.mean(np.argmax(x, axis=1) == labels))


# -- wide -------------------------------------------------------------------------------------------

class Wide(BenchModel):
    """One 4096x512 linear layer fitted to a teacher on low-rank inputs: many parameters per FLOP."""

    name, batch_size, learning_rate, target_loss = "wide", 8, 20.0, 0.5
    inputs, outputs, rank = 4096, 512, 16

    def init_params(self, seed):
        return {"w": np.zeros((self.inputs, self.outputs), np.float32), "b": np.zeros(self.outputs, np.float32)}

    def _basis_and_teacher(self, seed):
        # Inputs live on a rank-16 subspace (unit norm on average), so SGD learns in a few steps
        # what a full-rank 4096-dimensional regression would take thousands of steps to.
        rng = _rng(seed, 6)
        basis = _f32(rng.normal(0.0, 1.0 / np.sqrt(self.inputs), (self.rank, self.inputs)))
        return basis, _f32(rng.normal(size=(self.inputs, self.outputs)))

    def batch(self, seed, replica, step, rows):
        basis, teacher = self._basis_and_teacher(seed)
        x = _f32(_rng(seed, 7, replica, step).normal(size=(rows, self.rank))) @ basis
        return x, x @ teacher

    def loss_and_grads(self, params, batch):
        x, y = batch
        error = x @ params["w"] + params["b"] - y
        scale = np.float32(2.0 / error.size)
        return float(np.mean(error * error)), {"w": _f32(x.T @ error * scale), "b": _f32(error.sum(axis=0) * scale)}


# -- embedding --------------------------------------------------------------------------------------

class Embedding(BenchModel):
    """Bags of ids from a skewed vocabulary, mean-pooled through a 100k x 16 embedding, then a linear
    score: a recommender's shape. Each step reads ~2K of the 100K rows (``sparse_rows``)."""

    name, batch_size, learning_rate, target_loss = "embedding", 64, 0.3, 0.07
    vocab, dim, bag = 100_000, 16, 8

    def init_params(self, seed):
        rng = _rng(seed, 8)
        return {"embedding": _f32(rng.normal(0.0, 0.1, (self.vocab, self.dim))),
                "head": _f32(rng.normal(0.0, 0.5, self.dim)), "bias": np.zeros(1, np.float32)}

    def _teacher(self, seed):
        return _f32(_rng(seed, 9).normal(size=self.vocab))

    def batch(self, seed, replica, step, rows):
        # Zipf-like ids: a few rows are read by most steps, the long tail rarely (as in real data).
        rng = _rng(seed, 10, replica, step)
        ids = np.minimum((rng.pareto(1.2, (rows, self.bag)) * 20).astype(np.int64), self.vocab - 1)
        return ids, _f32(self._teacher(seed)[ids].mean(axis=1))

    def sparse_rows(self, batch):
        return {"embedding": np.unique(batch[0])}

    def loss_and_grads(self, params, batch):
        ids, y = batch
        rows = np.unique(ids)
        slot = np.searchsorted(rows, ids)                  # position of each id among the rows read
        table = params["embedding"]                         # the rows ``sparse_rows`` named, in order
        pooled = table[slot].mean(axis=1)                   # (batch, dim)
        error = pooled @ params["head"] + params["bias"][0] - y
        scale = np.float32(2.0 / len(y))
        d_pooled = np.outer(error * scale, params["head"]) / np.float32(self.bag)
        d_table = np.zeros_like(table)
        np.add.at(d_table, slot.ravel(), np.repeat(d_pooled, self.bag, axis=0))
        return float(np.mean(error * error)), {"embedding": d_table,
                                               "head": _f32(pooled.T @ error * scale),
                                               "bias": _f32([error.sum() * scale])}


BUILTIN: dict[str, Callable[[], Any]] = {"linear": Linear, "mlp": MLP, "wide": Wide, "embedding": Embedding}


def build_model(spec: str) -> Any:
    """A built-in model by name, or ``package.module:build`` called with no arguments; checked for the
    interface, with an error naming what is missing."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"unknown model {spec!r}: use one of {', '.join(BUILTIN)}, or "
                                 f"package.module:build for your own (see stratagem.bench.models)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r} for --model {spec}: {exc} "
                                 f"(is it on PYTHONPATH?)") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigurationError(f"--model {spec}: {module_name} has no callable {attr!r}")
    model = factory()
    missing = [name for name in REQUIRED if not hasattr(model, name)]
    if missing:
        raise ConfigurationError(f"--model {spec}: the model lacks {', '.join(missing)} "
                                 f"(see the interface in stratagem.bench.models)")
    if not hasattr(model, "sparse_rows"):
        model.sparse_rows = lambda batch: {}
    if not hasattr(model, "target_loss"):
        model.target_loss = None
    if not hasattr(model, "test_accuracy"):
        model.test_accuracy = None
    return model


def step_values(variables: dict, rows: dict) -> dict:
    """What one training step reads of ``variables`` (strategy variables): the rows ``rows`` (the
    batch's ``sparse_rows``) names of a sparse parameter, gathered where the variable can (from the ps
    tasks), else indexed; every other parameter whole."""
    values = {}
    for name, var in variables.items():
        if name in rows:
            gather = getattr(var, "gather", None)
            values[name] = gather(rows[name]) if gather is not None else var.value[rows[name]]
        else:
            values[name] = var.value
    return values


def gradient_pairs(variables: dict, rows: dict, grads: dict) -> list:
    """``(gradient, variable)`` pairs in name order for ``apply_gradients``; the row gradients of a
    sparse parameter as ``IndexedSlices`` (which the parameter servers move as rows)."""
    pairs = []
    for name in sorted(variables):
        grad, var = grads[name], variables[name]
        if name in rows:
            grad = IndexedSlices(grad, rows[name], var.shape)
        pairs.append((grad, var))
    return pairs
