"""How an ``in_graph`` step function reaches a remote replica: by name, or serialized when authenticated.

**By name** (no code on the wire): a function defined at the top level of the script, or of a module of
your own code, travels as ``module:qualname``. Every task runs the same script, so the replica finds
the same function: for the script itself, the replica imports a fresh copy of it (as ``multiprocessing``
does, under another ``__name__``): its top level runs again there, creating the variables and defining
the functions, which is why the training loop must sit under ``if __name__ == "__main__":``. In that
import ``stratagem.strategy("in_graph", ...)`` returns the replica's own strategy, so the script's
variables become the replica's copies of the client's. Only functions of your code are found this
way: never one of the standard library or of an installed package (a peer could otherwise ask a
replica to run, say, ``subprocess.run``).

**Serialized** (lambdas, closures, ``functools.partial``, bound methods...): with cloudpickle, and only
when the cluster is authenticated (a cluster secret: ``STRATAGEM_SECRET``, which ``stratagem launch``
sets by default); a replica never unpickles anything from an unauthenticated peer. Variables,
optimizers, the strategy, and arrays or PyTorch tensors that are views of a variable's buffer travel
as references, resolved on the replica to its own copies; everything else the function holds is copied
when it is first sent (a function object is serialized once: like ``tf.function``, later changes to
what it closes over are not seen; pass changing values as arguments).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import itertools
import os
import pickle
import sys
import types
import weakref
from collections import OrderedDict
from typing import Any, Callable

from stratagem.core import user_code
from stratagem.core.errors import ConfigurationError
from stratagem.training.optimizers.rules import Optimizer
from stratagem.training.variables import Variable, is_device_array

#: How step functions may travel (the strategy's ``functions`` option).
MODES = ("auto", "name", "pickle")
#: The ``__name__`` the script's fresh copy gets on a replica (anything but ``"__main__"``).
REPLICA_MAIN = "__stratagem_replica__"
#: Serialized functions each side remembers per replica (least recently used dropped first).
MAX_CACHED = 32


# -- the script and what counts as the user's code --------------------------------------------------

def main_script() -> tuple[str | None, str | None]:
    """``(absolute path, sha256)`` of the ``__main__`` script, or ``(None, None)`` when there is none."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None, None
    path = os.path.abspath(path)
    try:
        with open(path, "rb") as f:
            return path, hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return path, None


def is_user_module(module) -> bool:
    """The user's own code (see :mod:`stratagem.core.user_code`), counting the script's fresh copy."""
    return user_code.is_user_module(module, main_names=("__main__", REPLICA_MAIN))


def name_of(fn) -> tuple[str, str] | None:
    """``(module, qualname)`` that finds ``fn`` again in the same program, or ``None``."""
    if not isinstance(fn, types.FunctionType):
        return None
    module_name, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module_name or "<" in qualname:          # <lambda>, <locals>
        return None
    module = sys.modules.get(module_name)
    if not is_user_module(module) or (module_name == "__main__" and not getattr(module, "__file__", None)):
        return None                                 # (a __main__ without a file: a notebook, python -c)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return (module_name, qualname) if target is fn else None


# -- the client side ----------------------------------------------------------------------------------

def _pickler_class():
    import cloudpickle

    class Pickler(cloudpickle.CloudPickler):
        """Pickles a step function with the strategy's objects as references (see the module doc)."""

        def __init__(self, file, strategy, optimizer_key):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self._strategy, self._optimizer_key = strategy, optimizer_key
            self._buffers: dict = {}           # id of a value, or (address, bytes, shape) -> variable name
            for name, var in strategy._variables.items():
                array = var.store.array
                self._buffers[id(array)] = name
                if not is_device_array(array) and array.nbytes:
                    self._buffers[(array.ctypes.data, array.nbytes, tuple(array.shape))] = name

        def persistent_id(self, obj):
            if obj is self._strategy:
                return ("strategy",)
            if isinstance(obj, Variable):
                if obj.strategy is self._strategy:
                    return ("var", obj.name)
                return None
            if isinstance(obj, Optimizer) and obj.strategy is self._strategy:
                return ("opt", self._optimizer_key(obj), obj.get_config())
            name = self._buffers.get(id(obj))
            if name is not None:
                return ("value", name)
            if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "numel"):
                try:
                    key = (obj.data_ptr(), obj.numel() * obj.element_size(), tuple(obj.shape))
                except Exception:  # noqa: BLE001 - not a plain tensor: pickle it as usual
                    return None
                name = self._buffers.get(key)
                if name is not None:
                    is_parameter = type(obj).__name__ == "Parameter"
                    return ("tensor", name, is_parameter, bool(getattr(obj, "requires_grad", False)))
            return None

    return Pickler


