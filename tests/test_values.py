"""stratagem.strategies.remote_calls.values: nested step arguments and results as plain metadata plus array buffers.

- round trips of every leaf type and nesting, straight and through the real wire format (msgpack
  envelope + raw buffers, as every byte-moving transport sends them);
- references (the strategies' variables and iterators) through the hooks;
- what cannot be sent is refused naming where it is;
- hostile skeletons (from a peer): wrong counts, out-of-range or reused buffer indices, scalars over
  arrays, wrong node types, unknown kinds, nesting deeper than allowed: a ProtocolError naming the
  problem, never another exception or a crash.
"""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple

import ml_dtypes
import numpy as np
import pytest

from stratagem.core import wire
from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.strategies.remote_calls.values import MAX_DEPTH, decode, decode_call, encode, encode_call

pytestmark = pytest.mark.timeout(60)

Point = namedtuple("Point", "x y")


def through_the_wire(skeleton, arrays):
    """What a peer receives: the skeleton in a frame's metadata, the arrays as its buffers."""
    frame = wire.decode(wire.encode_bytes(wire.Kind.DATA, "step", {"value": skeleton}, arrays))
    return frame.meta["value"], frame.buffers


def round_trip(value, **kwargs):
    skeleton, arrays = encode(value, **kwargs.pop("encode", {}))
    return decode(*through_the_wire(skeleton, arrays), **kwargs)


def same(a, b) -> bool:
    """Equal, with the same types all the way down (arrays: same dtype, shape and values)."""
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        return type(a) is type(b) and a.dtype == b.dtype and np.shape(a) == np.shape(b) and (
            np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return type(b) is float and math.isnan(b)
    return type(a) is type(b) and a == b


PLAIN = [None, True, False, 0, -(1 << 63), (1 << 64) - 1, 1.5, float("inf"), float("nan"), "", "naïve ☃", b"",
         b"\x00\xff raw"]


@pytest.mark.parametrize("leaf", PLAIN, ids=repr)
def test_plain_leaves_round_trip(leaf):
    assert same(leaf, round_trip(leaf))


@pytest.mark.parametrize("dtype", list(wire.DTYPES))
def test_arrays_and_scalars_of_every_wire_dtype_round_trip(dtype):
    array = (np.arange(6) % 2).astype(wire.DTYPES[dtype]).reshape(2, 3)
    for value in (array, array[:, 1], array[0, 0], np.zeros((0, 4), wire.DTYPES[dtype]), np.asarray(array[1, 2])):
        back = round_trip(value)
        assert same(value, back), (value, back)
        if isinstance(back, np.ndarray):
            back[...] = 0                           # the program may write what it got


def test_numpy_scalars_keep_their_type_and_strings_stay_strings():
    value = [np.float64(0.25), np.int8(-3), np.bool_(True), np.str_("s"), np.bytes_(b"b"), np.float32("nan")]
    back = round_trip(value)
    assert [type(v) for v in back] == [np.float64, np.int8, np.bool_, str, bytes, np.float32]
    assert back[:3] == [0.25, -3, True] and back[3:5] == ["s", b"b"] and np.isnan(back[5])


def test_nesting_round_trips():
    value = {
        "args": (np.arange(4.0), [1, (2, [3, {"deep": np.ones((2, 2), np.float32)}])], Point(1, np.int64(2))),
        "kwargs": OrderedDict(lr=0.1, mask=np.array([True, False]), empty=(), nothing=[], none={}),
        "keys": {1: "one", 2.5: "two and a half", None: "none", -7: b"minus", "s": (None,)},
    }
    back = round_trip(value)
    expected = dict(value, kwargs=dict(value["kwargs"]))
    expected["args"] = (value["args"][0], value["args"][1], (1, np.int64(2)))      # a namedtuple is a tuple
    assert same(expected, back)
    assert list(back["keys"]) == [1, 2.5, None, -7, "s"]


def test_other_array_kinds_arrive_as_numpy(fake_cupy):
    device = fake_cupy.arange(3.0)
    strided = np.arange(12.0).reshape(3, 4)[:, ::2]
    swapped = np.arange(3, dtype=">i4")
    back = round_trip({"gpu": device, "strided": strided, "big_endian": swapped})
    assert type(back["gpu"]) is np.ndarray and back["gpu"].tolist() == [0.0, 1.0, 2.0]
    assert back["strided"].tolist() == strided.tolist() and back["big_endian"].tolist() == [0, 1, 2]


def test_torch_tensors_arrive_as_numpy():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    tensor = torch.arange(4.0, requires_grad=True) * 2
    back = round_trip((tensor, torch.tensor(3, dtype=torch.int16)))
    assert type(back[0]) is np.ndarray and back[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert back[1].dtype == np.int16 and back[1].shape == ()


def test_read_only_buffers_are_copied_writable_ones_are_kept():
    skeleton, arrays = encode((np.arange(3), np.arange(3)))
    arrays[0].setflags(write=False)
    back = decode(skeleton, arrays)
    assert back[0].flags.writeable and back[0] is not arrays[0] and back[1] is arrays[1]


def test_references_travel_through_the_hooks():
    class Var:
        def __init__(self, name):
            self.name = name

    here = {"w": Var("w"), "b": Var("b")}
    value = {"grads": [(np.ones(2), Var("w")), (np.zeros(1), Var("b"))], "n": 3}
    skeleton, arrays = encode(value, reference=lambda obj: {"var": obj.name} if isinstance(obj, Var) else None)
    back = decode(*through_the_wire(skeleton, arrays), resolve=lambda ref: here[ref["var"]])
    assert back["grads"][0][1] is here["w"] and back["grads"][1][1] is here["b"] and back["n"] == 3
    with pytest.raises(ProtocolError, match=r"malformed value: grads\[0\]\[1\] is a reference \{'var': 'w'\}, "
                                            r"where none may be"):
        decode(skeleton, arrays)


# -- what cannot be sent -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ({"x": [1, object()]}, r"the step's result: x\[1\] is a object, which cannot be sent between tasks: use arrays"),
    ({1, 2}, "the step's result: it is a set, which cannot be sent"),
    ({(1, 2): 3}, r"it is a dict with a key of type tuple; keys sent between tasks must be strings"),
    ({"a": np.array(["x"])}, r"a is an array of dtype <U1, which cannot be sent between tasks; allowed: bool, "),
    ([np.array([object()])], r"\[0\] is an array of dtype object"),
    ((np.datetime64("2024-01-01"),), r"\[0\] is an array of dtype datetime64\[D\]"),
    ([1 << 64], r"\[0\] is an integer that does not fit in 64 bits"),
    ([-(1 << 63) - 1], r"\[0\] is an integer that does not fit in 64 bits"),
    (bytearray(b"x"), "it is a bytearray, which cannot be sent"),
    (ml_dtypes.float8_e4m3fn(1), "it is an array of dtype float8_e4m3fn"),
])
def test_what_cannot_be_sent_is_refused_naming_where(value, message):
    with pytest.raises(ConfigurationError, match=message):
        encode(value, what="the step's result")


