"""The push and its acknowledgement as typed objects: built in one place, read in one place.

A worker builds one :class:`PushRequest` per shard (``add`` a dense gradient, ``add_rows`` a row
gradient, ``compress`` the dense ones), the client sends ``request.to_message()``, and the server
reads it back with :meth:`PushRequest.parse`, which checks every field of the metadata and names
what is wrong. The last part of the server's answer reads as a :class:`PushReply` (its status, the
shard's step, whether the chief asked to stop, the bounded-staleness clocks).

On the wire (:mod:`~stratagem.ps_service.protocol`, operation ``push``): ``names`` (the dense pieces, one
buffer each, or their compressed payloads with ``compression``), then ``rows`` (two buffers each: the
int64 rows counted from the piece's first row, and the gradient rows), ``weight`` (the pusher's share
of the batch), ``version`` (the step the worker read), ``pull`` (send the values back) and ``skip``
(pieces the values leave out).

    >>> import numpy as np
    >>> request = PushRequest(weight=0.5, pull=True, version=3)
    >>> request.add("w", np.ones(2, np.float32))
    >>> request.add_rows("t", np.array([1], np.int64), np.ones((1, 4), np.float32))
    >>> message = request.to_message()
    >>> message.meta["names"], message.meta["rows"], len(message.buffers)
    (['w'], ['t'], 3)
    >>> back = PushRequest.parse(message.meta, message.buffers)
    >>> back.names, back.row_names, back.weight, back.version, back.skip
    (['w'], ['t'], 0.5, 3, frozenset())
    >>> PushReply.from_meta({"status": "applied", "step": 4, "stop": False}).step
    4
"""

from __future__ import annotations

from dataclasses import dataclass

from stratagem.core.transport import Message
from stratagem.ps_service.compressed import compress_pieces
from stratagem.ps_service.protocol import RequestRefused

__all__ = ["PushRequest", "PushReply"]


class PushRequest:
    """One shard's push (see the module doc). ``skip`` lists the pieces the values sent back
    (``pull``) leave out; on the server it is a frozenset."""

    def __init__(self, *, weight: float = 1.0, pull: bool = False, version: int | None = None, skip=()):
        self.weight, self.pull, self.version = float(weight), bool(pull), version
        self.skip = list(skip)
        self.names: list[str] = []
        self.row_names: list[str] = []
        self.compression: dict | None = None
        self.dense: list = []          # one gradient per name, or their compressed payloads
        self.row_buffers: list = []    # rows, values of each row gradient

    def add(self, name: str, grad) -> None:
        """A dense gradient of piece ``name`` (a numpy array of the piece's shape)."""
        self.names.append(name)
        self.dense.append(grad)

    def add_rows(self, name: str, indices, values) -> None:
        """A row gradient of piece ``name``: int64 ``indices`` counted from its first row, and ``values``."""
        self.row_names.append(name)
        self.row_buffers += [indices, values]

    def compress(self, compressor, states) -> None:
        """Replace the dense gradients by ``compressor``'s payloads (:mod:`stratagem.ps_service.compressed`);
        ``states``: each piece's error-feedback state, by piece name."""
        self.compression, self.dense = compress_pieces(compressor, states, self.names, self.dense)

    def to_message(self) -> Message:
        meta = {"op": "push", "names": list(self.names), "weight": self.weight, "pull": self.pull}
        if self.row_names:
            meta["rows"] = list(self.row_names)
        if self.skip:
            meta["skip"] = list(self.skip)
        if self.compression is not None:
            meta["compression"] = self.compression
        if self.version is not None:
            meta["version"] = int(self.version)
        return Message(meta, self.dense + self.row_buffers)

    @classmethod
    def parse(cls, meta: dict, buffers) -> "PushRequest":
        """The request a server received, its fields checked (``RequestRefused`` naming the bad one).
        ``dense`` holds every buffer before the row gradients' (``2 * len(row_names)`` last ones)."""
        names, rows, skip = meta.get("names") or [], meta.get("rows") or [], meta.get("skip") or []
        for field, value in (("names", names), ("rows", rows), ("skip", skip)):
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise RequestRefused(f"push: {field} must be a list of piece names, got {value!r}")
        weight, version = meta.get("weight", 1.0), meta.get("version")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise RequestRefused(f"push: weight must be a number, got {weight!r}")
        buffers = list(buffers)
        if len(buffers) < 2 * len(rows):
            raise RequestRefused(f"push: {len(rows)} row gradient(s) need {2 * len(rows)} array(s) (a row "
                                 f"gradient is 2: rows, values), got {len(buffers)}")
        request = cls(weight=weight, pull=bool(meta.get("pull")), version=version)
        request.skip = frozenset(skip)
        request.names, request.row_names = list(names), list(rows)
        request.compression = meta.get("compression")
        cut = len(buffers) - 2 * len(rows)
        request.dense, request.row_buffers = buffers[:cut], buffers[cut:]
        return request


@dataclass(frozen=True)
class PushReply:
    """A shard's acknowledgement of a push: ``status`` (``applied``, ``dropped``, ``stopped``), its
    ``step``, ``stop`` (the chief asked to stop), and under ``bounded`` on ``ps:0`` the pusher's
    ``clock`` and the slowest's (``min_clock``)."""

    status: str | None
    step: int | None
    stop: bool
    clock: int | None = None
    min_clock: int | None = None

    @classmethod
    def from_meta(cls, meta: dict) -> "PushReply":
        step = meta.get("step")
        return cls(meta.get("status"), None if step is None else int(step), bool(meta.get("stop")),
                   meta.get("clock"), meta.get("min_clock"))