class FunctionSender:
    """The client's half: a wire description of each step function, serializing it at most once."""

    def __init__(self, strategy, mode: str):
        self._strategy = strategy
        self.mode = mode
        self._pickled: "weakref.WeakKeyDictionary[Any, tuple[str, bytes]]" = weakref.WeakKeyDictionary()
        self._optimizer_keys: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self._next_key = itertools.count()

    def _optimizer_key(self, optimizer) -> int:
        key = self._optimizer_keys.get(optimizer)
        if key is None:
            key = self._optimizer_keys[optimizer] = next(self._next_key)
        return key

    def describe(self, fn: Callable) -> tuple[dict, bytes | None]:
        """``(meta, pickled bytes or None)`` for ``fn``; raises ``ConfigurationError`` if it cannot travel."""
        named = name_of(fn) if self.mode in ("auto", "name") else None
        if named is not None and named[0] == "__main__" and self.mode == "auto" and self._strategy.transport.secret:
            # Finding a function of the script by name makes the replica import the script, running
            # its top level: without an `if __name__ == "__main__":` guard that is the training loop.
            # An authenticated cluster can send the function instead, so the TF1-style single script
            # works as written (module functions of the user's own code still go by name).
            named = None
        if named is not None:
            return {"kind": "name", "module": named[0], "qualname": named[1]}, None
        what = _describe(fn)
        if self.mode == "name":
            raise ConfigurationError(
                f"{what} cannot be found by name on the replicas (functions='name'): define it at the top "
                f"level of your script (or of a module of your own code), not inside a function, and "
                f"pass it itself rather than a lambda, partial or bound method"
            )
        if self._strategy.transport.secret is None:
            raise ConfigurationError(
                f"{what} can reach the remote replicas only serialized (cloudpickle), which stratagem does "
                f"only in an authenticated cluster: set the same STRATAGEM_SECRET on every task (`stratagem "
                f"launch` sets one by default), or define the step at the top level of your script so that "
                f"the replicas find it by name"
            )
        digest, data = self._pickle(fn, what)
        return {"kind": "pickle", "sha": digest}, data

    def _pickle(self, fn, what: str) -> tuple[str, bytes]:
        try:
            cached = self._pickled.get(fn)
        except TypeError:  # not weak-referenceable: serialize every time
            cached = None
        if cached is not None:
            return cached
        buffer = io.BytesIO()
        try:
            _pickler_class()(buffer, self._strategy, self._optimizer_key).dump(fn)
        except ImportError:
            raise ConfigurationError(f"sending {what} serialized needs cloudpickle: pip install cloudpickle") from None
        except Exception as exc:
            raise ConfigurationError(
                f"cannot serialize {what} for the replicas: {type(exc).__name__}: {exc}; define the step "
                f"at the top level of your script so that the replicas find it by name"
            ) from exc
        data = buffer.getvalue()
        result = (hashlib.sha256(data).hexdigest(), data)
        try:
            self._pickled[fn] = result
        except TypeError:
            pass
        return result


def _describe(fn) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"the step function {name!r}"


# -- the replica side ---------------------------------------------------------------------------------

