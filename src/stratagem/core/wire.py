"""The wire format every byte-moving transport speaks (README: "Security").

A frame is a fixed header, an *envelope* (msgpack: the tag, the user's metadata, and the dtype and
shape of each buffer), then the raw array buffers. Nothing is pickled, so a frame from the network
can never run code. Every length is checked against :class:`Limits` *before* anything is allocated,
every dtype against a whitelist, and ``shape x itemsize`` against the buffer's real length; anything
else raises :class:`~stratagem.core.errors.ProtocolError` and nothing but that.

Layout (little-endian)::

    magic "STRG" | version u8 | kind u8 | flags u16 | envelope_len u32 | payload_len u64
    envelope (envelope_len bytes of msgpack)
    buffer 0 | buffer 1 | ...                      (payload_len bytes in all)

Multipart transports (zmq) send ``head = header + envelope`` and each buffer as its own part, so
array memory goes to the socket without a copy; stream transports concatenate the same pieces.

    >>> import numpy as np
    >>> data = encode_bytes(Kind.DATA, "grads", {"step": 3}, [np.arange(4, dtype=np.float16)])
    >>> frame = decode(data)
    >>> frame.tag, frame.meta, frame.buffers[0].dtype.name, frame.buffers[0].tolist()
    ('grads', {'step': 3}, 'float16', [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import enum
import math
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import ml_dtypes
import msgpack
import numpy as np

from stratagem.core.errors import ProtocolError

MAGIC = b"STRG"
#: Protocol version; peers of another version are refused at the handshake. 2: zmq answers a HELLO
#: on the connection it came in on and streams buffers over 4 MiB in pieces. 3: a collective's
#: fingerprint travels packed (bytes), and zmq sends small frames in one part.
VERSION = 3
HEADER = struct.Struct("<4sBBHIQ")
HEADER_SIZE = HEADER.size  # 20 bytes


class Kind(enum.IntEnum):
    """What a frame is: data, or one of the connection-control frames."""

    DATA = 1
    HELLO = 2       # connector -> acceptor: version, cluster id, task, nonce
    CHALLENGE = 3   # acceptor -> connector: its nonce and proof that it knows the secret
    AUTH = 4        # connector -> acceptor: proof that the connector knows the secret
    WELCOME = 5     # acceptor -> connector: the connection is accepted
    REJECT = 6      # either way: refused, with the reason
    GOODBYE = 7     # the sender is shutting down cleanly


_KINDS = {int(k): k for k in Kind}

#: The dtypes allowed on the wire, by the name carried in the envelope.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128")
}
DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer may make us allocate. Checked before allocating.

    Args:
        max_envelope_bytes: largest envelope (tag + metadata + buffer descriptions).
        max_payload_bytes: largest total of buffer bytes in one frame.
        max_buffers: most buffers in one frame.
        max_ndim: most dimensions of one buffer.
        max_tag_chars: longest tag.
    """

    max_envelope_bytes: int = 1 << 20
    max_payload_bytes: int = 1 << 32
    max_buffers: int = 4096
    max_ndim: int = 32
    max_tag_chars: int = 256

    @property
    def max_frame_bytes(self) -> int:
        return HEADER_SIZE + self.max_envelope_bytes + self.max_payload_bytes


DEFAULT_LIMITS = Limits()


@dataclass
class Frame:
    """A decoded frame."""

    kind: Kind
    tag: str
    meta: dict = field(default_factory=dict)
    buffers: list = field(default_factory=list)


class Header(NamedTuple):
    """The fixed header, checked (a tuple: read for every frame, so it should cost little to make)."""

    kind: Kind
    flags: int
    envelope_len: int
    payload_len: int


class BufferSpec:
    """What the envelope says of one buffer: ``dtype``, ``shape`` and so ``nbytes``."""

    __slots__ = ("dtype", "shape", "nbytes")

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]):
        self.dtype, self.shape = dtype, shape
        self.nbytes = math.prod(shape) * dtype.itemsize

    def __eq__(self, other) -> bool:
        return isinstance(other, BufferSpec) and (self.dtype, self.shape) == (other.dtype, other.shape)

    def __hash__(self) -> int:
        return hash((self.dtype, self.shape))

    def __repr__(self) -> str:
        return f"BufferSpec(dtype={self.dtype!r}, shape={self.shape!r})"


