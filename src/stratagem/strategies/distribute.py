"""tf.distribute's names on every strategy (README: "Coming from tf.distribute").

What ``Strategy`` needs to offer TensorFlow's custom-training-loop API, kept apart from the base's
own machinery:

- :class:`ReduceOp` (``stratagem.ReduceOp.SUM`` / ``MEAN``), accepted wherever an op string is;
- :class:`PerReplica`, the replicas' values of a step that ran on several (``in_graph``'s ``run``);
- :class:`InputContext`, what ``distribute_datasets_from_function`` hands the dataset function, and
  :class:`DistributedDataset`, what it and ``experimental_distribute_dataset`` return (iterable per epoch);
- :func:`local_reduction` / :func:`finish_reduction`: ``strategy.reduce(op, value, axis=k)``, a
  reduction along an axis within each replica first, then across the replicas;
- :func:`as_host` / :func:`like_input`: a torch tensor goes in, a torch tensor comes out (torch is
  never imported here: only a tensor the caller already holds is recognised);
- :class:`LossScaling`: the rule that keeps TF's loss idiom and the strategy's gradient reduction
  from disagreeing silently (see its doc).

>>> ReduceOp.SUM == "sum", ReduceOp("mean") is ReduceOp.MEAN
(True, True)
>>> InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=2).get_per_replica_batch_size(64)
32
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import sys
import warnings
from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError

#: The values of the ``gradient_reduction`` option every strategy takes.
GRADIENT_REDUCTIONS = ("mean", "sum")

#: The strategy whose ``run`` is calling the step in this context (TF's replica context).
_REPLICA_STRATEGY: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_replica", default=None)


@contextlib.contextmanager
def replica_context(strategy):
    """Make ``strategy`` the one whose step runs in this ``with`` block (``Strategy.run`` uses it)."""
    token = _REPLICA_STRATEGY.set(strategy)
    try:
        yield strategy
    finally:
        _REPLICA_STRATEGY.reset(token)


def replica_strategy():
    """The strategy running the current step (inside ``strategy.run``), else ``None``.

    >>> replica_strategy() is None
    True
    """
    return _REPLICA_STRATEGY.get()


class ReduceOp(str, enum.Enum):
    """How ``strategy.reduce`` combines the replicas' values (TF's ``tf.distribute.ReduceOp``).

    A ``str`` enum: ``ReduceOp.SUM`` and ``"sum"`` are interchangeable everywhere an op is taken
    (``strategy.reduce``, ``comm.allreduce``); the strings ``"min"``, ``"max"`` and ``"prod"`` work too.
    """

    SUM = "sum"
    MEAN = "mean"

    def __str__(self) -> str:
        return f"ReduceOp.{self.name}"


class InputContext:
    """What ``strategy.distribute_datasets_from_function(fn)`` passes to ``fn`` (TF's
    ``tf.distribute.InputContext``): which input pipeline this replica runs, of how many.

    Every replica task runs one pipeline (``input_pipeline_id`` is its rank, ``num_input_pipelines``
    the number of replicas): ``fn`` builds this replica's part of the data, batched per replica
    (``get_per_replica_batch_size(global_batch_size)``), e.g. every ``num_input_pipelines``-th example
    from ``input_pipeline_id`` on.

    >>> ctx = InputContext(num_input_pipelines=3, input_pipeline_id=0, num_replicas_in_sync=3)
    >>> ctx.get_per_replica_batch_size(10)
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: the global batch size 10 is not divisible by num_replicas_in_sync 3; make it a multiple of 3 (e.g. 12), or use experimental_distribute_dataset, which splits uneven batches
    """

    __slots__ = ("num_input_pipelines", "input_pipeline_id", "num_replicas_in_sync")

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self.num_input_pipelines = int(num_input_pipelines)
        self.input_pipeline_id = int(input_pipeline_id)
        self.num_replicas_in_sync = int(num_replicas_in_sync)

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; an error if it does not divide evenly (as TF)."""
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, (int, np.integer)) \
                or global_batch_size < 1:
            raise ConfigurationError(f"global_batch_size must be an integer >= 1, got {global_batch_size!r}")
        n = self.num_replicas_in_sync
        if global_batch_size % n:
            raise ConfigurationError(
                f"the global batch size {global_batch_size} is not divisible by num_replicas_in_sync {n}; make "
                f"it a multiple of {n} (e.g. {-(-global_batch_size // n) * n}), or use "
                f"experimental_distribute_dataset, which splits uneven batches"
            )
        return int(global_batch_size) // n

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, num_replicas_in_sync={self.num_replicas_in_sync})")