def test_a_value_that_contains_itself_is_refused():
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(ConfigurationError, match=rf"nests deeper than {MAX_DEPTH} levels \(does the value contain"):
        encode(loop)


def test_what_the_strategy_accepts_besides_is_said():
    with pytest.raises(ConfigurationError, match="pass numbers or the optimizer"):
        encode(object(), sendable="pass numbers or the optimizer")


# -- hostile skeletons --------------------------------------------------------------------------------------------

ONE = [np.arange(3.0)]


def short(value) -> str:
    try:
        return repr(value)[:40]
    except RecursionError:
        return "very deep"


def nested(depth: int):
    node: object = 1
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.parametrize("skeleton, arrays, message", [
    ({"a": 1}, ONE, r"it refers to buffer 1, but 1 came with it"),
    ({"a": -1}, ONE, r"refers to buffer -1"),
    ({"a": 1 << 62}, ONE, r"refers to buffer 4611686018427387904"),
    ({"a": 10 ** 30}, ONE, r"refers to buffer 1000000000000000000000000000000"),
    ({"a": True}, ONE, r"refers to buffer True"),
    ({"a": "0"}, ONE, r"refers to buffer '0'"),
    ({"a": 0.0}, ONE, r"refers to buffer 0.0"),
    ([{"a": 0}, {"a": 0}], ONE, r"\[1\] refers to buffer 0 again"),
    ({"a": 0}, ONE * 2, r"it uses 1 of the 2 buffers that came with it"),
    (None, ONE, r"it uses 0 of the 1 buffers"),
    ({"s": 0}, ONE, r"it is a scalar in buffer 0, which has shape \(3,\)"),
    ({"a": 0, "t": []}, ONE, r"it is a dict, not a value description"),
    ({}, [], r"it is a dict, not a value description"),
    ({"x": 1}, [], r"it is a description of kind 'x' with a int; expected one of a, s, t, d, k, r"),
    ({"t": {"a": 0}}, ONE, r"it is a description of kind 't' with a dict"),
    ({"d": [["k", 1]]}, [], r"it is a description of kind 'd' with a list"),
    ({"d": {1: 2}}, [], r"it is a dict description with keys that are not strings"),
    ({"k": [["a"]]}, [], r"entries are not \[key, value\] pairs"),
    ({"k": [[["a"], 1]]}, [], r"entries are not \[key, value\] pairs"),
    ({"k": {"a": 1}}, [], r"kind 'k' with a dict"),
    ({"d": {"x": {"t": [{"d": {"y": {"a": 3}}}]}}}, ONE, r"x\[0\]\['y'\] refers to buffer 3"),
    ((1, 2), [], r"it is a tuple, not a value description"),
    ({"t": [object()]}, [], r"\[0\] is a object, not a value description"),
    (nested(MAX_DEPTH + 1), [], f"nests deeper than {MAX_DEPTH} levels"),
    (nested(100_000), [], f"nests deeper than {MAX_DEPTH} levels"),
], ids=lambda x: short(x))
def test_hostile_skeletons_are_a_protocol_error(skeleton, arrays, message):
    with pytest.raises(ProtocolError, match=r"^malformed value: (.* )?" + message):
        decode(skeleton, list(arrays), resolve=lambda ref: ref)


def test_at_the_depth_limit_a_value_still_decodes():
    assert decode(nested(MAX_DEPTH), []) == nested(MAX_DEPTH)


def test_a_calls_arguments_round_trip_and_anything_else_is_refused():
    skeleton, arrays = encode_call([np.arange(2), "x"], {"lr": np.float32(0.5)})
    args, kwargs = decode_call(*through_the_wire(skeleton, arrays))
    assert same(args, (np.arange(2), "x")) and same(kwargs, {"lr": np.float32(0.5)})
    for forged in ({"d": {"args": [], "kwargs": {"d": {}}}},                 # args a list
                   {"d": {"args": {"t": []}}},                                # no kwargs
                   {"d": {"args": {"t": []}, "kwargs": {"k": [[1, 2]]}}},     # a kwarg that is not a name
                   {"t": [{"t": []}, {"d": {}}]}):                            # a tuple, not the call's map
        with pytest.raises(ProtocolError, match="it is not a call's arguments"):
            decode_call(forged, [])
