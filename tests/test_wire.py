"""Tests of the wire format (stratagem.core.wire): round trips, encoding errors, hostile frames, fuzzing.

The contract under test: ``decode``/``decode_parts`` return exactly what was encoded, and on any
other input raise :class:`ProtocolError` and nothing else -- a frame from the network must never
crash a server with an unexpected exception type, run code, or make it allocate what the header
claims before the claim is checked.
"""

from __future__ import annotations

import math
import struct
import tracemalloc

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from stratagem.core import wire
from stratagem.core.errors import ProtocolError, StratagemError
from stratagem.core.wire import (
    DEFAULT_LIMITS,
    DTYPES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Frame,
    Kind,
    Limits,
    decode,
    decode_parts,
    encode,
    encode_bytes,
    read_header,
)

pytestmark = pytest.mark.timeout(120)

#: Hypothesis settings for this file: no deadline (CI machines are slow and noisy), no example
#: database (the checkout is shared; failures print their reproducing example anyway).
FUZZ = settings(deadline=None, max_examples=300, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- helpers ----------------------------------------------------------------------------------------

def same(a, b) -> bool:
    """Deep equality of decoded metadata: exact types (True is not 1), NaN equals NaN, -0.0 is not 0.0.

    Tuples are encoded as msgpack arrays and come back as lists, so a tuple on the left matches a list.
    """
    if isinstance(a, tuple):
        a = list(a)
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def wire_form(array) -> np.ndarray:
    """What ``array`` must come back as: C-contiguous, little-endian, same values."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return array


def assert_same_array(got: np.ndarray, sent) -> None:
    expected = wire_form(sent)
    assert isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.dtype.byteorder in "=<|"
    assert got.shape == expected.shape
    assert got.flags.c_contiguous
    # Byte comparison: exact, and NaN-safe for the float and complex dtypes.
    assert got.tobytes() == np.ascontiguousarray(expected).tobytes()


def raw_frame(envelope_obj=None, payload: bytes = b"", *, envelope: bytes | None = None,
              magic: bytes = MAGIC, version: int = VERSION, kind: int = int(Kind.DATA), flags: int = 0,
              envelope_len: int | None = None, payload_len: int | None = None) -> bytes:
    """A frame built by hand, so that each field can be wrong on its own."""
    if envelope is None:
        envelope = msgpack.packb(envelope_obj, use_bin_type=True)
    envelope_len = len(envelope) if envelope_len is None else envelope_len
    payload_len = len(payload) if payload_len is None else payload_len
    return HEADER.pack(magic, version, kind, flags, envelope_len, payload_len) + envelope + payload


def env(tag="t", meta=None, specs=()) -> dict:
    return {"t": tag, "m": {} if meta is None else meta, "b": list(specs)}


def refuses(data, *fragments, limits: Limits = DEFAULT_LIMITS) -> str:
    """Assert that ``decode(data)`` raises ProtocolError whose message has every fragment; return it."""
    with pytest.raises(ProtocolError) as info:
        decode(data, limits)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def assert_plain(value, depth=0) -> None:
    """What a decoder hands back as metadata is plain data of exactly the allowed types."""
    assert depth <= 33
    if isinstance(value, list) and type(value) is list:
        for item in value:
            assert_plain(item, depth + 1)
    elif type(value) is dict:
        for key, item in value.items():
            assert type(key) is str, key
            assert_plain(item, depth + 1)
    else:
        assert type(value) in (type(None), bool, int, float, str, bytes), type(value)
        if type(value) is int:
            assert -(2**63) <= value < 2**64


def decodes_or_refuses(call, *args, **kwargs):
    """Run a decoder on hostile input: a Frame or a ProtocolError are fine, anything else fails."""
    try:
        frame = call(*args, **kwargs)
    except ProtocolError:
        return None
    assert isinstance(frame, Frame)
    assert isinstance(frame.kind, Kind)
    assert isinstance(frame.tag, str)
    assert isinstance(frame.meta, dict)
    assert_plain(frame.meta)
    assert len(frame.tag) <= DEFAULT_LIMITS.max_tag_chars
    for buffer in frame.buffers:
        assert isinstance(buffer, np.ndarray)
        assert buffer.dtype in DTYPES.values()
    return frame


# -- round trips ------------------------------------------------------------------------------------

SHAPES = [(), (1,), (5,), (0,), (3, 0), (0, 4), (2, 3), (2, 3, 4), (1, 1, 1, 1), (4, 0, 2)]


def sample_array(name: str, shape) -> np.ndarray:
    dtype = DTYPES[name]
    n = math.prod(shape)
    if name == "bool":
        values = np.arange(n) % 3 == 0
    elif name.startswith("complex"):
        values = np.arange(n) - 1j * np.arange(n) / 4
    elif name.startswith("uint"):
        values = np.arange(n) * 7 % 250
    elif name.startswith("int"):
        values = np.arange(n) * 7 % 250 - 125
    else:
        values = (np.arange(n) - 2.5) / 4
    return np.asarray(values).astype(dtype).reshape(shape)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("path", ["bytes", "parts"])
def test_round_trip_every_dtype_and_shape(name, shape, path):
    array = sample_array(name, shape)
    if path == "bytes":
        frame = decode(encode_bytes(Kind.DATA, "x", {"n": 1}, [array]))
    else:
        frame = decode_parts(encode(Kind.DATA, "x", {"n": 1}, [array]))
    assert frame.kind is Kind.DATA and frame.tag == "x" and frame.meta == {"n": 1}
    assert len(frame.buffers) == 1
    assert_same_array(frame.buffers[0], array)
    assert frame.buffers[0].dtype.name == array.dtype.name


def test_dtype_table_has_the_documented_names():
    assert set(DTYPES) == {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                           "uint64", "float16", "float32", "float64", "complex64", "complex128",
                           "bfloat16"}
    assert DTYPES["bfloat16"] == np.dtype(ml_dtypes.bfloat16)


def test_special_float_values_survive_bit_exactly():
    values = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-8, 65504.0]
    for name in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128"):
        array = np.array(values, dtype=np.float64).astype(DTYPES[name])
        assert_same_array(decode(encode_bytes(Kind.DATA, "f", None, [array])).buffers[0], array)


def test_bfloat16_values_round_trip():
    array = np.array([1.5, -2.0, 3.140625, 1e30], dtype=ml_dtypes.bfloat16)
    got = decode(encode_bytes(Kind.DATA, "b", {}, [array])).buffers[0]
    assert got.dtype == ml_dtypes.bfloat16
    assert got.astype(np.float32).tolist() == array.astype(np.float32).tolist()


def test_many_buffers_of_mixed_dtypes_in_order():
    arrays = [sample_array(name, shape) for name, shape in zip(sorted(DTYPES), SHAPES * 2)]
    for frame in (decode(encode_bytes(Kind.DATA, "mix", None, arrays)),
                  decode_parts(encode(Kind.DATA, "mix", None, arrays))):
        assert len(frame.buffers) == len(arrays)
        for got, sent in zip(frame.buffers, arrays):
            assert_same_array(got, sent)


def test_no_buffers_and_no_metadata():
    for kind in Kind:
        frame = decode(encode_bytes(kind, ""))
        assert frame == Frame(kind, "", {}, [])
        assert decode_parts(encode(kind, "")) == Frame(kind, "", {}, [])


def test_frame_is_header_envelope_then_payload():
    array = np.arange(3, dtype=np.int32)
    data = encode_bytes(Kind.DATA, "g", {"a": 1}, [array])
    magic, version, kind, flags, envelope_len, payload_len = HEADER.unpack_from(data)
    assert (magic, version, kind, flags) == (b"STRG", VERSION, 1, 0)
    assert HEADER_SIZE == 20
    assert payload_len == 12
    assert len(data) == HEADER_SIZE + envelope_len + payload_len
    assert data[-12:] == array.tobytes()
    assert msgpack.unpackb(data[HEADER_SIZE:HEADER_SIZE + envelope_len]) == {
        "t": "g", "m": {"a": 1}, "b": [["int32", [3]]]}


@pytest.mark.parametrize("make", [
    lambda: np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2],   # strided
    lambda: np.arange(24, dtype=np.int64).reshape(4, 6).T,           # transposed (F-order)
    lambda: np.arange(24, dtype=np.complex64).reshape(2, 3, 4)[::-1, 1:, ::3],
    lambda: np.asfortranarray(np.arange(12, dtype=np.float16).reshape(3, 4)),
    lambda: np.arange(20, dtype=np.float32).astype(ml_dtypes.bfloat16)[::3],
    lambda: np.arange(10, dtype=np.int8)[::-1],
], ids=["strided", "transposed", "3d-sliced", "fortran", "bfloat16-strided", "reversed"])
def test_non_contiguous_inputs_arrive_equal_and_contiguous(make):
    array = make()
    assert not array.flags.c_contiguous
    for frame in (decode(encode_bytes(Kind.DATA, "nc", None, [array])),
                  decode_parts(encode(Kind.DATA, "nc", None, [array]))):
        got = frame.buffers[0]
        assert got.flags.c_contiguous
        np.testing.assert_array_equal(got, array)
        assert_same_array(got, array)


@pytest.mark.parametrize("name", ["int16", "int32", "int64", "uint16", "uint32", "uint64",
                                  "float16", "float32", "float64", "complex64", "complex128"])
def test_big_endian_inputs_arrive_little_endian_with_the_same_values(name):
    big = sample_array(name, (2, 3)).astype(np.dtype(name).newbyteorder(">"))
    assert big.dtype.byteorder == ">"
    for frame in (decode(encode_bytes(Kind.DATA, "be", None, [big])),
                  decode_parts(encode(Kind.DATA, "be", None, [big]))):
        got = frame.buffers[0]
        assert got.dtype == DTYPES[name] and got.dtype.byteorder in "=<|"
        np.testing.assert_array_equal(got, big)


def test_big_endian_non_contiguous_and_0d():
    big = np.arange(12, dtype=">f8").reshape(3, 4).T
    got = decode(encode_bytes(Kind.DATA, "x", None, [big])).buffers[0]
    np.testing.assert_array_equal(got, big)
    scalar = np.array(7, dtype=">i4")
    got = decode(encode_bytes(Kind.DATA, "x", None, [scalar])).buffers[0]
    assert got.shape == () and got.dtype == np.int32 and int(got) == 7


def test_plain_python_and_scalar_buffers_are_accepted():
    frame = decode(encode_bytes(Kind.DATA, "l", None, [[1.0, 2.0], 3, np.float32(2.5), True]))
    assert frame.buffers[0].tolist() == [1.0, 2.0] and frame.buffers[0].dtype == np.float64
    assert frame.buffers[1].shape == () and int(frame.buffers[1]) == 3
    assert frame.buffers[2].shape == () and frame.buffers[2].dtype == np.float32
    assert frame.buffers[3].dtype == np.bool_ and bool(frame.buffers[3]) is True


NESTED_META = {
    "step": 3, "lr": 0.125, "none": None, "yes": True, "no": False, "name": "grads/w:0",
    "unicode": "δ∑ 🚀", "blob": b"\x00\xff\x10", "empty": {}, "empty_list": [],
    "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
    "floats": [1e308, -1e-308, float("inf"), float("-inf"), -0.0],
    "deep": {"a": [{"b": [[1, 2], {"c": None}]}, "x"], "d": {"e": {"f": {"g": [b"", ""]}}}},
}


def test_metadata_of_nested_plain_values():
    for frame in (decode(encode_bytes(Kind.DATA, "m", NESTED_META)),
                  decode_parts(encode(Kind.DATA, "m", NESTED_META))):
        assert same(NESTED_META, frame.meta)


def test_metadata_tuples_come_back_as_lists_and_nan_survives():
    frame = decode(encode_bytes(Kind.DATA, "m", {"t": (1, (2, 3)), "nan": float("nan")}))
    assert frame.meta["t"] == [1, [2, 3]]
    assert math.isnan(frame.meta["nan"])


def test_numpy_float64_metadata_is_a_float():
    # np.float64 subclasses float, so it is plain data and comes back as a Python float.
    frame = decode(encode_bytes(Kind.DATA, "m", {"loss": np.float64(0.5)}))
    assert type(frame.meta["loss"]) is float and frame.meta["loss"] == 0.5


def test_metadata_at_the_nesting_limit():
    meta = value = {}
    for _ in range(31):
        value["k"] = {}
        value = value["k"]
    assert decode(encode_bytes(Kind.DATA, "deep", meta)).meta == meta


def test_tag_at_the_limit_and_unicode_tags():
    tag = "é" * DEFAULT_LIMITS.max_tag_chars  # the limit counts characters, not bytes
    assert decode(encode_bytes(Kind.DATA, tag)).tag == tag
    assert decode(encode_bytes(Kind.DATA, "grads/🚀")).tag == "grads/🚀"


# -- zero copy --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_encode_parts_are_zero_copy_views_of_contiguous_arrays(name):
    array = sample_array(name, (3, 4))
    assert array.flags.c_contiguous
    head, part = encode(Kind.DATA, "z", None, [array])
    assert isinstance(head, bytes)
    assert isinstance(part, memoryview)
    assert part.nbytes == array.nbytes
    assert np.shares_memory(np.frombuffer(part, dtype=np.uint8), array)
    array.reshape(-1).view(np.uint8)[0] ^= 0xFF  # a write to the array shows through the part
    assert bytes(part[:1]) == array.reshape(-1).view(np.uint8)[:1].tobytes()


def test_encode_parts_of_0d_and_empty_arrays():
    scalar = np.array(3.5)
    empty = np.zeros((3, 0), dtype=np.float32)
    head, p0, p1 = encode(Kind.DATA, "z", None, [scalar, empty])
    assert np.shares_memory(np.frombuffer(p0, dtype=np.uint8), scalar)
    assert p1.nbytes == 0


def test_encode_copies_only_what_it_must():
    strided = np.arange(10.0)[::2]
    _, part = encode(Kind.DATA, "z", None, [strided])
    assert not np.shares_memory(np.frombuffer(part, dtype=np.uint8), strided)
    assert bytes(part) == np.ascontiguousarray(strided).tobytes()


def test_decoded_buffers_are_views_of_the_received_memory():
    array = np.arange(16, dtype=np.float32)
    data = bytearray(encode_bytes(Kind.DATA, "v", None, [array]))
    got = decode(data).buffers[0]
    assert np.shares_memory(got, np.frombuffer(data, dtype=np.uint8))
    head, part = encode(Kind.DATA, "v", None, [array])
    received = bytearray(part)
    got = decode_parts([head, received]).buffers[0]
    assert np.shares_memory(got, np.frombuffer(received, dtype=np.uint8))
    np.testing.assert_array_equal(got, array)


def test_decode_accepts_bytes_bytearray_and_memoryview():
    data = encode_bytes(Kind.DATA, "a", {"x": 1}, [np.arange(3)])
    for form in (data, bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        frame = decode(form)
        assert frame.meta == {"x": 1} and frame.buffers[0].tolist() == [0, 1, 2]
    head, part = encode(Kind.DATA, "a", {"x": 1}, [np.arange(3)])
    for h, p in ((head, part), (bytearray(head), bytes(part)), (memoryview(head), bytearray(part))):
        assert decode_parts([h, p]).buffers[0].tolist() == [0, 1, 2]


def test_decode_parts_accepts_a_buffer_that_is_not_byte_formatted():
    head, _ = encode(Kind.DATA, "a", None, [np.arange(3, dtype=np.int64)])
    part = memoryview(np.arange(3, dtype=np.int64))  # format 'l', not 'B'
    assert decode_parts([head, part]).buffers[0].tolist() == [0, 1, 2]


# -- encoding errors --------------------------------------------------------------------------------

def encoding_error(*fragments, meta=None, buffers=(), tag="t", limits=DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        encode(Kind.DATA, tag, meta, buffers, limits)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    with pytest.raises(ProtocolError):
        encode_bytes(Kind.DATA, tag, meta, buffers, limits)
    return message


class Opaque:
    pass


@pytest.mark.parametrize("meta, fragments", [
    ({"obj": Opaque()}, ["meta.obj", "Opaque", "only None, bool, int, float, str, bytes"]),
    ({"s": {1, 2}}, ["meta.s", "set"]),
    ({"fs": frozenset()}, ["meta.fs", "frozenset"]),
    ({"a": [1, np.int64(3)]}, ["meta.a[1]", "int64"]),       # numpy integers are not plain
    ({"f": np.float32(1.5)}, ["meta.f", "float32"]),         # nor numpy float32 (float64 is a float)
    ({"b": np.bool_(True)}, ["meta.b", "bool"]),
    ({"arr": np.zeros(3)}, ["meta.arr", "ndarray"]),
    ({"ba": bytearray(b"x")}, ["meta.ba", "bytearray"]),
    ({"c": 1 + 2j}, ["meta.c", "complex"]),
    ({"x": {1.5: "v"}}, ["1.5", "meta.x", "not a string"]),  # a float key
    ({"x": {1: "v"}}, ["key 1", "not a string"]),
    ({"x": {b"k": "v"}}, ["b'k'", "not a string"]),
    ({"x": {None: "v"}}, ["None", "not a string"]),
    ({"big": 2**64}, ["meta.big", "64 bits"]),
    ({"neg": -(2**63) - 1}, ["meta.neg", "64 bits"]),
    ({"ext": msgpack.ExtType(5, b"xx")}, ["meta.ext", "ExtType"]),
    ({"ts": msgpack.Timestamp(1, 0)}, ["meta.ts", "Timestamp"]),
], ids=["object", "set", "frozenset", "np-int64", "np-float32", "np-bool", "ndarray", "bytearray",
       "complex", "float-key", "int-key", "bytes-key", "none-key", "int-too-big", "int-too-small", "ext",
       "timestamp"])
def test_non_plain_metadata_is_refused_with_the_path(meta, fragments):
    encoding_error(*fragments, meta=meta)


def test_metadata_must_be_a_dict():
    encoding_error("metadata must be a dict", "list", meta=[1, 2])
    encoding_error("metadata must be a dict", "str", meta="x")


def test_metadata_nesting_and_cycles_are_refused_without_recursion_error():
    deep = value = {}
    for _ in range(40):
        value["k"] = {}
        value = value["k"]
    encoding_error("deeper than 32", meta=deep)
    cycle: list = []
    cycle.append(cycle)
    encoding_error("deeper than 32", meta={"c": cycle})


def test_text_that_is_not_valid_unicode_is_a_protocol_error():
    encoding_error("utf-8", meta={"s": "bad \ud800 surrogate"})
    encoding_error("utf-8", tag="tag\udfff")


def test_tag_must_be_a_short_string():
    encoding_error("tag must be a string", "bytes", tag=b"grads")
    encoding_error("tag must be a string", "NoneType", tag=None)
    encoding_error("257 characters", "limit of 256", tag="x" * 257)
    encoding_error("11 characters", "limit of 10", tag="x" * 11, limits=Limits(max_tag_chars=10))


@pytest.mark.parametrize("array, name", [
    (np.array([Opaque(), 1], dtype=object), "object"),
    (np.array(["ab", "c"]), "<U2"),
    (np.array([b"ab"]), "|S2"),
    (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]), "('a', '<i4')"),
    (np.zeros(2, dtype="V8"), "|V8"),
    (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64[D]"),
    (np.zeros(2, dtype=np.longdouble), "float128" if np.dtype(np.longdouble).itemsize == 16 else ""),
], ids=["object", "unicode", "bytes", "structured", "void", "datetime", "longdouble"])
def test_dtypes_outside_the_whitelist_are_refused(array, name):
    if np.dtype(np.longdouble) == np.float64 and array.dtype == np.longdouble:
        pytest.skip("longdouble is float64 on this platform")
    message = encoding_error("cannot be sent", "allowed:", "bfloat16", "astype", buffers=[np.zeros(1), array])
    assert name in message


def test_too_many_buffers():
    encoding_error("3 buffers exceed the limit of 2", buffers=[np.zeros(1)] * 3, limits=Limits(max_buffers=2))
    arrays = [np.zeros(0)] * (DEFAULT_LIMITS.max_buffers + 1)
    encoding_error(f"{len(arrays)} buffers", f"limit of {DEFAULT_LIMITS.max_buffers}", buffers=arrays)
    assert len(decode(encode_bytes(Kind.DATA, "t", None, [np.zeros(0)] * 2, Limits(max_buffers=2))).buffers) == 2


def test_too_many_dimensions():
    encoding_error("3 dimensions", "limit of 2", buffers=[np.zeros((1, 1, 1))], limits=Limits(max_ndim=2))


def test_envelope_over_the_limit():
    message = encoding_error("exceeds the limit of 1048576", "array buffers",
                             meta={"blob": b"\0" * DEFAULT_LIMITS.max_envelope_bytes})
    assert "metadata of" in message
    small = Limits(max_envelope_bytes=64)
    encoding_error("limit of 64", meta={"s": "x" * 100}, limits=small)
    assert decode(encode_bytes(Kind.DATA, "t", {"s": "x" * 10}, limits=small), small).meta == {"s": "x" * 10}


def test_payload_over_a_small_custom_limit():
    small = Limits(max_payload_bytes=100)
    encoding_error("104 bytes", "max_payload_bytes=100", "raise the limit on both ends",
                   buffers=[np.zeros(13)], limits=small)
    encoding_error("max_payload_bytes=100", buffers=[np.zeros(8), np.zeros(8)], limits=small)
    frame = decode(encode_bytes(Kind.DATA, "t", None, [np.zeros(12, np.uint8), np.zeros(11, np.float64)], small),
                   small)
    assert sum(b.nbytes for b in frame.buffers) == 100


def test_encoding_errors_are_stratagem_errors():
    with pytest.raises(StratagemError):
        encode(Kind.DATA, "t", {"x": object()})


# -- decoding refusals ------------------------------------------------------------------------------

GOOD = encode_bytes(Kind.DATA, "grads", {"step": 1}, [np.arange(4, dtype=np.float32), np.ones((2, 2), np.int8)])


def test_the_reference_frame_decodes():
    frame = decode(GOOD)
    assert frame.tag == "grads" and frame.meta == {"step": 1} and len(frame.buffers) == 2


def test_bad_magic():
    refuses(b"HTTP" + GOOD[4:], "bad magic", "b'HTTP'", "Stratagem protocol")
    refuses(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic")


@pytest.mark.parametrize("version", [0, VERSION - 1, VERSION + 1, 255])
def test_other_version(version):
    refuses(raw_frame(env(), version=version), f"protocol version {version}", f"speaks {VERSION}")


@pytest.mark.parametrize("kind", [0, 8, 100, 255])
def test_unknown_kind(kind):
    refuses(raw_frame(env(), kind=kind), f"unknown frame kind {kind}")


@pytest.mark.parametrize("kind", list(Kind))
def test_every_known_kind_decodes(kind):
    assert decode(raw_frame(env(), kind=int(kind))).kind is kind


@pytest.mark.parametrize("flags", [1, 0x8000, 0xFFFF])
def test_nonzero_flags(flags):
    refuses(raw_frame(env(), flags=flags), "unknown frame flags", hex(flags))


def test_envelope_len_over_the_limit():
    refuses(raw_frame(env(), envelope_len=DEFAULT_LIMITS.max_envelope_bytes + 1), "envelope of 1048577 bytes",
            "limit of 1048576")
    refuses(raw_frame(env(tag="x" * 50)), "limit of 16", limits=Limits(max_envelope_bytes=16))
    with pytest.raises(ProtocolError, match="envelope of 4294967295 bytes"):
        read_header(HEADER.pack(MAGIC, VERSION, 1, 0, 2**32 - 1, 0))


def test_payload_len_over_the_limit():
    refuses(raw_frame(env(), payload_len=DEFAULT_LIMITS.max_payload_bytes + 1), "payload of", "exceeds the limit")
    refuses(raw_frame(env(specs=[["uint8", [10]]]), b"\0" * 10), "payload of 10 bytes", "limit of 9",
            limits=Limits(max_payload_bytes=9))


def test_a_header_claiming_a_terabyte_is_refused_from_the_header_alone():
    terabyte = 1 << 40
    header = HEADER.pack(MAGIC, VERSION, int(Kind.DATA), 0, 10, terabyte)
    assert len(header) == HEADER_SIZE
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=f"payload of {terabyte} bytes exceeds the limit"):
            read_header(header)
        with pytest.raises(ProtocolError, match="payload of"):
            decode(header)
        with pytest.raises(ProtocolError, match="payload of"):
            decode_parts([header + b"\0" * 10])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_even_an_allowed_huge_claim_allocates_nothing_before_the_length_check():
    # With limits that would permit it, a tiny frame claiming 1 TB fails on the length check,
    # without allocating anything near the claim.
    roomy = Limits(max_payload_bytes=1 << 41)
    frame = raw_frame(env(specs=[["uint8", [1 << 40]]]), payload_len=1 << 40)
    tracemalloc.start()
    try:
        refuses(frame, "the header says", limits=roomy)
        with pytest.raises(ProtocolError):
            decode_parts([frame, b"\0" * 16], roomy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_read_header_needs_the_whole_header():
    for n in range(HEADER_SIZE):
        with pytest.raises(ProtocolError, match="shorter than the 20-byte header"):
            read_header(GOOD[:n])
    assert read_header(GOOD[:HEADER_SIZE]).kind is Kind.DATA


def test_every_truncation_is_refused():
    for n in range(len(GOOD)):
        with pytest.raises(ProtocolError):
            decode(GOOD[:n])
    refuses(b"", "shorter than")


def test_trailing_garbage_is_refused():
    refuses(GOOD + b"\0", f"frame is {len(GOOD) + 1} bytes", f"the header says {len(GOOD)}")
    refuses(GOOD + GOOD, "the header says")


@pytest.mark.parametrize("envelope", [b"\xc1", b"\x81", b"\xdd\xff\xff\xff\xff", b"\x92\x01",
                                      msgpack.packb(env()) + b"\x00", b"\xd9\x02\xff\xfe",
                                      b"\xdf\xff\xff\xff\xff" + b"\xa1t" * 8],
                         ids=["never-used", "short-map", "huge-array", "short-array", "extra-data",
                              "bad-utf8", "huge-map"])
def test_envelope_that_is_not_msgpack(envelope):
    refuses(raw_frame(envelope=envelope), "not valid msgpack")


def test_envelope_that_is_empty():
    refuses(raw_frame(envelope=b""), "not valid msgpack")


@pytest.mark.parametrize("body", [
    [], ["t", "m", "b"], "tmb", None, 7,
    {"t": "x", "m": {}},                         # missing key
    {"t": "x", "m": {}, "b": [], "z": 1},        # extra key
    {"tag": "x", "meta": {}, "buffers": []},     # wrong names
    {b"t": "x", b"m": {}, b"b": []},             # binary keys
], ids=repr)
def test_envelope_that_is_not_the_right_map(body):
    refuses(raw_frame(body), "exactly the keys 't', 'm', 'b'")


def test_envelope_with_non_string_map_keys_is_refused():
    refuses(raw_frame(envelope=msgpack.packb({1: "x", "m": {}, "b": []})), "not valid msgpack")


@pytest.mark.parametrize("tag", [None, 5, b"bytes", ["x"], {"t": 1}, 1.5, True], ids=repr)
def test_envelope_tag_of_the_wrong_type(tag):
    refuses(raw_frame(env(tag=tag)), "tag must be a string")


def test_envelope_tag_too_long():
    refuses(raw_frame(env(tag="x" * 257)), "at most 256 characters")
    refuses(raw_frame(env(tag="x" * 5)), "at most 4 characters", limits=Limits(max_tag_chars=4))


@pytest.mark.parametrize("meta", [None, [], "x", 1, b"m", [("a", 1)]], ids=repr)
def test_envelope_meta_of_the_wrong_type(meta):
    refuses(raw_frame({"t": "x", "m": meta, "b": []}), "metadata must be a map")


@pytest.mark.parametrize("meta, fragment", [
    ({"k": {b"bin-key": 1}}, "not a string"),
    ({"ext": msgpack.ExtType(1, b"payload")}, "ExtType"),
    ({"list": [msgpack.ExtType(127, b"")]}, "ExtType"),
    ({"ts": msgpack.Timestamp(1_700_000_000, 5)}, "Timestamp"),
], ids=["binary-key", "ext", "ext-in-list", "timestamp"])
def test_envelope_meta_that_is_not_plain(meta, fragment):
    refuses(raw_frame(envelope=msgpack.packb(env(meta=meta), use_bin_type=True)), "meta", fragment)


def test_envelope_meta_with_a_reserved_ext_type():
    # fixext1 with the reserved (negative) code -5, by hand: msgpack cannot build it.
    envelope = b"\x83\xa1t\xa1x\xa1b\x90\xa1m\x81\xa1e\xd4\xfb\x00"
    refuses(raw_frame(envelope=envelope))


def test_envelope_meta_nesting_is_bounded():
    deep = value = {}
    for _ in range(40):
        value["k"] = {}
        value = value["k"]
    refuses(raw_frame(env(meta=deep)), "deeper than 32")
    nested: list = []
    for _ in range(500):  # msgpack itself can go deeper than our check
        nested = [nested]
    refuses(raw_frame(env(meta={"n": nested})), "deeper")


@pytest.mark.parametrize("specs", [
    None, {}, "float32", [["float32"]], [["float32", [1], 0]], [("float32",)], [[3, [1]]],
    [["float32", 4]], [["float32", "4"]], [["float32", None]], [[b"float32", [1]]], [None], ["float32"],
], ids=repr)
def test_envelope_buffer_descriptions_of_the_wrong_shape(specs):
    message = refuses(raw_frame(envelope=msgpack.packb({"t": "x", "m": {}, "b": specs}, use_bin_type=True)))
    assert "buffer" in message


@pytest.mark.parametrize("dtype", ["object", "O", "U10", "<U10", "V8", "S4", "<f8", "float128", "f4",
                                   "datetime64", "int", "Float32", "float32 ", ""])
def test_dtype_not_in_the_whitelist(dtype):
    refuses(raw_frame(env(specs=[[dtype, [1]]]), b"\0" * 8, payload_len=8), f"dtype {dtype!r} is not allowed")


@pytest.mark.parametrize("shape", [[-1], [2, -3], [1.0], [1.5], ["2"], [True], [False, 1], [None], [[2]],
                                   [b"\x02"], [{"a": 1}]], ids=repr)
def test_shape_must_be_non_negative_ints(shape):
    refuses(raw_frame(env(specs=[["uint8", shape]]), b"\0\0", payload_len=2), "non-negative integers")


def test_shape_with_too_many_dimensions():
    refuses(raw_frame(env(specs=[["uint8", [1] * 33]]), b"\0"), "33 dimensions", "limit of 32")
    refuses(raw_frame(env(specs=[["uint8", [1] * 3]]), b"\0"), "limit of 2", limits=Limits(max_ndim=2))
    assert decode(raw_frame(env(specs=[["uint8", [1] * 32]]), b"\0")).buffers[0].shape == (1,) * 32


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [2**63, 0], [0, 2**62, 2**62], [0, 2**40, 2**40, 2**40]],
                         ids=repr)
def test_empty_shapes_with_enormous_dimensions_are_refused(shape):
    # No elements, so no bytes: but numpy cannot represent such a shape.
    refuses(raw_frame(env(specs=[["float32", shape]])), "buffer 0", "shape")


def test_buffer_larger_than_the_payload_limit_is_refused_in_the_spec():
    refuses(raw_frame(env(specs=[["float64", [2**20, 2**20]]])), "buffer 0", f"{2**43} bytes exceed the limit")
    refuses(raw_frame(env(specs=[["float64", [2**40, 2**30]]])), "buffer 0", "too large")


def test_shape_times_itemsize_must_match_the_buffer_length():
    # The envelope says 3 float32 (12 bytes); the header and the payload say 8.
    refuses(raw_frame(env(specs=[["float32", [3]]]), b"\0" * 8), "buffers add up to 12 bytes", "says 8")
    refuses(raw_frame(env(specs=[["float32", [3]]]), b"\0" * 16), "buffers add up to 12 bytes", "says 16")
    refuses(raw_frame(env(specs=[["float32", [2]], ["int8", [3]]]), b"\0" * 12), "add up to 11 bytes")
    # Consistent lengths decode; the two buffers are split where the specs say.
    frame = decode(raw_frame(env(specs=[["int8", [2]], ["uint16", [1]]]), b"\x01\x02\x03\x04"))
    assert frame.buffers[0].tolist() == [1, 2] and frame.buffers[1].tolist() == [0x0403]


def test_header_payload_len_must_match_the_frame():
    refuses(raw_frame(env(specs=[["int8", [4]]]), b"\0" * 4, payload_len=5), "frame is")
    refuses(raw_frame(env(specs=[["int8", [4]]]), b"\0" * 4, envelope_len=len(msgpack.packb(env(specs=[["int8", [4]]]))) + 1))


# -- decode_parts refusals --------------------------------------------------------------------------

def good_parts():
    return encode(Kind.DATA, "p", {"a": 1}, [np.arange(3, dtype=np.int16), np.zeros((2, 2), np.float32)])


def parts_refused(parts, *fragments, limits=DEFAULT_LIMITS) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_parts(parts, limits)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_decode_parts_reference():
    frame = decode_parts(good_parts())
    assert frame.meta == {"a": 1} and frame.buffers[0].tolist() == [0, 1, 2]


def test_decode_parts_number_of_parts_must_match():
    head, b0, b1 = good_parts()
    parts_refused([], "empty message")
    parts_refused([head], "0 buffer parts arrived", "describes 2")
    parts_refused([head, b0], "1 buffer parts arrived", "describes 2")
    parts_refused([head, b0, b1, b1], "3 buffer parts arrived", "describes 2")


def test_decode_parts_buffer_lengths_must_match_the_specs():
    head, b0, b1 = good_parts()
    parts_refused([head, bytes(b0)[:-1], b1], "buffer is 5 bytes", "says 6")
    parts_refused([head, bytes(b0) + b"\0", b1], "buffer is 7 bytes", "says 6")
    parts_refused([head, b1, b0], "buffer is")  # swapped


def test_decode_parts_head_must_be_exactly_header_plus_envelope():
    head, b0, b1 = good_parts()
    parts_refused([head + b"\0", b0, b1], "head part is")
    parts_refused([head[:-1], b0, b1], "head part is")
    parts_refused([head[:10], b0, b1], "shorter than")


def test_decode_parts_header_checks_apply():
    head, b0, b1 = good_parts()
    parts_refused([b"XXXX" + head[4:], b0, b1], "bad magic")
    parts_refused([head[:4] + b"\x09" + head[5:], b0, b1], "version 9")


def test_decode_parts_with_parts_that_are_not_buffers():
    head, b0, b1 = good_parts()
    for bad in (None, 5, "text", [1, 2]):
        parts_refused([head, bad, b1])
        parts_refused([bad, b0, b1])


def test_decode_with_input_that_is_not_a_buffer():
    for bad in (None, 5, "text", [1, 2]):
        with pytest.raises(ProtocolError):
            decode(bad)


# -- property-based fuzzing -------------------------------------------------------------------------

INT_RANGE = st.integers(min_value=-(2**63), max_value=2**64 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
PLAIN_LEAVES = st.none() | st.booleans() | INT_RANGE | FLOATS | st.text(max_size=12) | st.binary(max_size=12)
PLAIN = st.recursive(
    PLAIN_LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=16,
)
METAS = st.dictionaries(st.text(max_size=8), PLAIN, max_size=5)
TAGS = st.text(max_size=40)
KINDS = st.sampled_from(list(Kind))
SMALL_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)


def depth(value) -> int:
    if isinstance(value, (list, tuple)):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@st.composite
def wire_arrays(draw):
    name = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(SMALL_SHAPES)
    if name == "bfloat16":  # hypothesis cannot draw bfloat16 itself: draw its bits
        array = draw(hnp.arrays(np.uint16, shape)).view(ml_dtypes.bfloat16)
    else:
        dtype = DTYPES[name]
        if dtype.itemsize > 1 and draw(st.booleans()):
            dtype = dtype.newbyteorder(">")
        array = draw(hnp.arrays(dtype, shape))
    layout = draw(st.sampled_from(["as-is", "transposed", "strided"]))
    if layout == "transposed":
        array = array.T
    elif layout == "strided" and array.ndim:
        array = array[::2]
    return array


BUFFER_LISTS = st.lists(wire_arrays(), max_size=4)


@FUZZ
@given(kind=KINDS, tag=TAGS, meta=METAS, buffers=BUFFER_LISTS)
def test_fuzz_round_trip_bytes(kind, tag, meta, buffers):
    assume(depth(meta) <= 32)
    frame = decode(encode_bytes(kind, tag, meta, buffers))
    assert frame.kind is kind
    assert frame.tag == tag
    assert same(meta, frame.meta)
    assert len(frame.buffers) == len(buffers)
    for got, sent in zip(frame.buffers, buffers):
        assert_same_array(got, sent)


@FUZZ
@given(kind=KINDS, tag=TAGS, meta=METAS, buffers=BUFFER_LISTS)
def test_fuzz_round_trip_parts(kind, tag, meta, buffers):
    assume(depth(meta) <= 32)
    parts = encode(kind, tag, meta, buffers)
    assert len(parts) == 1 + len(buffers)
    for part, sent in zip(parts[1:], buffers):
        assert isinstance(part, memoryview) and part.nbytes == sent.nbytes
        if sent.flags.c_contiguous and sent.dtype.byteorder != ">" and sent.size:
            assert np.shares_memory(np.frombuffer(part, dtype=np.uint8), sent)
    frame = decode_parts(parts)
    assert (frame.kind, frame.tag) == (kind, tag)
    assert same(meta, frame.meta)
    for got, sent in zip(frame.buffers, buffers):
        assert_same_array(got, sent)
    # The contiguous form of the same frame is the concatenation of the parts.
    assert b"".join(bytes(p) for p in parts) == encode_bytes(kind, tag, meta, buffers)


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data):
    decodes_or_refuses(decode, data)
    decodes_or_refuses(decode_parts, [data])


@FUZZ
@given(tail=st.binary(max_size=200), version=st.sampled_from([VERSION, VERSION, 0, 2]),
       kind=st.integers(0, 9), flags=st.sampled_from([0, 0, 0, 1]), envelope_len=st.integers(0, 220),
       payload_len=st.one_of(st.integers(0, 220), st.integers(0, 2**64 - 1)))
def test_fuzz_random_bytes_behind_a_plausible_header(tail, version, kind, flags, envelope_len, payload_len):
    # Random bytes rarely get past the magic; give them a header that does, so the envelope checks see them.
    data = HEADER.pack(MAGIC, version, kind, flags, envelope_len, payload_len) + tail
    decodes_or_refuses(decode, data)
    head = data[:HEADER_SIZE + envelope_len]
    decodes_or_refuses(decode_parts, [head, data[len(head):]])


# Values near the places where lengths and shapes overflow, for the envelope fuzzer below.
EDGE_INTS = st.sampled_from([0, 1, 2, 3, 4, 7, 8, -1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63,
                             2**64 - 1, -(2**63)])
ANY_SCALAR = (st.none() | st.booleans() | EDGE_INTS | INT_RANGE | FLOATS | st.text(max_size=6)
              | st.binary(max_size=6)
              | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4))
              | st.builds(msgpack.Timestamp, st.integers(0, 2**32 - 1), st.integers(0, 999_999_999)))
ANY_VALUE = st.recursive(
    ANY_SCALAR,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3) | st.binary(max_size=3),
                                                                       children, max_size=3),
    max_leaves=10,
)


def mostly(good, bad, odds: int = 9):
    """``good`` ``odds`` times out of ``odds + 1``, else ``bad``: hostile input that still gets far."""
    # Not 0 for ``bad``: hypothesis draws the smallest value far more often than its share.
    return st.integers(0, odds).flatmap(lambda i: bad if i == 1 else good)


DTYPE_NAMES = mostly(st.sampled_from(sorted(DTYPES)),
                     st.sampled_from(["object", "U10", "V8", "float128", "<f4", ">f8"]) | ANY_VALUE)
#: Shapes with no elements but enormous dimensions: no bytes, but no numpy array either.
EMPTY_HUGE_SHAPES = st.lists(st.sampled_from([0, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]),
                             min_size=2, max_size=4)
SHAPE_LISTS = mostly(st.lists(EDGE_INTS | st.integers(0, 5), max_size=5) | EMPTY_HUGE_SHAPES, ANY_VALUE)
SPECS = mostly(st.lists(mostly(st.tuples(DTYPE_NAMES, SHAPE_LISTS).map(list), ANY_VALUE), max_size=4), ANY_VALUE)
#: Metadata maps whose values may be anything msgpack can carry, extension types and timestamps included.
HOSTILE_METAS = mostly(st.dictionaries(st.text(max_size=4), ANY_SCALAR | ANY_VALUE, min_size=1, max_size=3),
                       METAS | ANY_VALUE, odds=2)


@st.composite
def hostile_envelopes(draw):
    """Envelopes that are nearly right: the right keys with values of any type, any dtype, any shape."""
    body = {"t": draw(mostly(TAGS, ANY_VALUE)), "m": draw(HOSTILE_METAS), "b": draw(SPECS)}
    if draw(st.integers(0, 9)) == 1:
        body[draw(st.text(max_size=2))] = draw(ANY_VALUE)
    return msgpack.packb(body, use_bin_type=draw(mostly(st.just(True), st.just(False))))


def claimed_sizes(envelope: bytes) -> list[int] | None:
    """The byte size of each buffer the envelope describes, where that is a small sane number."""
    try:
        specs = msgpack.unpackb(envelope, raw=False, strict_map_key=False).get("b")
        sizes = []
        for name, shape in specs:
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                return None
            sizes.append(math.prod(shape) * DTYPES[name].itemsize)
    except Exception:
        return None
    return sizes if sum(sizes) <= 256 else None


@settings(FUZZ, max_examples=500)
@given(envelope=hostile_envelopes(), payload=st.binary(max_size=64), lie=mostly(st.just(0), st.integers(-4, 4)),
       kind=st.integers(1, 7), fit=mostly(st.just(True), st.just(False)), fill=st.integers(0, 255))
def test_fuzz_hostile_envelopes(envelope, payload, lie, kind, fit, fill):
    sizes = claimed_sizes(envelope)
    if fit and sizes is not None:  # a payload of exactly the size the specs claim gets past the length checks
        payload = bytes([fill]) * sum(sizes)
    payload_len = max(0, len(payload) + lie)
    data = HEADER.pack(MAGIC, VERSION, kind, 0, len(envelope), payload_len) + envelope + payload
    decodes_or_refuses(decode, data)
    head = data[:HEADER_SIZE + len(envelope)]
    decodes_or_refuses(decode_parts, [head, payload])
    decodes_or_refuses(decode_parts, [head, payload[:len(payload) // 2], payload[len(payload) // 2:]])


@settings(FUZZ, max_examples=500)
@given(envelope=hostile_envelopes(), parts=st.lists(st.binary(max_size=40), max_size=5),
       fit=mostly(st.just(True), st.just(False)))
def test_fuzz_hostile_envelopes_as_parts(envelope, parts, fit):
    sizes = claimed_sizes(envelope)
    if fit and sizes is not None:
        parts = [b"\x01" * n for n in sizes]
    # A header whose payload_len agrees with the parts, so the spec/part checks are what is exercised.
    payload_len = sum(len(p) for p in parts)
    head = HEADER.pack(MAGIC, VERSION, 1, 0, len(envelope), payload_len) + envelope
    decodes_or_refuses(decode_parts, [head, *parts])
    decodes_or_refuses(decode, head + b"".join(parts))


@st.composite
def valid_frames(draw):
    meta = draw(METAS)
    assume(depth(meta) <= 32)
    return encode(draw(KINDS), draw(TAGS), meta, draw(BUFFER_LISTS))


def mutate(draw, data: bytearray, head_len: int) -> bytearray:
    """Apply a few random edits, mostly in the header and envelope where the parsing happens."""
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "truncate", "extend", "splice", "delete", "duplicate"]))
        if not data and op != "extend":
            op = "extend"
        hot = min(len(data), head_len + 4)  # the header, the envelope and a little beyond
        span = hot if hot and draw(st.integers(0, 3)) else len(data)
        pos = draw(st.integers(0, max(0, span - 1)))
        if op == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[pos] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xC1, 0xFF]) | st.integers(0, 255))
        elif op == "truncate":
            del data[pos:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "duplicate":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 8))]
    return data


@FUZZ
@given(parts=valid_frames(), data=st.data())
def test_fuzz_mutated_frames(parts, data):
    whole = bytearray(b"".join(bytes(p) for p in parts))
    mutated = mutate(data.draw, whole, len(parts[0]))
    decodes_or_refuses(decode, bytes(mutated))
    decodes_or_refuses(decode, mutated)


@FUZZ
@given(parts=valid_frames(), data=st.data())
def test_fuzz_mutated_parts(parts, data):
    draw = data.draw
    parts = [bytearray(p) for p in parts]
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["head", "head", "buffer", "drop", "add", "swap"]))
        if op == "head" and parts:
            parts[0] = mutate(draw, parts[0], len(parts[0]))
        elif op == "buffer" and len(parts) > 1:
            i = draw(st.integers(1, len(parts) - 1))
            parts[i] = mutate(draw, parts[i], 0)
        elif op == "drop" and parts:
            del parts[draw(st.integers(0, len(parts) - 1))]
        elif op == "add":
            parts.insert(draw(st.integers(0, len(parts))), bytearray(draw(st.binary(max_size=16))))
        elif op == "swap" and len(parts) > 1:
            i, j = draw(st.integers(0, len(parts) - 1)), draw(st.integers(0, len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
    decodes_or_refuses(decode_parts, parts)
    decodes_or_refuses(decode_parts, [bytes(p) for p in parts])


@FUZZ
@given(parts=st.lists(st.binary(max_size=64), max_size=6))
def test_fuzz_arbitrary_lists_of_parts(parts):
    decodes_or_refuses(decode_parts, parts)
    if parts:
        # The same parts behind a well-formed header, so they are seen by the later checks too.
        body = msgpack.packb({"t": "x", "m": {}, "b": [["uint8", [len(p)]] for p in parts[1:]]})
        head = HEADER.pack(MAGIC, VERSION, 1, 0, len(body), sum(len(p) for p in parts[1:])) + body
        frame = decodes_or_refuses(decode_parts, [head, *parts[1:]])
        assert frame is not None and [b.tobytes() for b in frame.buffers] == parts[1:]


#: Text that may hold lone surrogates, which Python strings allow and UTF-8 cannot encode.
WILD_TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=6)


@FUZZ
@given(meta=st.dictionaries(WILD_TEXT | st.integers() | st.floats() | st.binary(max_size=3),
                            ANY_VALUE | WILD_TEXT | st.sets(st.integers(), max_size=2) | st.just(object()),
                            max_size=4),
       tag=st.text(max_size=300) | WILD_TEXT | st.binary(max_size=3) | st.none())
def test_fuzz_encode_raises_only_protocol_error(meta, tag):
    # Whatever the caller passes as tag and metadata, encoding succeeds (and round-trips) or says why.
    try:
        data = encode_bytes(Kind.DATA, tag, meta)
    except ProtocolError:
        return
    frame = decode(data)
    assert frame.tag == tag and same(meta, frame.meta)


def test_an_exception_raised_in_this_thread_while_decoding_is_not_taken_for_garbage():
    """A signal handler's exception (a user's SIGUSR1 handler that raises, an alarm) that lands during
    the decode is the program's, not the peer's: it must not be turned into a dropped frame."""
    import signal

    class Alarm(Exception):
        pass

    def ring(signum, frame):
        raise Alarm()

    envelope = msgpack.packb({"t": "x", "m": {"v": list(range(200_000))}, "b": []})
    header = wire.Header(wire.Kind.DATA, 0, len(envelope), 0)
    limits = wire.Limits(max_envelope_bytes=1 << 24)
    previous = signal.signal(signal.SIGALRM, ring)
    caught = []
    try:
        for _ in range(30):
            signal.setitimer(signal.ITIMER_REAL, 0.003)
            try:
                while True:
                    wire.read_envelope(header, envelope, limits)
            except Alarm:
                caught.append("alarm")
            except wire.ProtocolError as exc:
                caught.append(str(exc))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert caught and all(c == "alarm" for c in caught), [c for c in caught if c != "alarm"][:3]