# -- encoding ---------------------------------------------------------------------------------------

def dtype_name(dtype) -> str:
    """The wire name of a dtype, or a ``ProtocolError`` listing the allowed ones."""
    name = _DTYPE_NAMES.get(dtype) if isinstance(dtype, np.dtype) and dtype.byteorder != ">" else None
    if name is not None:
        return name
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        dtype = dtype.newbyteorder("<")
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise ProtocolError(
            f"dtype {dtype} cannot be sent; allowed: {', '.join(DTYPES)} (convert with .astype())"
        )
    return name


def as_wire_array(array) -> np.ndarray:
    """A C-contiguous, little-endian numpy view (or copy) of ``array`` that can go on the wire."""
    if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype.byteorder != ">":
        return array  # the usual case, decided without a look at the module name
    if type(array).__module__.split(".")[0] == "cupy":  # device arrays are staged through the host
        array = array.get()
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    # np.ascontiguousarray would turn a 0-d array into 1-d, so only copy what needs it.
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


#: Types that are plain data by themselves (exact types: subclasses take the careful path).
_PLAIN_SCALARS = frozenset({type(None), bool, float, str, bytes})


def _check_plain(value: Any, path: str, depth: int = 0) -> None:
    """Metadata must be plain data: msgpack would otherwise refuse it later, with a worse message."""
    if depth > 32:
        raise ProtocolError(f"metadata nests deeper than 32 levels at {path}")
    kind = type(value)
    if kind in _PLAIN_SCALARS:  # the common cases first: this runs on every frame, both ways
        return
    if kind is int:
        if not -(1 << 63) <= value < (1 << 64):
            raise ProtocolError(f"metadata integer at {path} does not fit in 64 bits")
        return
    # Plain scalar items are checked in the loop (no call, no path string), except past the limit.
    leaf_ok = _PLAIN_SCALARS if depth < 32 else ()
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str and not isinstance(key, str):
                raise ProtocolError(f"metadata key {key!r} at {path} is not a string")
            if type(item) not in leaf_ok:
                _check_plain(item, f"{path}.{key}", depth + 1)
        return
    if kind is list:
        for i, item in enumerate(value):
            if type(item) not in leaf_ok:
                _check_plain(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, (msgpack.ExtType, msgpack.Timestamp)):
        # ExtType subclasses tuple, so it would otherwise pass as a list, and msgpack packs it as an
        # extension type: neither it nor a Timestamp is plain data.
        raise ProtocolError(f"metadata value at {path} is a msgpack {type(value).__name__}; "
                            f"msgpack extension types are not allowed in metadata")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
            raise ProtocolError(f"metadata integer at {path} does not fit in 64 bits")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"metadata key {key!r} at {path} is not a string")
            _check_plain(item, f"{path}.{key}", depth + 1)
        return
    raise ProtocolError(
        f"metadata value at {path} has type {type(value).__name__}; only None, bool, int, float, "
        f"str, bytes, lists and dicts with string keys can be sent"
    )


