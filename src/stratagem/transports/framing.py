"""Wire frames (``core/wire.py``) carried as a byte stream cut into gRPC messages.

Helpers of the ``grpc`` transport (:mod:`stratagem.transports.grpc.transport`); nothing here imports grpc.

A frame is the very same header, envelope and buffers that every byte-stream transport sends. On a
gRPC stream the concatenation of all frames is cut into messages of at most ``chunk_bytes`` (plus
up to :data:`HEAD_ROOM` bytes of a frame's head riding with the first piece of a large buffer), so
gRPC's per-message size limit never bites whatever the size of an array, and the receiver never
needs to trust a message boundary: :class:`Reassembler` accepts the stream split anywhere.

Sending (:func:`chunks`): gRPC's Python API takes each message as a ``bytes`` object, so each chunk
costs exactly one copy out of the caller's arrays (a slice of a ``memoryview``, or a join where a
chunk spans several parts); nothing else is copied.

Receiving (:class:`Reassembler`): the fixed header is parsed and checked against the limits first
(``wire.read_header``: kind, envelope and payload lengths), then the envelope (``wire.read_envelope``:
dtypes, shapes, that the buffers add up to the declared payload). The arrays (one per buffer,
aligned, writable, owned by the receiver) are then filled straight from the incoming messages, and
their memory is taken as their bytes arrive, never on the word of a header: a buffer is allocated
when its first byte comes, whole if it is at most :data:`WHOLE_BYTES`, else as an anonymous memory
map that grows (at most to twice what has arrived) as its bytes do. So a peer that declares 4 GiB
and sends nothing costs nothing, and one that sends slowly costs what it has sent. Growing a map
moves its pages (``mremap``) rather than copying them, so large buffers still cost one copy. A
connection that has not completed its handshake is held to tiny control-frame limits, so an
unauthenticated peer cannot make us allocate anything of size.

    >>> import numpy as np
    >>> from stratagem.core import wire
    >>> parts = wire.encode(wire.Kind.DATA, "t", {"k": 1}, [np.arange(10, dtype=np.int32)])
    >>> messages = list(chunks(parts, 16))
    >>> [len(m) for m in messages], sum(len(m) for m in messages) == sum(len(p) for p in parts)
    ([16, 16, 27, 16, 8], True)
    >>> got = []
    >>> r = Reassembler(wire.DEFAULT_LIMITS)
    >>> for m in messages:
    ...     r.feed(m, got.append)
    >>> got[0].tag, got[0].meta, got[0].buffers[0].tolist()
    ('t', {'k': 1}, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
"""

from __future__ import annotations

import mmap
from typing import Callable, Collection, Iterator, Sequence

import numpy as np

from stratagem.core import wire
from stratagem.core.errors import ProtocolError
from stratagem.transport_kit.acceptor import CONTROL_LIMITS  # noqa: F401 - the handshake's limits, used with the Reassembler
from stratagem.core.wire import HEADER_SIZE, Frame, Kind, Limits

#: The most bytes of a frame's head that ride with the first piece of a large buffer (see :func:`chunks`);
#: the receive limit (``grpc_config.MAX_RECEIVE_BYTES``) leaves room for them above the largest chunk.
HEAD_ROOM = 16 << 10
#: Buffers up to this size are allocated whole when their first byte arrives; larger ones grow as
#: their bytes arrive (see the module docstring).
WHOLE_BYTES = 32 << 20


def chunks(parts: Sequence, chunk_bytes: int, head_room: int = HEAD_ROOM) -> Iterator[bytes]:
    """Cut an encoded frame (``wire.encode``'s ``[head, buffer views...]``) into ``bytes`` messages;
    every byte is copied once, when its message is made.

    Small parts share a message of at most ``chunk_bytes``. A part that fits in a message of its
    own but not in what is left of the current one starts a new message, so it arrives whole. A
    part larger than ``chunk_bytes`` is cut into pieces of ``chunk_bytes``; the small parts before
    it (a frame's head) ride with its first piece if they add up to at most ``head_room`` bytes (a
    message of at most ``chunk_bytes + head_room``), else they fill what is left of their message.
    So a frame of a 4 MiB array travels in four 1 MiB messages, not five: every gRPC message costs
    thread hand-offs on both sides, whatever its size.
    """
    pending: list = []
    size = 0
    for part in parts:
        length = len(part)
        if size + length <= chunk_bytes:
            pending.append(part)
            size += length
            continue
        pos = 0
        if pending:
            if length > chunk_bytes:
                pos = chunk_bytes if size <= head_room else chunk_bytes - size
                pending.append(part[:pos])
            yield _join(pending)
            pending = []
        while length - pos > chunk_bytes:
            yield bytes(part[pos:pos + chunk_bytes])
            pos += chunk_bytes
        pending.append(part if pos == 0 else part[pos:])
        size = length - pos
    if pending:
        yield _join(pending)


