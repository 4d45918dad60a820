"""Double buffering of a parameter server's values: replies are sent from the values themselves,
without a copy and without waiting, and an update never writes into an array a reply still reads.

The common case needs none of it: an update written over the received gradient (:func:`takes_over`)
makes that buffer the piece's array and only reads the old one. What follows is for the rest
(assignments, checkpoint loads, row updates, rules that cannot write over their gradient).

A reply hands the transport the piece arrays by reference (``send_async``); ZeroMQ may read them for
milliseconds after the call returns (40 MB take ~10 ms on loopback). Waiting for that before the next
request held the server idle, and copying the values into the reply cost a full extra pass over the
memory. Instead :class:`ReplyBuffers` remembers which arrays unfinished sends read. When the next
update (or an ``assign``/``load``) of a piece finds its current array still being read, it writes
the new version into another array of the piece (a *spare*), and that one becomes current. The
update then costs no more than in place: it reads the old version and writes the new one, as an
in-place update reads and writes the same array.

So a reply always carries exactly the version that was current when it was made (one version of
every piece, never a torn mix), and the number of arrays per piece is bounded by
:data:`MAX_VERSIONS`: past it, the server waits for the oldest send that holds one.

    >>> import numpy as np
    >>> from stratagem.core.transport import SendHandle
    >>> class Pending(SendHandle):                 # a send that ZeroMQ has not finished
    ...     finished = False
    ...     def done(self): return self.finished
    ...     def wait(self, timeout=None): self.finished = True
    >>> buffers, value, reply = ReplyBuffers(), np.zeros(3), Pending()
    >>> buffers.sent(reply, [value])
    >>> target = buffers.target("w", value)       # the reply still reads ``value``: a spare
    >>> target is value, buffers.busy(value)
    (False, True)
    >>> buffers.retire("w", value)                 # ``target`` is now current, ``value`` a spare
    >>> reply.finished = True; buffers.prune()
    >>> buffers.target("w", target) is target     # nothing reads it: update in place
    True
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from stratagem.core.errors import TransportTimeout
from stratagem.core.transport import SendHandle
from stratagem.training.sparse import IndexedSlices, densify

log = logging.getLogger(__name__)

#: Arrays one piece may have at once (the current one and those unfinished replies read). Two cover
#: the steady state of any number of workers that each wait for their reply before pushing again;
#: the third lets a reply to a slow reader overlap the next two updates.
MAX_VERSIONS = 3


def takes_over(grad, value, optimizer) -> bool:
    """True when a push's gradient buffer may receive the update and become the piece's array: a
    writable, aligned, C-contiguous numpy array of the value's shape and dtype (received, so this
    task's own: the transport contract), and an optimizer whose rule may write over the gradient
    (``writes_over_gradient``). Then nothing the update writes is read by an unfinished reply."""
    return (type(grad) is np.ndarray and type(value) is np.ndarray and grad.dtype == value.dtype
            and grad.shape == value.shape and grad.flags.writeable and grad.flags.c_contiguous
            and grad.flags.aligned and optimizer.writes_over_gradient)


class ReplyBuffers:
    """Which value arrays unfinished sends read, and the spare arrays of each piece.

    Args:
        timeout: seconds to wait for a send when a piece has :data:`MAX_VERSIONS` arrays all being
            read (then, with a warning, one more array is allocated rather than failing).
    """

    def __init__(self, timeout: float | None = None):
        self.timeout = timeout
        self._pending: list[tuple[SendHandle, tuple]] = []    # unfinished sends, oldest first
        # id(array) -> how many unfinished sends read it (the arrays are kept alive by _pending, so
        # their ids stay theirs): a lookup per piece, however many pieces and replies are in flight.
        self._readers: dict[int, int] = {}
        self._spares: dict[str, list[np.ndarray]] = {}
        #: Arrays allocated because the current one was being read (for tests and operators).
        self.allocated = 0

    def sent(self, handle: SendHandle, arrays: Sequence) -> None:
        """A send of ``arrays`` started; until ``handle`` is done they must not change."""
        if arrays and not handle.done():
            self._pending.append((handle, tuple(arrays)))
            for array in arrays:
                self._readers[id(array)] = self._readers.get(id(array), 0) + 1

    def busy(self, array) -> bool:
        """True if a send that was unfinished at the last :meth:`prune` reads ``array`` (a send that
        finished since only makes an update use a spare: never wrong, and a lookup per piece, not a
        look at every unfinished send)."""
        return id(array) in self._readers

    def target(self, name: str, value: np.ndarray) -> np.ndarray:
        """The array the next version of piece ``name`` (now ``value``) is to be written into:
        ``value`` itself when no send reads it, else a spare that none reads (allocated if needed).
        After writing into a spare, call :meth:`retire` with ``value``."""
        if not self.busy(value):
            return value
        spares = self._spares.setdefault(name, [])
        for index, spare in enumerate(spares):
            if not self.busy(spare):
                return spares.pop(index)
        if 1 + len(spares) >= MAX_VERSIONS and self._wait_for(spares):
            self.prune()
            for index, spare in enumerate(spares):
                if not self.busy(spare):
                    return spares.pop(index)
        self.allocated += 1
        return np.empty_like(value)

    def retire(self, name: str, old: np.ndarray) -> None:
        """``old`` is no longer piece ``name``'s current array: keep it as a spare."""
        self._spares.setdefault(name, []).append(old)

    def wait_all(self, timeout: float | None = None) -> None:
        """Wait (best effort, ``timeout`` seconds in all) for every unfinished send, e.g. before the
        transport closes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle, _ in self._pending:
            try:
                handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - a send that cannot finish must not block shutdown
                log.debug("a reply did not finish sending: %s", exc)
        self._pending, self._readers = [], {}

    def prune(self) -> None:
        """Forget the sends that have finished (the server calls it once per request)."""
        if not self._pending:
            return
        keep = []
        for handle, arrays in self._pending:
            if not handle.done():
                keep.append((handle, arrays))
                continue
            for array in arrays:
                left = self._readers.pop(id(array)) - 1
                if left:
                    self._readers[id(array)] = left
        self._pending = keep

    def _wait_for(self, spares: list) -> bool:
        """Wait for the oldest send that reads one of ``spares``; False if it timed out."""
        for handle, arrays in self._pending:
            if any(a is s for a in arrays for s in spares):
                try:
                    handle.wait(self.timeout)
                    return True
                except TransportTimeout:
                    log.warning("a reply has not finished sending within %s s; allocating another "
                                "buffer for the next version", self.timeout)
                    return False
        return True


class PieceValues:
    """The arrays of the pieces a ps task holds, and every write into them: the optimizer's updates
    (dense, written over the gradient where :func:`takes_over` allows; row gradients on the rows
    alone for an exact rule, densified for the others), assignments and checkpoint loads. A new
    version never goes into an array an unfinished reply reads (``replies``: spares instead).

    Reads are by name (``values[name]``); the server sends replies from these arrays and tells
    ``replies`` about each send.
    """

    def __init__(self, replies: ReplyBuffers):
        self.replies = replies
        self._arrays: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __contains__(self, name: object) -> bool:
        return name in self._arrays

    def create(self, name: str, value, dtype) -> None:
        """Piece ``name`` starts as a C-ordered copy of ``value`` of ``dtype``."""
        self._arrays[name] = np.array(value, dtype=dtype, copy=True, order="C")

    def assign(self, name: str, value) -> None:
        """Piece ``name`` becomes ``value`` (cast as numpy's ``same_kind`` allows)."""
        self._replace(name, lambda old, target: np.copyto(target, value, casting="same_kind"))

    def update(self, optimizer, name: str, grad) -> None:
        """``optimizer``'s update of piece ``name`` with ``grad`` (an array or an
        :class:`~stratagem.training.sparse.IndexedSlices` of rows: :mod:`stratagem.ps_service.rows`)."""
        if isinstance(grad, IndexedSlices):
            if optimizer.sparse_exact:
                # The rows alone, the dense update's result. In place when no reply reads the piece
                # (the steady state of a table read only through ``gather``: row replies are fresh
                # copies); else the old version copied into a spare first, a pass over the piece, no
                # more than the dense update costs. Waiting for that reply instead would hold every
                # other request on one slow reader.
                if len(grad.indices):         # a zero gradient leaves an exact rule's values as they are
                    old = self._arrays[name]
                    target = self.replies.target(name, old)
                    if target is not old:
                        np.copyto(target, old)
                    optimizer.update_rows(name, target, grad.indices, grad.values)
                    self._make_current(name, old, target)
                return
            grad = densify(grad)              # a rule that moves every row: the dense update
        old = self._arrays[name]
        if takes_over(grad, old, optimizer):
            # The new values are written over the received gradient, which becomes the piece's array:
            # the old one is only read (a reply may still be sending it), no spare is written (a
            # quarter less memory traffic than updating into one), nothing waits.
            optimizer.update_array(name, old, grad, out=grad)
            self._arrays[name] = grad
            return
        target = self.replies.target(name, old)
        optimizer.update_array(name, old, grad, out=None if target is old else target)
        self._make_current(name, old, target)

    def _replace(self, name: str, write) -> None:
        old = self._arrays[name]
        target = self.replies.target(name, old)
        write(old, target)
        self._make_current(name, old, target)

    def _make_current(self, name: str, old: np.ndarray, target: np.ndarray) -> None:
        if target is not old:
            self._arrays[name] = target
            self.replies.retire(name, old)
