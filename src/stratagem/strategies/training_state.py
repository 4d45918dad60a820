"""What a replica's training has reached, shared by a strategy and the helpers it hands it to.

A :class:`TrainingState` is the narrow collaborator between a strategy (which owns it:
``strategy.training_state``) and the objects that read or roll back a replica's progress without
reaching into the strategy: elastic training (:mod:`stratagem.strategies.mirrored.elastic`) copies
and restores it at commits, ``in_graph``'s client (:mod:`stratagem.strategies.in_graph.client`) counts
the steps it applies and reads the variables' stores.

    >>> state = TrainingState()
    >>> state.step += 1
    >>> state.step, state.variables, state.optimizers, state.batch_share
    (1, {}, [], None)
"""

from __future__ import annotations

from typing import Any


class TrainingState:
    """A replica's variables, optimizers, update count and batch share (see the module doc).

    Attributes:
        variables: ``name -> Variable``, in creation order (the strategy adds each one created in its
            ``scope()``).
        optimizers: the optimizers seen (registered or applied), in order.
        step: the updates applied through the strategy (what ``save`` stores and ``restore`` returns).
        batch_share: this replica's share of the last global batch ``distribute_dataset`` yielded
            (its rows over the batch's), or ``None``: every replica counts the same.
    """

    __slots__ = ("variables", "optimizers", "step", "batch_share")

    def __init__(self) -> None:
        self.variables: dict[str, Any] = {}
        self.optimizers: list = []
        self.step = 0
        self.batch_share: float | None = None
