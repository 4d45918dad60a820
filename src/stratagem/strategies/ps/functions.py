"""How the ``parameter_server`` coordinator sends step functions, their arguments and their results.

Arguments and results travel as plain data plus array buffers (no pickle): numbers, strings, bytes,
``None``, lists, tuples, dicts with string keys, numpy arrays and scalars, and *references* to what
every task has its own copy of: a ``stratagem.Variable`` (by name), the strategy's optimizer (by its
config), a per-worker dataset iterator (by id).

Functions travel one of two ways:

- **by name** (the default): the module and qualified name of a module-level function; the worker
  finds it in its own copy of the program (every task runs the same script, so a function defined
  before ``stratagem.strategy(...)`` in the main script, or in any importable module, is there). A
  hash of the bytecode catches a worker running another version of the code.
- **with cloudpickle**, for lambdas, nested functions and functions defined after the strategy: only
  when the cluster is authenticated (the transport has a cluster secret: ``STRATAGEM_SECRET``, which
  ``stratagem launch`` sets), because unpickling runs code: an unauthenticated peer could make a
  worker run anything. Workers refuse pickled functions when they have no secret themselves.

    >>> import numpy as np
    >>> skeleton, arrays, refs = encode_value({"x": np.arange(3), "n": (1, "a")})
    >>> decode_value(skeleton, arrays, resolve=None)
    {'x': array([0, 1, 2]), 'n': (1, 'a')}
    >>> function_ref(np.mean)["kind"], function_ref(np.mean)["qualname"]
    ('name', 'mean')
"""

from __future__ import annotations

import hashlib
import importlib
import io
import pickle
import sys
import types
from typing import Any, Callable

import numpy as np

from stratagem.core import user_code
from stratagem.core.errors import ConfigurationError, StratagemError
from stratagem.core.wire import DTYPES, dtype_name

#: What the plain codec carries as a leaf, besides arrays and references.
_PLAIN = (type(None), bool, int, float, str, bytes)
_ARRAY, _TUPLE, _DICT, _VAR, _OPT, _ITER = "__a__", "__t__", "__d__", "__var__", "__opt__", "__iter__"

_HOW_TO_ENABLE = ("authenticate the cluster with a secret (set STRATAGEM_SECRET to the same value on every "
                  "task; `stratagem launch` does it for you) so that functions may be sent with cloudpickle")


class FunctionNotFound(StratagemError):
    """A worker has no function of the name the coordinator sent."""


def code_hash(fn: Callable) -> str:
    """A short hash of ``fn``'s bytecode and names (same code on every task: same hash)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    digest = hashlib.sha1(code.co_code)
    digest.update(repr(code.co_names).encode())
    return digest.hexdigest()[:16]


def by_name_problem(fn: Callable) -> str | None:
    """Why ``fn`` cannot be sent by name, or ``None`` if it can."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname:
        return f"{fn!r} has no module-level name"
    if "<lambda>" in qualname:
        return f"{qualname} is a lambda"
    if "<locals>" in qualname:
        return f"{qualname} is defined inside another function"
    target = sys.modules.get(module)
    found = target
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not fn and getattr(found, "__wrapped__", None) is not fn:
        return f"{module}.{qualname} does not name it (it was redefined, or it is a bound method)"
    return None


def function_ref(fn: Callable) -> dict:
    """The by-name description of ``fn`` (check :func:`by_name_problem` first)."""
    return {"kind": "name", "module": fn.__module__, "qualname": fn.__qualname__, "code": code_hash(fn)}


def resolve_by_name(ref: dict, where: str) -> Callable:
    """The function ``ref`` names, in this process; ``FunctionNotFound`` if there is none."""
    module_name, qualname = ref.get("module"), ref.get("qualname")
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        raise FunctionNotFound(f"{where} got a function reference without a module and a name")
    module = sys.modules.get(module_name)
    # Only the user's own code is searched: a peer must not be able to name, say, subprocess.run.
    try:
        if module is None and module_name != "__main__":
            user_code.check_importable_user_module(module_name)
            module = importlib.import_module(module_name)
        if module is not None and not user_code.is_user_module(module):
            raise ConfigurationError(user_code.NOT_USER.format(name=module_name))
    except ConfigurationError as exc:
        raise FunctionNotFound(f"{where} refuses {module_name}.{qualname}: {exc}") from None
    except ImportError as exc:
        raise FunctionNotFound(f"{where} cannot import module {module_name!r} for {qualname}: {exc}") from None
    found = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not None and not (isinstance(found, types.FunctionType)
                                  and user_code.is_user_module(sys.modules.get(found.__module__))):
        # Only Python functions of the user's code: not builtins re-exported by it (os.system...).
        raise FunctionNotFound(f"{where} refuses {module_name}.{qualname}: "
                               + user_code.NOT_USER.format(name=getattr(found, "__module__", None) or module_name))
    if not callable(found):
        hint = (" define it in the script before the call to stratagem.strategy(...) (workers serve inside that "
                "call, so what comes after it does not exist there), or in an importable module, or "
                + _HOW_TO_ENABLE) if module_name == "__main__" else ""
        raise FunctionNotFound(f"{where} has no function {module_name}.{qualname};{hint}")
    if ref.get("code") and code_hash(found) != ref["code"]:
        raise FunctionNotFound(f"{where} has another version of {module_name}.{qualname} than the coordinator: "
                               f"run the same program on every task")
    return found