class DistributedDataset:
    """What ``experimental_distribute_dataset`` and ``distribute_datasets_from_function`` return: an
    iterable that yields this replica's batches each time it is iterated (once per epoch, as TF's),
    as long as the dataset under it can be iterated again (a list can; a generator cannot).

    >>> ds = DistributedDataset(lambda: iter([1, 2]))
    >>> list(ds), list(ds)
    ([1, 2], [1, 2])
    """

    __slots__ = ("_batches",)

    def __init__(self, batches):
        self._batches = batches          # a function returning a fresh iterator of this replica's batches

    def __iter__(self):
        return self._batches()

    def __repr__(self) -> str:
        return "<DistributedDataset: this replica's batches>"


def check_gradient_reduction(value) -> str:
    """The ``gradient_reduction`` option, checked."""
    if value not in GRADIENT_REDUCTIONS:
        raise ConfigurationError(
            f"unknown gradient_reduction {value!r}; use 'mean' (the default: the replicas' gradients are "
            f"averaged, weighted by their rows: write the loss as a per-replica mean) or 'sum' (TF's "
            f"convention: they are summed: scale the loss by the global batch with "
            f"stratagem.nn.compute_average_loss)"
        )
    return value


class PerReplica:
    """What ``InGraphStrategy.run`` returns: each replica's value of the step, in replica order.

    ``values`` has one entry per replica that ran the step (a replica whose shard of the batch was
    empty does not run), ``rows`` how many rows of the batch each got (``None`` when the arguments
    held no batch) and ``replicas`` who they are. Combine the values with
    ``strategy.reduce(op, per_replica)``.

    >>> p = PerReplica([1.0, 3.0], rows=[3, 1], replicas=["cpu:0", "cpu:1"])
    >>> p.values, len(p)
    ((1.0, 3.0), 2)
    """

    __slots__ = ("values", "rows", "replicas")

    def __init__(self, values, rows=None, replicas=None):
        self.values = tuple(values)
        self.rows = None if rows is None else tuple(int(r) for r in rows)
        self.replicas = tuple(replicas if replicas is not None else (f"replica {i}" for i in range(len(self.values))))

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)

    def __repr__(self) -> str:
        parts = ", ".join(f"{who}: {value!r}" for who, value in zip(self.replicas, self.values))
        return f"PerReplica({{{parts}}})"


def local_results(value) -> tuple:
    """``experimental_local_results``: this task's replicas' values as a tuple (a :class:`PerReplica`'s
    values, else the value itself, alone).

    >>> local_results(3.0), local_results(PerReplica([1, 2]))
    ((3.0,), (1, 2))
    """
    if isinstance(value, PerReplica):
        return value.values
    return (value,)


# -- torch tensors through reduce: in as torch, out as torch ----------------------------------------

def is_torch_tensor(value) -> bool:
    """True for a ``torch.Tensor`` (torch is looked up, never imported: the caller holds a tensor)."""
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)   # None while torch is still importing
    return tensor is not None and isinstance(value, tensor)


def as_host(value):
    """``value`` as something the collectives take: a torch tensor becomes a numpy array (a copy on
    the host); anything else is returned as it is."""
    if is_torch_tensor(value):
        return value.detach().cpu().numpy()
    return value


def like_input(result, original):
    """``result`` of a reduction, as the kind of value the caller gave: a torch tensor of the
    original's dtype and device for a tensor, else ``result`` itself."""
    if not is_torch_tensor(original):
        return result
    torch = sys.modules["torch"]
    return torch.as_tensor(np.asarray(result)).to(dtype=original.dtype, device=original.device)


# -- reduce(op, value, axis=k) ------------------------------------------------------------------------

def check_axis(axis) -> int | None:
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ConfigurationError(f"axis must be None or an integer (the axis to reduce within each replica), "
                                 f"got {axis!r}")
    return int(axis)