_PACKERS = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's packer (a Packer is not thread-safe; making one per frame costs more than the
    packing of a small envelope)."""
    try:
        return _PACKERS.packer
    except AttributeError:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
        return packer


def encode(kind: Kind, tag: str, meta: dict | None = None, buffers: Sequence = (),
           limits: Limits = DEFAULT_LIMITS) -> list:
    """Encode a frame as parts: ``[head, buffer0, buffer1, ...]``.

    ``head`` is bytes (header + envelope); each buffer part is a zero-copy ``memoryview`` of a
    contiguous array (arrays that are not contiguous or not little-endian are copied first).
    """
    meta = {} if meta is None else meta
    if not isinstance(tag, str):
        raise ProtocolError(f"tag must be a string, got {type(tag).__name__}")
    if len(tag) > limits.max_tag_chars:
        raise ProtocolError(f"tag of {len(tag)} characters exceeds the limit of {limits.max_tag_chars}")
    if not isinstance(meta, dict):
        raise ProtocolError(f"metadata must be a dict, got {type(meta).__name__}")
    _check_plain(meta, "meta")
    if len(buffers) > limits.max_buffers:
        raise ProtocolError(f"{len(buffers)} buffers exceed the limit of {limits.max_buffers} per message")
    views, specs, payload = [], [], 0
    for b in buffers:
        array = as_wire_array(b)
        if array.ndim > limits.max_ndim:
            raise ProtocolError(f"an array of {array.ndim} dimensions exceeds the limit of {limits.max_ndim}")
        specs.append([dtype_name(array.dtype), list(array.shape)])   # refuses what cannot go
        # A uint8 view works for every dtype, including bfloat16, which the buffer protocol cannot name.
        views.append(memoryview((array if array.ndim == 1 else array.reshape(-1)).view(np.uint8)))
        payload += array.nbytes
    try:
        envelope = _packer().pack({"t": tag, "m": meta, "b": specs})
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a lone surrogate is not UTF-8
        raise ProtocolError(f"tag or metadata cannot be encoded: {type(exc).__name__}: {exc}") from None
    if len(envelope) > limits.max_envelope_bytes:
        raise ProtocolError(
            f"metadata of {len(envelope)} bytes exceeds the limit of {limits.max_envelope_bytes}; "
            f"send large data as array buffers, not metadata"
        )
    if payload > limits.max_payload_bytes:
        raise ProtocolError(
            f"a message of {payload} bytes exceeds max_payload_bytes={limits.max_payload_bytes}; "
            f"split it, or raise the limit on both ends"
        )
    return [HEADER.pack(MAGIC, VERSION, kind, 0, len(envelope), payload) + envelope, *views]


def encode_bytes(kind: Kind, tag: str, meta: dict | None = None, buffers: Sequence = (),
                 limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Encode a frame as one contiguous ``bytes`` (for stream transports and tests)."""
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in encode(kind, tag, meta, buffers, limits))


# -- decoding ---------------------------------------------------------------------------------------