# -- cloudpickle, for authenticated clusters -----------------------------------------------------------------

def require_cloudpickle():
    try:
        import cloudpickle
    except ImportError:
        raise ConfigurationError("sending functions by value needs cloudpickle: pip install cloudpickle") from None
    return cloudpickle


def pickle_function(fn: Callable, persistent_id: Callable[[Any], Any]) -> bytes:
    """``fn`` serialised with cloudpickle; objects ``persistent_id`` names travel as references."""
    cloudpickle = require_cloudpickle()
    buffer = io.BytesIO()
    pickler = cloudpickle.CloudPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = persistent_id
    pickler.dump(fn)
    return buffer.getvalue()


def unpickle_function(data: bytes, persistent_load: Callable[[Any], Any]) -> Callable:
    """The inverse of :func:`pickle_function` (call it only for an authenticated peer)."""
    require_cloudpickle()
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = persistent_load
    return unpickler.load()


# -- values --------------------------------------------------------------------------------------------------

def encode_value(value, reference: Callable[[Any], Any] | None = None, what: str = "the value", root: str = "it"):
    """``(skeleton, arrays, refs)``: plain data with array placeholders, the arrays, and the references
    (``reference(obj)`` returns ``{"__var__": name}`` and the like for objects it knows, else ``None``)."""
    arrays: list = []
    refs: list = []

    def walk(node, path):
        if reference is not None:
            ref = reference(node)
            if ref is not None:
                refs.append(ref)
                return ref
        if isinstance(node, _PLAIN):
            return node
        if isinstance(node, (np.ndarray, np.generic)):
            array = np.asarray(node)
            try:
                dtype_name(array.dtype)
            except Exception:  # noqa: BLE001 - reported with the path
                raise ConfigurationError(f"{what}: {path} has dtype {array.dtype}, which cannot be sent") from None
            arrays.append(np.ascontiguousarray(array) if array.ndim else array.reshape(()))
            return {_ARRAY: len(arrays) - 1, "scalar": isinstance(node, np.generic)}
        if isinstance(node, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise ConfigurationError(f"{what}: {path} is a dict with non-string keys, which cannot be sent")
            return {_DICT: {k: walk(v, f"{path}[{k!r}]" if path else k) for k, v in node.items()}}
        if type(node).__module__.startswith("torch") and hasattr(node, "detach"):
            return walk(node.detach().cpu().numpy(), path)
        raise ConfigurationError(
            f"{what}: {path} is a {type(node).__name__}, which cannot be sent between tasks; pass numbers, "
            f"strings, arrays, lists, tuples, dicts, stratagem Variables, the optimizer or a per-worker iterator"
        )

    return walk(value, root), arrays, refs


def decode_value(skeleton, arrays: list, resolve: Callable[[dict], Any] | None):
    """The inverse of :func:`encode_value`; ``resolve(ref)`` turns a reference into the local object."""
    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if _ARRAY in node:
                array = arrays[node[_ARRAY]]
                return array[()] if node.get("scalar") else array
            if _TUPLE in node:
                return tuple(walk(v) for v in node[_TUPLE])
            if _DICT in node:
                return {k: walk(v) for k, v in node[_DICT].items()}
            if resolve is None:
                raise StratagemError(f"a reference {node!r} arrived where none was expected")
            return resolve(node)
        return node
    return walk(skeleton)


def own_arrays(arrays: list) -> list:
    """Copies of received buffers (they may be views of transport memory) that the program may keep."""
    return [np.array(a, copy=True) for a in arrays]


def is_wire_dtype(dtype) -> bool:
    return np.dtype(dtype) in DTYPES.values()
