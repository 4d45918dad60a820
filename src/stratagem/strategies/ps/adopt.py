"""On a ``parameter_server`` worker: the coordinator's variables, adopted from the shards' catalog.

A worker creates no variables of its own: a closure names the coordinator's (by name, with how many
there are), and :class:`Adoption` makes this task's remote copies of them from the catalog the shards
keep (each piece's spec: shape, dtype, part, rows), registered in the worker's
:class:`~stratagem.strategies.ps.remote.RemoteVariables` like any variable created in ``scope()``. It
also rebuilds the optimizers a closure names from their config, in the strategy's scope.
"""

from __future__ import annotations

import time

import numpy as np

from stratagem.core.errors import StratagemError, TransportTimeout
from stratagem.ps_service.placement import Piece
from stratagem.ps_service.protocol import spec_dtype
from stratagem.training.optimizers.rules import from_config
from stratagem.training.variables import Variable, strategy_scope

#: Seconds between polls of the shards' catalog while the coordinator's variables are not all there.
POLL = 0.1


class Adoption:
    """The coordinator's variables on this worker (see the module doc).

    Args:
        strategy: the worker's strategy (the scope the copies are created in).
        remote: its :class:`~stratagem.strategies.ps.remote.RemoteVariables`.
        timeout: seconds to wait for the coordinator's variables to appear on the shards.
    """

    def __init__(self, strategy, remote, *, timeout: float):
        self.strategy, self.remote, self.timeout = strategy, remote, timeout
        self.adopting: dict[str, list] = {}     # variable name -> its pieces, while it is being created

    def take(self, name: str) -> list | None:
        """The pieces of ``name`` when it is being adopted (the strategy's placement), else None."""
        return self.adopting.pop(name, None)

    def adopt(self, count: int) -> None:
        """Make remote copies of the coordinator's variables (at least ``count`` of them)."""
        if len(self.remote.variables) >= count:
            return
        deadline = time.monotonic() + self.timeout
        while True:
            catalogs = self.remote.client.catalog()
            groups: dict[str, list] = {}
            for index, meta in sorted(catalogs.items()):
                for spec in meta["vars"]:
                    groups.setdefault(spec["var"], []).append((index, spec))
            if all(meta["ready"] for meta in catalogs.values()) and len(groups) >= count:
                break
            if time.monotonic() > deadline:
                raise TransportTimeout(f"{self.strategy.task}: the coordinator's variables did not appear on the ps "
                                       f"tasks within {self.timeout:g} s")
            time.sleep(POLL)
        for name in sorted(groups):
            if name in self.remote.variables:
                continue
            pieces = sorted(groups[name], key=lambda item: item[1]["part"])
            spec = pieces[0][1]
            dtype = spec_dtype(spec)
            row = int(np.prod(spec["shape"][1:], dtype=np.int64)) * dtype.itemsize
            self.adopting[name] = [Piece(s["name"], name, index, s["part"], s["parts"], s["lo"], s["hi"],
                                         (s["hi"] - s["lo"]) * row) for index, s in pieces]
            with strategy_scope(self.strategy):
                Variable(np.zeros(tuple(spec["shape"]), dtype), name=name)
            self.remote.initialized.add(name)
        self.remote.mark_stale()

    def variable(self, name: str):
        """The variable ``name`` of the coordinator (adopted now if it is new)."""
        if name not in self.remote.variables:
            self.adopt(len(self.remote.variables) + 1)
        try:
            return self.remote.variables[name]
        except KeyError:
            raise StratagemError(f"{self.strategy.task} has no variable {name!r} (the coordinator did not "
                                 f"create it)") from None

    def optimizer(self, config: dict):
        """An optimizer of the strategy built from the coordinator's ``config``."""
        with strategy_scope(self.strategy):
            return from_config(config)
