"""``stratagem.nn``: TF's loss helper for the custom training loop (``tf.nn.compute_average_loss``).

TF scales each replica's loss by the *global* batch because its strategies *sum* the replicas'
gradients; under Stratagem that is ``gradient_reduction="sum"``. ``compute_average_loss`` under a
strategy whose gradient reduction is the default ``"mean"`` raises instead of training at 1/N the rate
(README: "Coming from tf.distribute"; :class:`stratagem.strategies.distribute.LossScaling`).

>>> import numpy as np
>>> float(compute_average_loss(np.array([1.0, 2.0, 3.0]), global_batch_size=6))
1.0
"""

from __future__ import annotations

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.strategies.distribute import replica_strategy
from stratagem.training.variables import current_strategy

__all__ = ["compute_average_loss"]


def compute_average_loss(per_example_loss, global_batch_size=None, sample_weight=None):
    """The sum of ``per_example_loss`` (times ``sample_weight``) divided by the global batch size.

    ``per_example_loss`` is this replica's losses, one per example (numpy, PyTorch or JAX: the result
    is of the same kind, so autograd follows it). ``global_batch_size`` defaults to the rows of the
    global batch this replica's data came from (``distribute_dataset``), else to this replica's rows
    times ``num_replicas_in_sync`` (TF's default). Called in a step of a strategy (``strategy.run``, or
    in ``scope()``), that strategy must sum the gradients (``gradient_reduction="sum"``), else this
    raises ``ConfigurationError`` naming the fix; alone, it just computes.
    """
    strategy = replica_strategy() or current_strategy()
    if not hasattr(strategy, "note_average_loss"):   # no strategy, or an in_graph replica's stand-in
        strategy = None
    loss = per_example_loss if hasattr(per_example_loss, "shape") else np.asarray(per_example_loss, np.float64)
    if sample_weight is not None:
        weight = sample_weight if hasattr(sample_weight, "shape") else np.asarray(sample_weight)
        loss = loss * weight
    if strategy is not None:
        strategy.note_average_loss()
    if global_batch_size is None:
        global_batch_size = _default_global_batch(loss, strategy)
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, float, np.integer,
                                                                                 np.floating)) \
            or not global_batch_size > 0:
        raise ConfigurationError(f"global_batch_size must be a number > 0 (the examples in the global batch), "
                                 f"got {global_batch_size!r}")
    total = loss.sum()
    if global_batch_size == 0:       # an empty shard of an empty batch: nothing to average
        return total
    return total / global_batch_size


def _default_global_batch(loss, strategy) -> int:
    shape = tuple(loss.shape)
    if not shape:
        raise ConfigurationError("compute_average_loss needs per-example losses (an array with one row per "
                                 "example), got a scalar; pass the losses before reducing them, or give "
                                 "global_batch_size=")
    rows = int(shape[0])
    if strategy is None:
        return rows
    return strategy.global_batch_rows(rows)
