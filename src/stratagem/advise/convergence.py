"""What staleness and batch size cost in convergence: rows of data to the target loss, measured by
training the user's model in this process (``stratagem advise``'s convergence probe).

Throughput alone ranks an asynchronous setup too high: its workers never wait, but each applies a
gradient computed from values ``n - 1`` updates old, so it may need more data to reach the same
loss. A synchronous setup with ``n`` replicas applies one update per ``n`` batches (the global batch),
which may need more data too once the batch is large. So the probe trains the model for real, plain
SGD at its learning rate, and counts the rows each way takes to bring the loss to the target:

- ``sync`` with ``k`` replicas: every update is the mean gradient of ``k`` batches (replica ``r``'s
  batch ``t`` is the bench's, ``model.batch(seed, r, t, rows)``), as ``mirrored`` and the synchronous
  parameter servers apply it;
- ``async`` with ``k`` workers: worker ``t mod k`` draws its next batch and computes its gradient
  from the values as they were ``k - 1`` updates before (the staleness of round-robin workers), and the
  gradient is applied to the current values.

The target is crossed as ``stratagem bench`` sees it (:func:`stratagem.bench.measure.summarize`): when
the mean of the last ``k`` losses reported (one per replica; an async worker reports the loss of the
values it read) is at most the model's ``target_loss`` (else half its first loss). The
model is deterministic in its seed, so the figures are too. The cost model turns them into time to
the target (:func:`stratagem.advise.costmodel.time_to_target_s`).

    >>> from stratagem.bench.models import build_model
    >>> rows = rows_to_target(build_model("linear"), seed=0, mode="sync", k=1, target=0.002, max_rows=100_000)
    >>> 0 < rows <= 100_000
    True
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np


def _apply(params: dict, grads: dict, rows: dict, lr: float) -> None:
    """Plain SGD in place; a sparse parameter's gradient covers the rows its batch read."""
    for name, grad in grads.items():
        if name in rows:
            params[name][rows[name]] -= np.float32(lr) * grad
        else:
            params[name] -= np.float32(lr) * grad


def _values(params: dict, rows: dict) -> dict:
    """What a step reads: a sparse parameter's rows (copies), every other parameter whole."""
    return {name: value[rows[name]] if name in rows else value for name, value in params.items()}


def rows_to_target(model, seed: int, mode: str, k: int, target: float, max_rows: int) -> int | None:
    """Rows of data ``model`` takes to bring its loss to ``target`` with ``k`` replicas in ``mode``
    (``sync`` or ``async``, see the module doc); None if not within ``max_rows``, or if it diverged."""
    if mode not in ("sync", "async") or k < 1:
        raise ValueError(f"mode must be sync or async and k >= 1, got {mode!r}, {k}")
    with np.errstate(over="ignore", invalid="ignore"):   # a diverging run is an answer, not a warning
        return _train(model, seed, mode, k, target, max_rows)


def _train(model, seed: int, mode: str, k: int, target: float, max_rows: int) -> int | None:
    params = {name: np.array(value, dtype=np.float32) for name, value in model.init_params(seed).items()}
    lr, b = float(model.learning_rate), int(model.batch_size)
    losses: deque = deque(maxlen=k)   # the last k losses reported, as the bench's loss curve smooths
    read: deque = deque()      # async: the values each of the last k - 1 updates' readers saw
    used, update = 0, 0
    while used < max_rows:
        if mode == "sync":
            # Every replica's gradient from the same values, then their mean applied: one update.
            reported, shares = [], []
            for replica in range(k):
                batch = model.batch(seed, replica, update, b)
                batch_rows = model.sparse_rows(batch)
                loss, grads = model.loss_and_grads(_values(params, batch_rows), batch)
                reported.append(loss)
                shares.append((grads, batch_rows))
            for grads, batch_rows in shares:   # (a sparse gradient covers its own replica's rows)
                _apply(params, grads, batch_rows, lr / k)
            used += k * b
        else:
            worker, step = update % k, update // k
            batch = model.batch(seed, worker, step, b)
            batch_rows = model.sparse_rows(batch)
            # The values this worker read k - 1 updates ago: kept as copies when they were read.
            read.append(({n: v.copy() for n, v in _values(params, batch_rows).items()}, batch, batch_rows))
            if len(read) < k:
                update += 1
                continue
            values, batch, batch_rows = read.popleft()
            loss, grads = model.loss_and_grads(values, batch)
            reported = [loss]
            _apply(params, grads, batch_rows, lr)
            used += b
        if not all(np.isfinite(reported)):
            return None   # diverged: this staleness or batch does not converge at this learning rate
        losses.extend(reported)
        update += 1
        if sum(losses) / len(losses) <= target:
            return used
    return None


def target_of(model, seed: int) -> float:
    """The model's ``target_loss``, else half its first batch's loss at the initial values (the bench:
    half the first losses' mean)."""
    target = getattr(model, "target_loss", None)
    if target is not None:
        return float(target)
    batch = model.batch(seed, 0, 0, model.batch_size)
    params = model.init_params(seed)
    loss, _ = model.loss_and_grads(_values(params, model.sparse_rows(batch)), batch)
    return float(loss) / 2


def measure(model, seed: int, counts=(1, 2, 4, 8), budget_s: float = 5.0, max_updates: int = 2000) -> dict:
    """Rows to the target for ``k`` in ``counts``, sync and async, while the time spent stays under
    ``budget_s`` (a larger ``k`` costs more: the rest is then extrapolated by the cost model).
    Returns ``{"target_loss", "sync": [[k, rows or None], ...], "async": [...], "seconds"}``."""
    started = time.monotonic()
    target = target_of(model, seed)
    out = {"target_loss": target, "sync": [], "async": []}
    base = None
    for k in sorted(set(int(c) for c in counts)):
        if time.monotonic() - started > budget_s and out["sync"]:
            break
        # Runs longer than 20x the one-replica figure are cut: that staleness or batch does not converge here.
        limit = max_updates * model.batch_size if base is None else 20 * base
        for mode in ("sync", "async"):
            rows = rows_to_target(model, seed, mode, k, target, limit)
            out[mode].append([k, rows])
            if k == 1 and mode == "sync":
                base = rows
    out["seconds"] = time.monotonic() - started
    return out