def read_header(head, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Parse and check the fixed header (the first ``HEADER_SIZE`` bytes of ``head``)."""
    if len(head) < HEADER_SIZE:
        raise ProtocolError(f"frame of {len(head)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, kind, flags, envelope_len, payload_len = HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: the peer does not speak the Stratagem protocol")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION}); "
                            f"run the same Stratagem version on every task")
    known = _KINDS.get(kind)
    if known is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    kind = known
    if flags != 0:
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if envelope_len > limits.max_envelope_bytes:
        raise ProtocolError(f"envelope of {envelope_len} bytes exceeds the limit of {limits.max_envelope_bytes}")
    if payload_len > limits.max_payload_bytes:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}")
    return Header(kind, flags, envelope_len, payload_len)


#: What msgpack raises on garbage (its FormatError, StackError, ExtraData... are ValueErrors; an unhashable
#: map key is a TypeError).
_GARBAGE = (ValueError, TypeError, msgpack.exceptions.UnpackException)


def read_envelope(header: Header, envelope, limits: Limits = DEFAULT_LIMITS) -> tuple[str, dict, list[BufferSpec]]:
    """Decode and check the envelope; returns ``(tag, meta, buffer specs)``."""
    if len(envelope) != header.envelope_len:
        raise ProtocolError(f"envelope is {len(envelope)} bytes, the header says {header.envelope_len}")
    try:
        body = msgpack.unpackb(envelope, raw=False, strict_map_key=True, use_list=True)
    except _GARBAGE as exc:  # every way msgpack refuses garbage means the same to us; anything else
        # (an exception a signal handler raised in this thread, MemoryError) is not the peer's fault
        raise ProtocolError(f"envelope is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if type(body) is not dict or len(body) != 3 or "t" not in body or "m" not in body or "b" not in body:
        raise ProtocolError("envelope must be a map with exactly the keys 't', 'm', 'b'")
    tag, meta, raw_specs = body["t"], body["m"], body["b"]
    if not isinstance(tag, str) or len(tag) > limits.max_tag_chars:
        raise ProtocolError("envelope tag must be a string of at most "
                            f"{limits.max_tag_chars} characters")
    if not isinstance(meta, dict):
        raise ProtocolError("envelope metadata must be a map")
    _check_plain(meta, "meta")
    if not isinstance(raw_specs, list) or len(raw_specs) > limits.max_buffers:
        raise ProtocolError(f"envelope buffer list must be a list of at most {limits.max_buffers} entries")
    specs, total = [], 0
    for i, raw in enumerate(raw_specs):
        spec = _buffer_spec(i, raw, limits)
        specs.append(spec)
        total += spec.nbytes
    if total != header.payload_len:
        raise ProtocolError(f"buffers add up to {total} bytes, the header says {header.payload_len}")
    return tag, meta, specs


_MAX_INTP = int(np.iinfo(np.intp).max)


def _buffer_spec(index: int, raw, limits: Limits) -> BufferSpec:
    if not (type(raw) is list and len(raw) == 2 and isinstance(raw[0], str) and type(raw[1]) is list):
        raise ProtocolError(f"buffer {index}: description must be [dtype, shape]")
    dtype = DTYPES.get(raw[0])
    if dtype is None:
        raise ProtocolError(f"buffer {index}: dtype {raw[0]!r} is not allowed on the wire")
    shape = raw[1]
    if len(shape) > limits.max_ndim:
        raise ProtocolError(f"buffer {index}: {len(shape)} dimensions exceed the limit of {limits.max_ndim}")
    elements = bound = 1  # bound: the product of the dimensions with 0 counted as 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"buffer {index}: shape {shape!r} must be non-negative integers")
        elements *= d
        bound *= d or 1
    if bound * dtype.itemsize > _MAX_INTP:
        # Even with no elements (a 0 among the dimensions) numpy cannot make such an array.
        raise ProtocolError(f"buffer {index}: shape {shape!r} has dimensions too large to represent")
    nbytes = elements * dtype.itemsize
    if nbytes > limits.max_payload_bytes:
        raise ProtocolError(f"buffer {index}: {nbytes} bytes exceed the limit of {limits.max_payload_bytes}")
    return BufferSpec(dtype, tuple(shape))


def array_from(spec: BufferSpec, data) -> np.ndarray:
    """Wrap ``data`` (a buffer of exactly ``spec.nbytes`` bytes) as an array without copying."""
    nbytes = spec.nbytes
    if len(data) != nbytes:
        raise ProtocolError(f"buffer is {len(data)} bytes, its description says {nbytes}")
    array = np.frombuffer(data, dtype=spec.dtype) if nbytes else np.frombuffer(data, np.uint8).view(spec.dtype)
    shape = spec.shape
    return array if len(shape) == 1 else array.reshape(shape)


def _bytes_of(data, what: str) -> memoryview:
    """A flat byte view of ``data``, or a ``ProtocolError`` if it is not a contiguous buffer."""
    if type(data) is bytes:
        return data  # already flat bytes (len() counts bytes)
    try:
        view = data if type(data) is memoryview else memoryview(data)
        return view if view.format == "B" and view.ndim == 1 and view.c_contiguous else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{what} is not a contiguous bytes-like object ({exc})") from None


def decode_parts(parts: Sequence, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode a frame received as parts ``[head, buffer0, ...]`` (buffers wrapped, not copied)."""
    if not parts:
        raise ProtocolError("empty message")
    head = parts[0] if type(parts[0]) is bytes else _bytes_of(parts[0], "head part")
    header = read_header(head, limits)
    if len(head) != HEADER_SIZE + header.envelope_len:
        raise ProtocolError(f"head part is {len(head)} bytes, the header says {HEADER_SIZE + header.envelope_len}")
    tag, meta, specs = read_envelope(header, head[HEADER_SIZE:], limits)
    if len(parts) - 1 != len(specs):
        raise ProtocolError(f"{len(parts) - 1} buffer parts arrived, the envelope describes {len(specs)}")
    buffers = [array_from(spec, _bytes_of(parts[i + 1], f"buffer part {i}")) for i, spec in enumerate(specs)]
    return Frame(header.kind, tag, meta, buffers)


def decode(data, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode one contiguous frame (as made by :func:`encode_bytes`)."""
    view = _bytes_of(data, "frame")
    header = read_header(view, limits)
    end_envelope = HEADER_SIZE + header.envelope_len
    if len(view) != end_envelope + header.payload_len:
        raise ProtocolError(f"frame is {len(view)} bytes, the header says {end_envelope + header.payload_len}")
    tag, meta, specs = read_envelope(header, view[HEADER_SIZE:end_envelope], limits)
    # The lengths add up (checked above and in read_envelope), so each buffer is exactly in place.
    buffers, offset = [], end_envelope
    for spec in specs:
        array = np.frombuffer(view, spec.dtype, math.prod(spec.shape), offset)
        buffers.append(array if len(spec.shape) == 1 else array.reshape(spec.shape))
        offset += spec.nbytes
    return Frame(header.kind, tag, meta, buffers)
