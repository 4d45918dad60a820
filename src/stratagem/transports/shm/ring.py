"""A one-way byte ring in shared memory: the data path of the ``shm`` transport.

One ring carries the frames one task sends to one peer (so there is a ring per ordered pair that
talks). The producer writes whole wire frames (:mod:`stratagem.core.wire`: header, envelope, raw
buffers) into it; the consumer decodes them straight out of the ring into buffers it owns. A frame
may be larger than the ring: it streams through, the producer publishing every ``chunk_bytes`` so
that the consumer copies one piece out while the producer copies the next one in.

The region is an anonymous ``memfd`` (no name in ``/dev/shm``, so nothing can be left behind
when a task is killed; the memory goes when the last task mapping it does), sealed against
shrinking so a peer can never make our mapping fault (SIGBUS). Layout::

    0     magic "STRGRING" | capacity u64
    64    written   u64   total bytes the producer has published (written by the producer only)
    128   consumed  u64   total bytes the consumer has taken     (written by the consumer only)
    192   consumer sleeps u64   1 while the consumer may sleep waiting for data
    256   producer sleeps u64   1 while the producer may sleep waiting for room
    4096  data      capacity bytes; stream byte i lives at data[i % capacity]

Each side keeps its own counter in private memory and reads the other's from shared memory as
*untrusted*: a value that goes backwards, or claims more than the ring holds, raises
:class:`RingError` (the transport then drops that peer). Every length read from the stream is a
wire header or envelope, checked by :mod:`stratagem.core.wire` against the receiver's limits before
anything is allocated, so a hostile or buggy peer can neither make us read outside the region nor
allocate more than a frame from the network could.

Waking up: a side about to sleep sets its *sleeps* word, then looks at the other's counter once
more; a side that moves its counter then looks at the other's *sleeps* word and calls ``notify()``
(the transport rings a doorbell) only if it is set. With a full fence between the store and the
load on both sides (:func:`fence`: a lock operation, a locked instruction on x86-64) one of the two
always sees the other, so no wake-up is lost, and a side that is busy copying is never woken for
nothing (a wake-up costs far more than a copy of a chunk on a loaded machine). Where a lock is not
a full fence (weakly ordered CPUs) a lost wake-up costs one poll slice of the waiter, never a hang.

Memory order of the data: the producer copies it, then stores ``written``; the consumer loads
``written``, then copies. x86-64 keeps stores in order (and loads in order).

    >>> import numpy as np
    >>> from stratagem.core.wire import Kind, encode
    >>> region = Region.create("demo", 1 << 16)
    >>> writer, reader = RingWriter(region, chunk_bytes=4096), RingReader(Region.attach(region.fd, 1 << 16))
    >>> writer.write(encode(Kind.DATA, "t", {"k": 1}, [np.arange(100_000, dtype=np.int32)]), wait=lambda: reader.poll())
    >>> frames = reader.poll()
    >>> frames[-1].meta, int(frames[-1].buffers[0][-1])
    ({'k': 1}, 99999)
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import struct
import threading
from typing import Callable, Sequence

import numpy as np

from stratagem.core import wire
from stratagem.core.errors import ProtocolError
from stratagem.core.wire import Frame, Kind, Limits

MAGIC = b"STRGRING"
#: Bytes before the data: the magic and the two counters, each counter on its own cache line.
HEADER_BYTES = 4096
_WRITTEN, _CONSUMED, _CONSUMER_SLEEPS, _PRODUCER_SLEEPS = 64, 128, 192, 256
_U64 = struct.Struct("<Q")
#: Smallest and largest rings we make or accept.
MIN_CAPACITY = 64 << 10
MAX_CAPACITY = 1 << 30
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


_FENCE = threading.Lock()


def fence() -> None:
    """A full memory fence, as far as Python can have one: a lock taken and released (an atomic
    read-modify-write, which x86-64 orders with every earlier store and later load)."""
    _FENCE.acquire()
    _FENCE.release()


class RingError(ProtocolError):
    """The peer broke the ring's rules (a counter out of bounds, a malformed frame)."""


