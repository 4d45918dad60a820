"""Nested values between tasks as plain metadata plus array buffers, never pickled.

A step's arguments and results (``in_graph``, ``parameter_server``) are trees: tuples, lists and dicts
(keys: strings, or numbers, booleans and ``None``) whose leaves are ``None``, booleans, integers (64
bits), floats, strings, bytes, numpy arrays and scalars, or arrays of another kind (cupy arrays are
copied off the device, PyTorch tensors detached, anything else with a ``shape`` and a ``dtype`` read
with ``np.asarray``). :func:`encode` turns one into ``(skeleton, arrays)``: the skeleton is plain data
for a message's metadata, the arrays go as the message's buffers (of the wire's dtypes). A strategy may
send objects that every task has its own copy of (its variables, say) as *references*: its
``reference(obj)`` hook returns plain data for them, and :func:`decode`'s ``resolve`` hook turns that
back into the receiver's object.

The skeleton, node by node: a plain leaf is itself; a list is a list of nodes; every other node is a
map of one key: ``{"t": [...]}`` a tuple, ``{"d": {key: node}}`` a dict with string keys, ``{"k":
[[key, node], ...]}`` a dict with other keys, ``{"a": i}`` array ``i``, ``{"s": i}`` a numpy scalar
(array ``i``, 0-d), ``{"r": ...}`` a reference. :func:`decode` checks all of it, since a peer may send
anything: every node's type and shape, every buffer index (in range, each buffer used exactly once,
scalars 0-d), the nesting depth. A malformed value is a :class:`~stratagem.core.errors.ProtocolError`
naming what is wrong, and nothing else.

    >>> import numpy as np
    >>> skeleton, arrays = encode({"x": np.arange(3), "n": (1, "a"), 2: np.float32(0.5)})
    >>> skeleton
    {'k': [['x', {'a': 0}], ['n', {'t': [1, 'a']}], [2, {'s': 1}]]}
    >>> decode(skeleton, arrays)
    {'x': array([0, 1, 2]), 'n': (1, 'a'), 2: np.float32(0.5)}
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError, ProtocolError
from stratagem.core.wire import DTYPES, dtype_name

#: Deepest nesting encoded or decoded (a value that contains itself would otherwise recurse forever).
MAX_DEPTH = 100
_PLAIN = (type(None), bool, int, float, str, bytes)
_KEYS = (type(None), bool, int, float, str)
_INT_RANGE = (-(1 << 63), 1 << 64)          # what msgpack carries
_SENDABLE = ("use arrays, numbers, strings, bytes, None, and tuples, lists or dicts of them")


def to_host(leaf) -> np.ndarray:
    """An array of any kind as a host numpy array (cupy copied off its device, torch detached)."""
    if type(leaf) is np.ndarray:
        return leaf
    module = type(leaf).__module__.partition(".")[0]
    if module == "cupy":
        return leaf.get()
    if module == "torch" and hasattr(leaf, "detach"):
        return leaf.detach().cpu().numpy()
    return np.asarray(leaf)


def encode(value, *, reference: Callable[[Any], Any] | None = None, what: str = "the value",
           root: str = "", sendable: str = _SENDABLE) -> tuple[Any, list[np.ndarray]]:
    """``value`` as ``(skeleton, arrays)`` (see the module doc).

    ``reference(obj)`` returns plain data for the objects that travel as references, else ``None``.
    Anything that cannot be sent is a ``ConfigurationError`` naming ``what`` and where it is (``root``
    and the path below it); ``sendable`` says what can be sent instead.
    """
    arrays: list[np.ndarray] = []

    def refuse(trail, problem):
        raise ConfigurationError(f"{what}: {_path(trail, root) or 'it'} {problem}")

    def array(node, trail, kind):
        host = to_host(node)
        try:
            dtype_name(host.dtype)
        except Exception:  # noqa: BLE001 - reported with the path
            refuse(trail, f"is an array of dtype {host.dtype}, which cannot be sent between tasks; allowed: "
                          f"{', '.join(DTYPES)} (convert with .astype())")
        arrays.append(host)
        return {kind: len(arrays) - 1}

    # ``trail`` is (parent's trail, key), made into a path only for an error: most values have none.
    def walk(node, trail, depth):
        if depth > MAX_DEPTH:
            refuse(trail, f"nests deeper than {MAX_DEPTH} levels (does the value contain itself?)")
        if reference is not None:
            ref = reference(node)
            if ref is not None:
                return {"r": ref}
        kind = type(node)
        if kind is np.ndarray:
            return array(node, trail, "a")
        if isinstance(node, np.generic) and not isinstance(node, (str, bytes)):   # np.float64 is a float too
            return array(node, trail, "s")
        if isinstance(node, _PLAIN):
            if isinstance(node, int) and not isinstance(node, bool) and not _INT_RANGE[0] <= node < _INT_RANGE[1]:
                refuse(trail, "is an integer that does not fit in 64 bits; send it as a string or a float")
            return node
        if isinstance(node, (tuple, list)):
            items = [walk(v, (trail, i), depth + 1) for i, v in enumerate(node)]
            return {"t": items} if isinstance(node, tuple) else items
        if kind is dict or isinstance(node, Mapping):
            if all(type(k) is str for k in node):
                return {"d": {k: walk(v, (trail, k), depth + 1) for k, v in node.items()}}
            bad = [k for k in node if not isinstance(k, _KEYS)]
            if bad:
                refuse(trail, f"is a dict with a key of type {type_name(bad[0])}; keys sent between tasks must "
                              f"be strings, numbers, booleans or None")
            return {"k": [[k, walk(v, (trail, k), depth + 1)] for k, v in node.items()]}
        if isinstance(node, np.ndarray) or (hasattr(node, "shape") and hasattr(node, "dtype")):
            return array(node, trail, "a")
        refuse(trail, f"is a {type_name(node)}, which cannot be sent between tasks: {sendable}")

    return walk(value, None, 0), arrays


def _path(trail, root: str = "") -> str:
    """``args[0]['lr']`` from a trail of (parent's trail, key) pairs (a string key first reads bare)."""
    keys = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    path = root
    for key in reversed(keys):
        path = f"{path}[{key!r}]" if path or not isinstance(key, str) else key
    return path


def decode(skeleton, arrays: list, *, resolve: Callable[[Any], Any] | None = None):
    """The value :func:`encode` described; ``resolve(ref)`` turns a reference into the local object.

    Arrays come back as numpy arrays the program may keep and write (the message's own buffers, copied
    only when read-only). Anything malformed is a ``ProtocolError`` (see the module doc).

    >>> decode({"a": 5}, [])
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ProtocolError: malformed value: it refers to buffer 5, but 0 came with it
    """
    used = [False] * len(arrays)

    def bad(trail, problem):
        raise ProtocolError(f"malformed value: {_path(trail) or 'it'} {problem}")

    def buffer(index, trail, scalar):
        if type(index) is not int or not 0 <= index < len(arrays):
            bad(trail, f"refers to buffer {index!r}, but {len(arrays)} came with it")
        if used[index]:
            bad(trail, f"refers to buffer {index} again (each buffer is one value)")
        used[index] = True
        array = arrays[index]
        if not isinstance(array, np.ndarray):
            array = to_host(array)
        if scalar:
            if array.ndim != 0:
                bad(trail, f"is a scalar in buffer {index}, which has shape {array.shape}")
            return array[()]
        return array if array.flags.writeable else array.copy()

    def walk(node, trail, depth):
        if depth > MAX_DEPTH:
            bad(trail, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, _PLAIN):
            return node
        if isinstance(node, list):
            return [walk(v, (trail, i), depth + 1) for i, v in enumerate(node)]
        if not isinstance(node, dict) or len(node) != 1:
            bad(trail, f"is a {type_name(node)}, not a value description (a plain value, a list, or a map of "
                       f"one key)")
        (kind, body), = node.items()
        if kind in ("a", "s"):
            return buffer(body, trail, kind == "s")
        if kind == "t" and isinstance(body, list):
            return tuple(walk(v, (trail, i), depth + 1) for i, v in enumerate(body))
        if kind == "d" and isinstance(body, dict):
            if not all(isinstance(k, str) for k in body):
                bad(trail, "is a dict description with keys that are not strings")
            return {k: walk(v, (trail, k), depth + 1) for k, v in body.items()}
        if kind == "k" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], _KEYS)):
                    bad(trail, "is a dict description whose entries are not [key, value] pairs")
                out[pair[0]] = walk(pair[1], (trail, pair[0]), depth + 1)
            return out
        if kind == "r":
            if resolve is None:
                bad(trail, f"is a reference {body!r}, where none may be")
            return resolve(body)
        bad(trail, f"is a description of kind {kind!r} with a {type_name(body)}; expected one of a, s, t, d, k, r")

    value = walk(skeleton, None, 0)
    if not all(used):
        bad(None, f"uses {sum(used)} of the {len(arrays)} buffers that came with it")
    return value