def frame_bytes(parts: Sequence) -> bytes:
    """One encoded frame as one ``bytes`` (small frames travel in a single message)."""
    return _join(list(parts))


def _join(pieces: list) -> bytes:
    if len(pieces) == 1:
        piece = pieces[0]
        return piece if type(piece) is bytes else bytes(piece)
    return b"".join(pieces)


_HEADER, _ENVELOPE, _PAYLOAD = range(3)
_UNLIMITED = Limits(max_envelope_bytes=(1 << 32) - 1, max_payload_bytes=(1 << 64) - 1)


class Reassembler:
    """Turns a stream of messages, split anywhere, back into frames; see the module docstring.

    Args:
        limits: the limits every frame is held to (swap them with :meth:`expect` as a connection
            moves from its handshake to data).
        kinds: the frame kinds accepted; any other kind is refused from its header, before its
            envelope or payload is read.
        why: what to say when another kind arrives (``"before the handshake completed"``).
    """

    def __init__(self, limits: Limits, kinds: Collection[Kind] | None = None, why: str = ""):
        self.limits = limits
        self.kinds = None if kinds is None else frozenset(kinds)
        self.why = why
        self._state = _HEADER
        self._partial = bytearray()      # a header or an envelope arriving in pieces
        self._header: wire.Header | None = None
        self._tag = ""
        self._meta: dict = {}
        self._specs: list[wire.BufferSpec] = []  # the buffers the frame's envelope describes
        self._arrays: list[np.ndarray] = []      # the buffers received so far, in order
        self._filling: _Filling | None = None    # the one being received

    def expect(self, kinds: Collection[Kind] | None, limits: Limits | None = None, why: str = "") -> None:
        """Accept ``kinds`` (all if ``None``) under ``limits`` from the next frame on."""
        self.kinds = None if kinds is None else frozenset(kinds)
        if limits is not None:
            self.limits = limits
        self.why = why

    @property
    def between_frames(self) -> bool:
        """True if no frame is partly received."""
        return self._state == _HEADER and not self._partial

    def feed(self, data, on_frame: Callable[[Frame], None]) -> None:
        """Consume one message; call ``on_frame`` with each frame it completes, in order.

        Raises ``ProtocolError`` on anything malformed, oversized or unexpected; the frames completed
        before the bad one have been handed to ``on_frame`` by then.
        """
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        pos, end = 0, len(view)
        while pos < end:
            if self._state == _HEADER:
                pos = self._read_header(view, pos, end)
            elif self._state == _ENVELOPE:
                pos = self._read_envelope(view, pos, end)
            else:
                pos = self._read_payload(view, pos, end)
            if self._state == _PAYLOAD and len(self._arrays) == len(self._specs):
                frame = Frame(self._header.kind, self._tag, self._meta, self._arrays)
                self._state, self._header, self._specs, self._arrays = _HEADER, None, [], []
                on_frame(frame)

    def _take(self, view: memoryview, pos: int, end: int, need: int):
        """``need`` bytes from ``view[pos:]`` (joined with what came before); None if not there yet."""
        have = len(self._partial)
        if not have and end - pos >= need:
            return view[pos:pos + need], pos + need
        take = min(need - have, end - pos)
        self._partial += view[pos:pos + take]
        if len(self._partial) < need:
            return None, end
        data, self._partial = bytes(self._partial), bytearray()
        return data, pos + take

    def _read_header(self, view, pos, end) -> int:
        head, pos = self._take(view, pos, end, HEADER_SIZE)
        if head is None:
            return pos
        try:
            header = wire.read_header(head, self.limits)
        except ProtocolError:
            # An unexpected kind is the better reason (a DATA frame before the handshake is refused as
            # such, not for its size under the handshake's limits).
            try:
                self._check_kind(wire.read_header(head, _UNLIMITED).kind)
            except ProtocolError as exc:
                if "unexpected" in str(exc):
                    raise
            raise
        self._check_kind(header.kind)
        self._header, self._state = header, _ENVELOPE
        return pos

    def _check_kind(self, kind: Kind) -> None:
        if self.kinds is not None and kind not in self.kinds:
            raise ProtocolError(f"unexpected {kind.name} frame{' ' + self.why if self.why else ''}")

    def _read_envelope(self, view, pos, end) -> int:
        envelope, pos = self._take(view, pos, end, self._header.envelope_len)
        if envelope is None:
            return pos
        # Everything is checked here (dtypes, shapes, the declared total); nothing is allocated yet.
        self._tag, self._meta, self._specs = wire.read_envelope(self._header, envelope, self.limits)
        self._arrays = []
        self._skip_empty()
        self._state = _PAYLOAD
        return pos

    def _read_payload(self, view, pos, end) -> int:
        while pos < end and len(self._arrays) < len(self._specs):
            if self._filling is None:
                self._filling = _Filling(self._specs[len(self._arrays)])
            pos = self._filling.write(view, pos, end)
            if self._filling.done:
                self._arrays.append(self._filling.array())
                self._filling = None
                self._skip_empty()
        return pos

    def _skip_empty(self) -> None:
        """Buffers of no bytes are complete before any payload arrives."""
        while len(self._arrays) < len(self._specs) and self._specs[len(self._arrays)].nbytes == 0:
            spec = self._specs[len(self._arrays)]
            self._arrays.append(np.empty(spec.shape, spec.dtype))