class FunctionResolver:
    """The replica's half: finds functions by name and unpickles serialized ones (authenticated only)."""

    def __init__(self, strategy, serving_context: Callable):
        self._strategy = strategy
        self._serving_context = serving_context
        self.script_path, self.script_sha = main_script()
        self.client_script_sha: str | None = None
        self._named: dict[tuple[str, str], Callable] = {}
        self._fresh_main = None
        self._import_error: str | None = None
        self.pickled: "OrderedDict[str, Callable]" = OrderedDict()

    def reset(self) -> None:
        self.pickled.clear()

    def resolve(self, meta: dict, data) -> Callable:
        kind = meta.get("kind")
        if kind == "name":
            return self._by_name(str(meta.get("module")), str(meta.get("qualname")))
        if kind == "pickle":
            return self._unpickle(str(meta.get("sha")), data)
        raise ConfigurationError(f"unknown kind of step function {kind!r}")

    # -- by name
    def _by_name(self, module_name: str, qualname: str) -> Callable:
        key = (module_name, qualname)
        fn = self._named.get(key)
        if fn is None:
            module = self._module(module_name)
            target: Any = module
            for part in qualname.split("."):
                target = getattr(target, part, None)
            if not isinstance(target, types.FunctionType) or target.__module__ != module.__name__:
                raise ConfigurationError(
                    f"the replica's copy of {module_name!r} has no top-level function {qualname!r}: every task "
                    f"must run the same script (and define the step where the client does)"
                )
            fn = self._named[key] = target
        return fn

    def _module(self, name: str):
        if name == "__main__":
            if self.client_script_sha and self.script_sha and self.client_script_sha != self.script_sha:
                raise ConfigurationError(
                    f"this replica runs {self.script_path}, which differs from the client's script "
                    f"(sha256 {self.script_sha[:12]} here, {self.client_script_sha[:12]} on the client): "
                    f"every task must run the same script for step functions to be found by name"
                )
            if self._fresh_main is None:
                if self._import_error is not None:   # its variables exist now: a second import would clash
                    raise ConfigurationError(f"importing the script failed earlier on this replica: "
                                             f"{self._import_error}")
                try:
                    self._fresh_main = self._import_main()
                except Exception as exc:
                    self._import_error = f"{type(exc).__name__}: {exc}"
                    raise
            return self._fresh_main
        module = sys.modules.get(name)
        if module is None:
            user_code.check_importable_user_module(name)
            module = importlib.import_module(name)
        if not is_user_module(module):
            raise ConfigurationError(_NOT_USER.format(name=name))
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            raise ConfigurationError(
                f"module {name!r} is still being imported on this replica (it created the strategy, where "
                f"the replica serves): define step functions in the main script or in a module that "
                f"does not create the strategy"
            )
        return module

    def _import_main(self):
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        if spec is not None and spec.name and spec.name != "__main__":       # python -m package.module
            spec = importlib.util.find_spec(spec.name)
        elif self.script_path:
            spec = importlib.util.spec_from_file_location(REPLICA_MAIN, self.script_path)
        else:
            raise ConfigurationError("this replica has no main script to find step functions in")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module.__name__] = module
        try:
            with self._serving_context():
                spec.loader.exec_module(module)
        except SystemExit as exc:
            sys.modules.pop(module.__name__, None)
            raise ConfigurationError(
                f"your script exited (sys.exit({exc.code!r})) while this replica imported it to find the step "
                f"functions: keep the top level free of exits that depend on the task (e.g. on is_chief)"
            ) from None
        except BaseException:
            sys.modules.pop(module.__name__, None)
            raise
        return module

    # -- serialized
    def _unpickle(self, digest: str, data) -> Callable:
        if self._strategy.transport.secret is None:
            raise ConfigurationError(
                "the client sent a serialized step function, but this replica's cluster is not authenticated "
                "(no STRATAGEM_SECRET): it unpickles nothing received from the network without one"
            )
        fn = self.pickled.get(digest)
        if fn is None:
            if data is None:
                raise ConfigurationError(f"the client referred to serialized function {digest[:12]} that this "
                                         f"replica does not hold")
            raw = memoryview(data).cast("B").tobytes()
            if hashlib.sha256(raw).hexdigest() != digest:
                raise ConfigurationError("a serialized step function arrived damaged (its sha256 differs)")
            with self._serving_context():
                fn = _Unpickler(io.BytesIO(raw), self._strategy).load()
            if not callable(fn):
                raise ConfigurationError(f"the serialized step is a {type(fn).__name__}, not a function")
        remember(self.pickled, digest, fn)
        return fn


_NOT_USER = user_code.NOT_USER


def remember(cache: "OrderedDict", key, value) -> None:
    """Put ``key`` last in the LRU ``cache``, dropping the oldest beyond :data:`MAX_CACHED` (both sides alike)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)


class _Unpickler(pickle.Unpickler):
    """Resolves the references of :class:`Pickler` to the replica's own objects."""

    def __init__(self, file, strategy):
        super().__init__(file)
        self._replica = strategy._server
        self._tensors: dict[tuple, Any] = {}   # pickle does not memoize persistent ids: one object per tensor

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        kind = pid[0]
        if kind == "strategy":
            return self._replica.strategy
        if kind == "var" and len(pid) == 2:
            return self._replica.pickled_variable(str(pid[1]))
        if kind == "opt" and len(pid) == 3:
            return self._replica.pickled_optimizer(pid[1], pid[2])
        if kind == "value" and len(pid) == 2:
            return self._replica.held(str(pid[1])).array
        if kind == "tensor" and len(pid) == 4:
            key = (str(pid[1]), bool(pid[2]), bool(pid[3]))
            if key not in self._tensors:
                import torch

                tensor = torch.from_numpy(self._replica.held(key[0]).array)
                self._tensors[key] = (torch.nn.Parameter(tensor, requires_grad=key[2]) if key[1]
                                      else tensor.requires_grad_(key[2]))
            return self._tensors[key]
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")
