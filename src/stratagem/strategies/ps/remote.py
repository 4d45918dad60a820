"""This task's view of the variables on the ps tasks: the registry the parameter-server strategies
and their helpers share (README: "Parameter servers").

:class:`RemoteVariables` holds, for every variable created or adopted here, its pieces (where each
lives), its :class:`RemoteStore` (the local copy: the *cache*) and what is known of its staleness, and
it makes every exchange of values with the shards through the :class:`~stratagem.ps_service.client.PSClient`
it is given: the pulls a read needs, the rows a ``gather`` needs, the writes of ``assign``, and a
push's acknowledgements with the values they bring back. It keeps the job's global step and the
chief's stop as of the last exchange, and sets the strategy's optimizers' ``iterations`` to that step.

Staleness. ``stale``: the shards may have changed since this task last read from every one of them
(a sync push then asks for the current step first). ``current``: the variables whose caches hold the
values of the last exchange. ``sparse_read``: the variables read by rows since their last dense
read, which pulls and push replies leave out.

A variable's store is the only way to it (``var.value``, ``var.gather``, ``var.assign``): the store
calls the registry's public methods, and the registry never calls back into the strategy.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import numpy as np

from stratagem.compression.base import FLOAT_DTYPES
from stratagem.core.errors import ConfigurationError
from stratagem.ps_service.messages import PushReply, PushRequest
from stratagem.ps_service.protocol import piece_spec
from stratagem.ps_service.rows import fetch_rows, split_gradient
from stratagem.strategies.ps.cache import adoptable, write_into
from stratagem.training.sparse import IndexedSlices
from stratagem.training.variables import VariableStore, array_module, to_module


def piece_value(piece, array):
    """The part of ``array`` (a variable's value or gradient) that ``piece`` holds."""
    if piece.parts == 1:
        return array
    return array[piece.lo:piece.hi]


class RemoteStore(VariableStore):
    """A variable whose value lives on the ps tasks; ``cache`` is this task's copy of it.

    ``read()`` refreshes the cache from the shards if an update happened since the last pull, then
    returns it (the same buffer every time, updated in place). ``gather(rows)`` returns a new array of
    those rows, pulled from the shards that hold them (not the whole table). ``write()`` sends the
    value to the shards. Writing into the returned array changes only this task's copy.
    """

    live = False

    def __init__(self, registry: "RemoteVariables", name: str, cache):
        self.registry, self.name, self.cache = registry, name, cache

    def read(self):
        self.registry.read(self.name)
        return self.cache

    def gather(self, indices):
        return self.registry.gather(self.name, indices)

    def write(self, array) -> None:
        self.registry.assign(self.name, array)


class RemoteVariables:
    """The variables of this task that live on the shards (see the module doc).

    Args:
        client: this task's :class:`~stratagem.ps_service.client.PSClient`.
        optimizers: the strategy's optimizers (its own list): their ``iterations`` follow the global step.
        closed: says whether the strategy was shut down (then reads serve the caches as they are).
        read_only: an evaluator's: it reads afresh every time and may not assign.
        who: this task, named in errors.
    """

    def __init__(self, client, optimizers: list, *, closed: Callable[[], bool], read_only: bool = False,
                 who: str = "this task"):
        self.client = client
        self.optimizers = optimizers
        self.closed = closed
        self.read_only = read_only
        self.who = who
        #: Read afresh at every read (an evaluator; a coordinator, whose workers update the variables).
        self.always_pull = read_only
        self.variables: dict = {}                    # variable name -> Variable, in creation order
        self.pieces: dict[str, list] = {}            # variable name -> its pieces
        self.where: dict[str, tuple] = {}            # piece name -> (variable name, piece)
        self.initialized: set[str] = set()           # variables the shards hold and we pulled
        self.versions: dict[int, int] = {}           # shard index -> its step at our last pull/push
        self.stale = False
        self.current: set[str] = set()
        self.sparse_read: set[str] = set()
        #: The job's step (updates applied on ``ps:0``) and the chief's stop, as of the last exchange.
        self.global_step = 0
        self.stop = False

    # -- registering -------------------------------------------------------------------------------
    def add(self, variable, pieces: list) -> RemoteStore:
        """Register ``variable`` stored as ``pieces``; return its store (the variable's current value
        becomes the cache)."""
        self.variables[variable.name] = variable
        self.pieces[variable.name] = pieces
        for piece in pieces:
            self.where[piece.name] = (variable.name, piece)
            self.client.pieces.setdefault(piece.ps, []).append(piece.name)
        return RemoteStore(self, variable.name, variable.store.read())

    def owns(self, variable) -> bool:
        return self.variables.get(variable.name) is variable

    def cache(self, name: str):
        return self.variables[name].store.cache

    def specs_and_values(self, variables: Iterable) -> tuple[dict, dict]:
        """``({shard: [piece spec]}, {shard: [piece value]})`` of ``variables``, for ``init``."""
        specs, values = {}, {}
        for var in variables:
            cache = self.cache(var.name)
            for piece in self.pieces[var.name]:
                specs.setdefault(piece.ps, []).append(piece_spec(piece, var.shape, var.dtype))
                values.setdefault(piece.ps, []).append(to_module(piece_value(piece, cache), np))
        return specs, values

    # -- staleness -----------------------------------------------------------------------------------
    def mark_stale(self) -> None:
        """The variables may have changed on the shards (an update this task did not see the result of)."""
        self.stale = True
        self.current.clear()

    def fresh(self, name: str) -> bool:
        """True when the cache of ``name`` holds the shards' values as far as this task knows."""
        return not self.always_pull and name in self.current

    # -- reading -------------------------------------------------------------------------------------
    def read(self, name: str) -> None:
        """A dense read of ``name`` (``var.value``): refresh its cache if needed."""
        self.sparse_read.discard(name)
        if not self.closed() and name in self.initialized and not self.fresh(name):
            self.pull_dense()

    def pull_all(self) -> None:
        """Pull every piece of every variable (after initialisation, a restore)."""
        self.absorb(self.client.pull())
        self.current = set(self.initialized)

    def pull_dense(self) -> None:
        """One batched pull (one request per shard, all shards at once) of every variable that is not
        sparse-read: what a dense read of any of them refreshes."""
        dense = [name for name in self.variables if name in self.initialized and name not in self.sparse_read]
        if not self.sparse_read:
            replies = self.client.pull()
        else:
            names: dict[int, list] = {i: [] for i in range(self.client.num_shards)}  # every shard: its step
            for name in dense:
                for piece in self.pieces[name]:
                    names[piece.ps].append(piece.name)
            replies = self.client.pull(names)
        self.absorb(replies)
        self.current = set(dense)

    def gather(self, name: str, rows):
        """Rows ``rows`` (checked int64) of variable ``name``, a new array: from the cache when it is
        fresh, else pulled from the shards holding them (:func:`~stratagem.ps_service.rows.fetch_rows`).
        Makes ``name`` sparse-read."""
        var = self.variables[name]
        self.sparse_read.add(name)
        cache = var.store.cache
        xp = array_module(cache)
        if self.closed() or name not in self.initialized or self.fresh(name) or not len(rows):
            return cache[rows if xp is np else xp.asarray(rows)]
        out, replies = fetch_rows(self.client, self.pieces[name], rows, var.shape, var.dtype)
        for index, reply in replies.items():
            self.note(index, reply.meta)
        if len(replies) == self.client.num_shards:
            self.stale = False          # every shard told its step
        return to_module(out, xp)       # on the GPU for a cupy variable, as var.value is

    def absorb(self, replies: Mapping) -> None:
        """Copy the values in ``replies`` into the caches; record versions, the global step, stop."""
        for index, reply in replies.items():
            self.absorb_one(index, reply)
        self.stale = False

    def absorb_one(self, index: int, reply) -> None:
        """Copy the values of one reply (or part of one) of shard ``index`` into the caches."""
        meta = reply.meta
        for name, value in zip(meta.get("names") or [], reply.buffers):
            found = self.where.get(name)
            if found is None or found[0] not in self.initialized:
                continue
            var_name, piece = found
            store = self.variables[var_name].store
            if piece.parts == 1 and adoptable(value, store):
                store.cache = value   # no copy: the received buffer becomes this task's copy
            else:
                write_into(piece_value(piece, store.cache), value)
        self.note(index, meta)

    def note(self, index: int, meta: dict) -> None:
        """Record shard ``index``'s step (``ps:0``'s is the global step) and the chief's stop."""
        if "step" in meta:
            self.versions[index] = int(meta["step"])
            if index == 0:
                self.global_step = int(meta["step"])
                for optimizer in self.optimizers:    # the updates the shards applied: also on a
                    optimizer.iterations = self.global_step   # coordinator, whose steps run elsewhere
        if meta.get("stop"):
            self.stop = True

    def refresh(self) -> int:
        """Ask every shard for its status (one small round trip); return the global step."""
        for index, meta in self.client.hello().items():
            self.note(index, meta)
        return self.global_step

    # -- writing -------------------------------------------------------------------------------------
    def assign(self, name: str, array) -> None:
        """``var.assign``: the value goes into the cache and, once the shards hold the variable, to them."""
        cache = self.cache(name)
        if self.read_only and name in self.initialized:
            raise ConfigurationError(
                f"{self.who} is an evaluator: it reads the variables on the ps tasks but does not write them "
                f"(assign to {name!r} on a training task)"
            )
        write_into(cache, array)
        if name not in self.initialized:
            return  # before the chief declared it: this is (part of) the initial value
        by_shard: dict[int, tuple[list, list]] = {}
        for piece in self.pieces[name]:
            names, arrays = by_shard.setdefault(piece.ps, ([], []))
            names.append(piece.name)
            arrays.append(to_module(piece_value(piece, cache), np))
        self.client.assign(by_shard)

    # -- pushing -------------------------------------------------------------------------------------
    def requests(self, pairs: list, *, weight: float, pull: bool, compressor=None, states=None) -> dict:
        """Each shard's :class:`~stratagem.ps_service.messages.PushRequest` for the ``(gradient, variable)``
        ``pairs`` (every shard gets one, empty where it holds none of them, so every shard counts the
        step): dense gradients cut into their pieces (compressed with ``compressor``, each piece with
        its own error-feedback state in ``states``), ``IndexedSlices`` as rows of the pieces that hold
        them; with ``pull``, the tables read by rows are left out of the values sent back."""
        requests = {i: PushRequest(weight=weight, pull=pull, version=self.versions.get(i, 0))
                    for i in range(self.client.num_shards)}
        for grad, var in pairs:
            if not self.owns(var):
                raise ConfigurationError(f"variable {var.name!r} does not belong to this strategy")
            pieces = self.pieces[var.name]
            if isinstance(grad, IndexedSlices):     # merged by the optimizer: sorted, unique rows
                for piece, local, values in split_gradient(grad, pieces):
                    requests[piece.ps].add_rows(piece.name, local, values)
                continue
            grad = to_module(grad, np)
            for piece in pieces:
                requests[piece.ps].add(piece.name, piece_value(piece, grad))
        for name in self.sparse_read if pull else ():   # the replies leave out the tables read by rows
            for piece in self.pieces[name]:
                requests[piece.ps].skip.append(piece.name)
        if compressor is not None:
            for request in requests.values():
                if request.names:
                    request.compress(compressor, {name: states.get(name, grad.shape, grad.dtype)
                                                  for name, grad in zip(request.names, request.dense)
                                                  if grad.dtype in FLOAT_DTYPES})
        return requests

    def push(self, requests: Mapping[int, PushRequest], *, pull: bool) -> dict[int, PushReply]:
        """Send the pushes; with ``pull`` copy the values each answer brings into the caches as they
        arrive. Returns each shard's acknowledgement."""
        acks: dict[int, PushReply] = {}
        try:
            for index, message, last in self.client.push(requests):
                if pull:
                    self.absorb_one(index, message)
                elif last:
                    self.note(index, message.meta)
                if last:
                    acks[index] = PushReply.from_meta(message.meta)
        except BaseException:
            self.mark_stale()   # some parts of the replies may be copied in already: read afresh
            raise
        if pull:
            self.stale = False      # every reply was copied in as it arrived
            self.current = {n for n in self.initialized if n not in self.sparse_read}
        else:
            self.mark_stale()
        return acks