def local_reduction(op: str, value, axis: int) -> tuple[Any, int]:
    """One replica's part of ``reduce(op, value, axis)``: ``value`` reduced along ``axis`` (a sum for
    ``sum`` and ``mean``) and how many elements that axis had, so that ``mean`` can divide the
    replicas' sums by their total count: the mean over the whole global batch, as TF's ``MEAN``.

    >>> local_reduction("mean", np.array([[1.0, 2.0], [3.0, 4.0]]), 0)
    (array([4., 6.]), 2)
    """
    array = np.asarray(value)
    if array.ndim == 0:
        raise ConfigurationError(f"reduce(..., axis={axis}) needs a value with that axis; got a scalar "
                                 f"(use axis=None to reduce a number across the replicas)")
    if not -array.ndim <= axis < array.ndim:
        raise ConfigurationError(f"axis {axis} is out of range for a value of shape {array.shape}")
    count = array.shape[axis]
    if op in ("sum", "mean"):
        dtype = array.dtype if np.issubdtype(array.dtype, np.floating) else np.float64 if op == "mean" else None
        return np.sum(array, axis=axis, dtype=dtype), count
    if count == 0:
        raise ConfigurationError(f"cannot take the {op} along axis {axis} of an empty replica value "
                                 f"(shape {array.shape}); reduce with 'sum' or 'mean'")
    return getattr(np, op)(array, axis=axis), count


def finish_reduction(op: str, reduced, total_count: int):
    """The replicas' combined :func:`local_reduction` parts: ``mean`` divides the sum by the count."""
    if op != "mean":
        return reduced
    if total_count == 0:
        raise ConfigurationError("reduce('mean', ..., axis=...) over no elements: every replica's value was empty")
    result = np.asarray(reduced) / total_count
    return result.astype(np.asarray(reduced).dtype, copy=False)


# -- the loss idiom and the gradient reduction ------------------------------------------------------

class LossScaling:
    """Keeps TF's loss idiom and a strategy's ``gradient_reduction`` from disagreeing silently.

    TF's custom training loop scales each replica's loss by the *global* batch
    (``tf.nn.compute_average_loss``) because its strategies *sum* the replicas' gradients. Stratagem's
    default (``gradient_reduction="mean"``) averages them, weighted by rows, for a per-replica *mean*
    loss. Mixed up, training silently runs at 1/N (or N times) the learning rate. The rule:

    - ``stratagem.nn.compute_average_loss`` under a strategy whose reduction is ``mean`` raises a
      ``ConfigurationError`` naming the fix (``gradient_reduction="sum"``), however many replicas;
    - under ``gradient_reduction="sum"``, the first gradients reduced over more than one replica warn
      once (``UserWarning``) if this task never called ``compute_average_loss``: a per-replica mean loss
      would train at N times the rate (ignore it when you divide by the global batch yourself).
    """

    def __init__(self, reduction: str):
        self.reduction = check_gradient_reduction(reduction)
        self.average_loss_seen = False
        self.warned = False

    def average_loss(self, strategy_name: str) -> None:
        """``compute_average_loss`` ran under this strategy: refuse it under ``mean``, else note it."""
        if self.reduction != "sum":
            raise ConfigurationError(
                f"stratagem.nn.compute_average_loss divides the loss by the global batch (TF's idiom), which is "
                f"right when the replicas' gradients are summed, but strategy {strategy_name!r} averages them "
                f"(gradient_reduction='mean', the default), so training would run at 1/N the rate: create it "
                f"with stratagem.strategy({strategy_name!r}, gradient_reduction='sum'), or keep the default and "
                f"use the per-replica mean loss (per_example_loss.mean())"
            )
        self.average_loss_seen = True

    def gradients_summed(self, replicas: int, strategy_name: str) -> None:
        """Gradients are about to be summed over ``replicas``: warn once if no loss was scaled."""
        if replicas > 1 and not self.average_loss_seen and not self.warned:
            self.warned = True
            warnings.warn(
                f"strategy {strategy_name!r} sums the {replicas} replicas' gradients (gradient_reduction='sum'), "
                f"but this task never called stratagem.nn.compute_average_loss: a loss that is a per-replica mean "
                f"trains at {replicas} times the rate. Scale it by the global batch "
                f"(compute_average_loss(per_example_loss, global_batch_size=...)), or use "
                f"gradient_reduction='mean' (ignore this if you divide by the global batch yourself)",
                UserWarning, stacklevel=4,
            )
