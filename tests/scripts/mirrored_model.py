"""A small numpy MLP (64-32-10, tanh, softmax cross-entropy) with a hand-written backward pass.

Shared by tests/test_mirrored.py and the worker script mirrored_train.py, so that a single process
and N mirrored replicas train exactly the same model on exactly the same global batches.
"""

from __future__ import annotations

import numpy as np

import stratagem

SIZES = (64, 32, 10)
NUM_EXAMPLES = 300
PARAM_NAMES = ("w1", "b1", "w2", "b2")


def dataset(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic classification data: labels from a random linear teacher (float32 inputs)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NUM_EXAMPLES, SIZES[0])).astype(np.float32)
    teacher = rng.standard_normal((SIZES[0], SIZES[2])).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=1)


def global_batch(step: int, batch_size: int, data=None) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of training step ``step`` (0-based): consecutive rows, wrapping around."""
    x, y = data if data is not None else dataset()
    rows = (np.arange(batch_size) + step * batch_size) % len(x)
    return x[rows], y[rows]


def global_batches(start: int, stop: int, batch_size: int):
    data = dataset()
    return (global_batch(step, batch_size, data) for step in range(start, stop))


def initial_params(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n_in, n_hidden, n_out = SIZES
    return {
        "w1": (rng.standard_normal((n_in, n_hidden)) / np.sqrt(n_in)).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(n_hidden)).astype(np.float32),
        "w2": (rng.standard_normal((n_hidden, n_out)) / np.sqrt(n_hidden)).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(n_out)).astype(np.float32),
    }


def loss_and_grads(params: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Mean cross-entropy over the rows of ``x`` and its gradients (zeros for an empty shard)."""
    w1, b1, w2, b2 = (np.asarray(params[name]) for name in PARAM_NAMES)
    n = len(x)
    h = np.tanh(x @ w1 + b1)
    logits = h @ w2 + b2
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    if n == 0:
        return 0.0, {name: np.zeros_like(np.asarray(params[name])) for name in PARAM_NAMES}
    loss = float(-np.mean(np.log(p[np.arange(n), y])))
    d_logits = p
    d_logits[np.arange(n), y] -= 1.0
    d_logits /= np.float32(n)
    d_h = (d_logits @ w2.T) * (1.0 - h * h)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(axis=0), "w2": h.T @ d_logits, "b2": d_logits.sum(axis=0)}
    return loss, {name: g.astype(np.float32, copy=False) for name, g in grads.items()}


def make_optimizer(kind: str):
    if kind == "sgd":
        return stratagem.optimizers.SGD(learning_rate=0.2, momentum=0.9)
    if kind == "adam":
        return stratagem.optimizers.Adam(learning_rate=0.01)
    if kind == "adagrad":
        return stratagem.optimizers.Adagrad(learning_rate=0.1)
    raise ValueError(f"unknown optimizer {kind!r}")


def create(optimizer: str = "sgd", seed: int = 1):
    """The model's variables (in the active strategy scope, if any) and its optimizer."""
    params = {name: stratagem.Variable(value, name=name) for name, value in initial_params(seed).items()}
    return params, make_optimizer(optimizer)


def train_step(params: dict, opt, x, y) -> float:
    loss, grads = loss_and_grads({name: var.value for name, var in params.items()}, x, y)
    opt.apply_gradients([(grads[name], params[name]) for name in PARAM_NAMES])
    return loss


def reference(steps: int, batch_size: int, optimizer: str = "sgd") -> dict[str, np.ndarray]:
    """One process, no strategy, trained on whole global batches: what the replicas must match."""
    params, opt = create(optimizer)
    for x, y in global_batches(0, steps, batch_size):
        train_step(params, opt, x, y)
    return {name: var.numpy() for name, var in params.items()}