class Region:
    """A mapped ring region. Made by the producer with :meth:`create`, mapped by the consumer with
    :meth:`attach` from the file descriptor the producer handed over."""

    def __init__(self, fd: int | None, mm: mmap.mmap, capacity: int):
        self.fd = fd  # kept by the producer until handed over, then closed
        self.capacity = capacity
        self._mm = mm
        # Counters are loaded and stored as aligned native 8-byte words (one instruction each, so
        # never torn; struct's little-endian packing would go byte by byte).
        self._words = np.frombuffer(mm, dtype=np.uint64, count=HEADER_BYTES // 8)
        self.data = np.frombuffer(mm, dtype=np.uint8, count=capacity, offset=HEADER_BYTES)

    @classmethod
    def create(cls, name: str, capacity: int) -> "Region":
        """A fresh sealed memfd of ``capacity`` data bytes, mapped."""
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise ValueError(f"ring capacity must be between {MIN_CAPACITY} and {MAX_CAPACITY} bytes, got {capacity}")
        fd = os.memfd_create(f"stratagem-shm:{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER_BYTES + capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mm = mmap.mmap(fd, HEADER_BYTES + capacity)
        except BaseException:
            os.close(fd)
            raise
        mm[0:8] = MAGIC
        _U64.pack_into(mm, 8, capacity)
        return cls(fd, mm, capacity)

    @classmethod
    def attach(cls, fd: int, capacity: int) -> "Region":
        """Map a region a peer handed over; ``capacity`` is what the peer announced.

        Refused (``RingError``) unless ``fd`` is a memfd sealed against shrinking of exactly that
        size with our magic: a peer that could shrink it later would make every access fault.
        """
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY:
            raise RingError(f"announced ring capacity {capacity} is outside {MIN_CAPACITY}..{MAX_CAPACITY}")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RingError("the handed-over descriptor is not a shared-memory file")
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:
            raise RingError(f"the handed-over descriptor is not a sealable memfd ({exc})") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise RingError("the handed-over memfd is not sealed against shrinking")
        if info.st_size != HEADER_BYTES + capacity:
            raise RingError(f"the handed-over memfd holds {info.st_size} bytes, the peer announced "
                            f"{HEADER_BYTES + capacity}")
        mm = mmap.mmap(fd, HEADER_BYTES + capacity)
        if mm[0:8] != MAGIC or _U64.unpack_from(mm, 8)[0] != capacity:
            mm.close()
            raise RingError("the handed-over memfd is not a ring (bad magic or capacity)")
        return cls(None, mm, capacity)

    def load(self, offset: int) -> int:
        return int(self._words[offset // 8])

    def store(self, offset: int, value: int) -> None:
        self._words[offset // 8] = value

    def close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Unmap (the memory itself goes once the peer unmaps too). Safe to call twice."""
        self.close_fd()
        self.data = self._words = None
        try:
            self._mm.close()
        except BufferError:
            # A view is still alive somewhere (a copy in another thread): unmapping now would
            # crash it; the mapping goes with the last view instead.
            pass


class RingWriter:
    """The producer's end: copies frames in, publishing every ``chunk_bytes``.

    ``notify()`` is called after a publish if the consumer sleeps (the transport rings its doorbell).
    """

    def __init__(self, region: Region, chunk_bytes: int = 1 << 20, notify: Callable[[], None] = lambda: None):
        self.region = region
        self.chunk_bytes = max(4096, min(int(chunk_bytes), region.capacity // 2))
        self.notify = notify
        self.written = 0        # our counter, the truth
        self._published = 0
        self._consumed = 0      # the last value of the consumer's counter we checked

    def free(self) -> int:
        """Bytes the producer may write now (reads the consumer's counter, untrusted)."""
        consumed = self.region.load(_CONSUMED)
        if not self._consumed <= consumed <= self.written:
            raise RingError(f"the consumer's counter {consumed} is outside {self._consumed}..{self.written}")
        self._consumed = consumed
        return self.region.capacity - (self.written - consumed)

    def sleeping(self, sleeps: bool) -> None:
        """Say whether the producer may sleep waiting for room (see the module docstring): set it,
        then check :meth:`free` once more before sleeping."""
        self.region.store(_PRODUCER_SLEEPS, int(sleeps))
        if sleeps:
            fence()

    def write(self, parts: Sequence, wait: Callable[[], object]) -> None:
        """Write one frame (``wire.encode`` parts). ``wait()`` is called whenever the ring is full;
        it blocks a while (or raises to give up: the frame is then cut, so the ring is unusable)."""
        data, capacity = self.region.data, self.region.capacity
        for part in parts:
            src = np.frombuffer(part, dtype=np.uint8)
            done, total = 0, src.size
            while done < total:
                free = self.free()
                if free == 0:
                    self._publish()
                    wait()
                    continue
                pos = self.written % capacity
                n = min(total - done, free, capacity - pos, self.chunk_bytes - (self.written - self._published))
                data[pos:pos + n] = src[done:done + n]
                done += n
                self.written += n
                if self.written - self._published >= self.chunk_bytes:
                    self._publish()
        self._publish()

    def _publish(self) -> None:
        if self.written != self._published:
            self.region.store(_WRITTEN, self.written)
            self._published = self.written
            fence()
            if self.region.load(_CONSUMER_SLEEPS):
                self.notify()


class RingReader:
    """The consumer's end: decodes frames out of the ring into buffers the receiver owns.

    :meth:`poll` takes whatever is published and returns the frames it completed; a frame still
    streaming in stays half-read until the next call (``partial``).
    """

    def __init__(self, region: Region, limits: Limits = wire.DEFAULT_LIMITS,
                 notify: Callable[[], None] = lambda: None, notify_bytes: int = 1 << 20,
                 allocate: Callable[[int], np.ndarray] = lambda n: np.empty(n, dtype=np.uint8)):
        self.region = region
        self.allocate = allocate  # fresh uint8 buffers nobody else refers to
        self.limits = limits
        self.notify = notify
        self.notify_bytes = notify_bytes
        self.consumed = 0
        self._notified = 0
        self._reset()

    def _reset(self) -> None:
        self._head = bytearray()
        self._header: wire.Header | None = None
        self._frame: Frame | None = None  # once the envelope is read: tag, meta, and the buffers to fill
        self._specs: list = []
        self._buffer = 0                  # index of the buffer being filled, and bytes filled in it
        self._filled = 0

    @property
    def partial(self) -> bool:
        """True in the middle of a frame."""
        return bool(self._head) or self._frame is not None

    def available(self) -> int:
        """Published bytes not consumed yet (reads the producer's counter, untrusted)."""
        written = self.region.load(_WRITTEN)
        if not self.consumed <= written <= self.consumed + self.region.capacity:
            raise RingError(f"the producer's counter {written} is outside "
                            f"{self.consumed}..{self.consumed + self.region.capacity}")
        return written - self.consumed

    def poll(self) -> list[Frame]:
        frames: list[Frame] = []
        try:
            while True:
                available = self.available()
                if not available:
                    return frames
                while available:
                    taken = self._step(available, frames)
                    available -= taken
                    self.consumed += taken
                    self.region.store(_CONSUMED, self.consumed)
                    if self.consumed - self._notified >= self.notify_bytes:
                        self._notify()
        finally:
            if self.consumed != self._notified:
                self._notify()

    def _notify(self) -> None:
        self._notified = self.consumed
        fence()
        if self.region.load(_PRODUCER_SLEEPS):
            self.notify()

    def sleeping(self, sleeps: bool) -> None:
        """Say whether the consumer may sleep waiting for data (see the module docstring): set it,
        then check :meth:`available` once more before sleeping."""
        self.region.store(_CONSUMER_SLEEPS, int(sleeps))
        if sleeps:
            fence()

    def _copy_out(self, dest: np.ndarray, n: int) -> None:
        """Copy the next ``n`` stream bytes into ``dest`` (``n`` <= available)."""
        data, capacity = self.region.data, self.region.capacity
        pos = self.consumed % capacity
        first = min(n, capacity - pos)
        dest[:first] = data[pos:pos + first]
        if first < n:
            dest[first:n] = data[:n - first]

    def _step(self, available: int, frames: list) -> int:
        """Consume up to ``available`` bytes of the current frame; returns how many it took."""
        if self._frame is None:
            want = wire.HEADER_SIZE if self._header is None else wire.HEADER_SIZE + self._header.envelope_len
            n = min(available, want - len(self._head))
            piece = np.empty(n, dtype=np.uint8)
            self._copy_out(piece, n)
            self._head += piece.tobytes()
            if len(self._head) < want:
                return n
            if self._header is None:
                self._header = wire.read_header(self._head, self.limits)
                if self._header.kind != Kind.DATA:
                    raise RingError(f"a {self._header.kind.name} frame in a data ring")
                if self._header.envelope_len:
                    return n
            tag, meta, specs = wire.read_envelope(self._header, memoryview(self._head)[wire.HEADER_SIZE:], self.limits)
            # The receiver owns every buffer: fresh memory, filled from the ring.
            self._frame = Frame(Kind.DATA, tag, meta, [self.allocate(s.nbytes) for s in specs])
            self._specs = specs
            self._finish_if_filled(frames)
            return n
        raw = self._frame.buffers[self._buffer]
        n = min(available, raw.size - self._filled)
        self._copy_out(raw[self._filled:], n)
        self._filled += n
        self._finish_if_filled(frames)
        return n

    def _finish_if_filled(self, frames: list) -> None:
        frame = self._frame
        while self._buffer < len(frame.buffers) and self._filled == frame.buffers[self._buffer].size:
            self._buffer += 1
            self._filled = 0
        if self._buffer == len(frame.buffers):
            frame.buffers = [wire.array_from(spec, raw) for spec, raw in zip(self._specs, frame.buffers)]
            frames.append(frame)
            self._reset()