def encode_call(args, kwargs, **options) -> tuple[Any, list[np.ndarray]]:
    """A function call's arguments, ``{"args": args, "kwargs": kwargs}``, as :func:`encode` does (paths in
    messages read ``args[0]``, ``kwargs['lr']``)."""
    return encode({"args": tuple(args), "kwargs": dict(kwargs)}, **options)


def decode_call(skeleton, arrays: list, *, resolve: Callable[[Any], Any] | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that :func:`encode_call` described; a ``ProtocolError`` if they are not that.

    >>> decode_call(*encode_call((1, np.zeros(2)), {"lr": 0.5}))
    ((1, array([0., 0.])), {'lr': 0.5})
    """
    call = decode(skeleton, arrays, resolve=resolve)
    if not (isinstance(call, dict) and set(call) == {"args", "kwargs"} and isinstance(call["args"], tuple)
            and isinstance(call["kwargs"], dict) and all(isinstance(k, str) for k in call["kwargs"])):
        raise ProtocolError("malformed value: it is not a call's arguments ({'args': tuple, 'kwargs': dict of str})")
    return call["args"], call["kwargs"]


def type_name(obj) -> str:
    """The name of ``obj``'s type for messages (``object``, ``numpy.ndarray``).

    >>> type_name(object()), type_name(np.zeros(1))
    ('object', 'numpy.ndarray')
    """
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
