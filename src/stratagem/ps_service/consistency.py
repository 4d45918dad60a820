"""The bookkeeping of the ``sync`` and ``bounded`` consistency modes, for the parameter server.

:class:`SyncRound` sums one sync step's gradients as they arrive (weighted by each replica's share of
the batch) and gives their weighted mean once enough replicas have pushed. :class:`StalenessGate`
keeps each replica's clock (its pushes) and holds the acknowledgement of a replica more than
``bound`` pushes ahead of the slowest active one. Neither talks to the network: the server
(:mod:`stratagem.ps_service.server`) decides when to apply and whom to answer.

    >>> import numpy as np
    >>> round_ = SyncRound()
    >>> round_.add("worker:0", ["w"], [np.ones(2, np.float32)], 3.0, "reply to worker:0")
    >>> round_.add("worker:1", ["w"], [np.full(2, 5.0, np.float32)], 1.0, "reply to worker:1")
    >>> names, grads = round_.mean()
    >>> names, grads[0]                       # (3 * 1 + 1 * 5) / 4
    (['w'], array([2., 2.], dtype=float32))
    >>> gate, both = StalenessGate(bound=1), ["worker:0", "worker:1"]
    >>> gate.pushed("worker:0", "a"); [w for w, *_ in gate.releasable(both)]    # 1 ahead: fine
    ['a']
    >>> gate.pushed("worker:0", "b"); [w for w, *_ in gate.releasable(both)]    # 2 ahead: held
    []
    >>> gate.pushed("worker:1", "c")
    >>> [(w, clock, floor) for w, _, clock, floor in gate.releasable(both)]
    [('b', 2, 1), ('c', 1, 1)]
"""

from __future__ import annotations

import math

import numpy as np

from stratagem.training.optimizers.rules import compute_dtype
from stratagem.ps_service.rows import add_rows, row_sum
from stratagem.training.sparse import IndexedSlices, densify


class SyncRound:
    """One sync step's gradients, summed as they arrive; ``waiters`` are answered when it is applied.

    A piece whose gradients come as rows (:class:`~stratagem.training.sparse.IndexedSlices`) is summed as
    rows (each row's terms added in arrival order, as the dense sum adds them, so the mean is the
    dense one bit for bit) and its mean is rows again; once a dense gradient of it comes, its sum is
    dense.
    """

    def __init__(self):
        self.count = 0
        self.weight = 0.0
        self.sums: dict[str, np.ndarray] = {}
        self.order: list[str] = []
        #: ``(waiter, replica)`` of every push in the round, in arrival order.
        self.waiters: list[tuple] = []

    def add(self, who: str, names: list[str], grads: list, weight: float, waiter) -> None:
        """Add one replica's gradients with its ``weight`` (its share of the global batch, or 1)."""
        self.count += 1
        self.weight += weight
        self.waiters.append((waiter, who))
        if weight == 0:
            return
        for name, grad in zip(names, grads):
            dtype = compute_dtype(grad.dtype if np.dtype(grad.dtype).kind == "f" else np.float32)
            total = self.sums.get(name)
            if total is None:
                self.order.append(name)
            if isinstance(grad, IndexedSlices):
                self.sums[name] = add_rows(total, grad, weight, dtype)
                continue
            scaled = np.multiply(grad, dtype.type(weight), dtype=dtype)
            if total is None:
                self.sums[name] = scaled
            else:
                if isinstance(total, IndexedSlices):
                    total = self.sums[name] = densify(total)
                total += scaled

    def mean(self) -> tuple[list[str], list]:
        """The pieces and their weighted mean gradients (nothing when every weight was 0)."""
        if self.weight <= 0:
            return [], []
        grads = []
        for name in self.order:
            total = self.sums[name]
            if isinstance(total, IndexedSlices):
                grads.append(row_sum(total, None if self.weight == 1.0 else self.weight))
                continue
            if self.weight != 1.0:
                total /= total.dtype.type(self.weight)
            grads.append(total)
        return list(self.order), grads


class StalenessGate:
    """Replicas' clocks and the acknowledgements held back by the staleness bound."""

    def __init__(self, bound: int):
        self.bound = bound
        self.clocks: dict[str, int] = {}
        self.held: list[tuple] = []          # (waiter, replica)
        #: The largest ``clock - slowest`` at which an acknowledgement was released.
        self.max_gap = 0

    def pushed(self, who: str, waiter) -> None:
        """``who`` pushed (already applied): count it and hold its acknowledgement until released."""
        self.clocks[who] = self.clocks.get(who, 0) + 1
        self.held.append((waiter, who))

    def releasable(self, active: list[str]) -> list[tuple]:
        """Remove and return ``(waiter, replica, clock, slowest)`` for every held acknowledgement now
        within the bound of the slowest ``active`` replica (``slowest`` is None without any)."""
        floor = min((self.clocks.get(p, 0) for p in active), default=math.inf)
        released, keep = [], []
        for waiter, who in self.held:
            clock = self.clocks.get(who, 0)
            if clock - floor <= self.bound or who not in active:
                if floor != math.inf:
                    self.max_gap = max(self.max_gap, clock - int(floor))
                released.append((waiter, who, clock, None if floor == math.inf else int(floor)))
            else:
                keep.append((waiter, who))
        self.held = keep
        return released

    def release_all(self) -> list[tuple]:
        """Remove and return ``(waiter, replica, clock)`` of every held acknowledgement."""
        released = [(waiter, who, self.clocks.get(who, 0)) for waiter, who in self.held]
        self.held = []
        return released