class _Filling:
    """One buffer being received: its memory is taken as its bytes arrive (see the module docstring)."""

    __slots__ = ("spec", "filled", "_array", "_bytes", "_map")

    def __init__(self, spec: wire.BufferSpec):
        self.spec = spec
        self.filled = 0
        if spec.nbytes <= WHOLE_BYTES:
            self._array = np.empty(spec.shape, spec.dtype)
            self._bytes = self._array.reshape(-1).view(np.uint8)
            self._map = None
        else:
            self._array = self._bytes = None
            self._map = _anonymous_map(WHOLE_BYTES)

    @property
    def done(self) -> bool:
        return self.filled == self.spec.nbytes

    def write(self, view: memoryview, pos: int, end: int) -> int:
        """Copy what ``view[pos:end]`` holds of this buffer; returns where its bytes end."""
        take = min(self.spec.nbytes - self.filled, end - pos)
        start, stop = self.filled, self.filled + take
        if self._map is None:
            self._bytes[start:stop] = np.frombuffer(view[pos:pos + take], np.uint8)
        else:
            if stop > len(self._map):
                self._grow(stop)
            self._map[start:stop] = view[pos:pos + take]
        self.filled = stop
        return pos + take

    def array(self) -> np.ndarray:
        if self._map is None:
            return self._array
        return np.frombuffer(self._map, np.uint8).view(self.spec.dtype).reshape(self.spec.shape)

    def _grow(self, need: int) -> None:
        size = min(self.spec.nbytes, max(need, 2 * len(self._map)))
        try:
            self._map.resize(size)  # mremap: the kernel moves the pages, no byte is copied
            _huge_pages(self._map)
        except (OSError, SystemError, ValueError):  # no mremap on this platform: copy into a larger map
            larger = _anonymous_map(size)
            with memoryview(self._map) as old:
                larger[:self.filled] = old[:self.filled]
            self._map.close()
            self._map = larger


def _anonymous_map(size: int) -> mmap.mmap:
    # Private: a shared anonymous map is backed by a memory file of its first size, which mremap does
    # not grow (touching the pages beyond it is a SIGBUS).
    made = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", mmap.MAP_ANON))
    _huge_pages(made)
    return made


def _huge_pages(memory: mmap.mmap) -> None:
    # As numpy does for large arrays: faulting the pages in 2 MiB at a time, not 4 KiB, makes filling
    # the buffer 4 to 5 times faster.
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        memory.madvise(advice)
