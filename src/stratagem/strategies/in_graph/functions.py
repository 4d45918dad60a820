"""How an ``in_graph`` step function reaches a remote replica: by name, or serialized when authenticated.

The rules are :mod:`stratagem.strategies.remote_calls.functions`'s (shared with ``parameter_server``); what is particular
to ``in_graph``:

**By name**, a function of the script is found in a fresh copy of it: the replica imports the script
(as ``multiprocessing`` does, under another ``__name__``), so its top level runs again there, creating
the variables and defining the functions, which is why the training loop must sit under
``if __name__ == "__main__":``. In that import ``stratagem.strategy("in_graph", ...)`` returns the
replica's own strategy, so the script's variables become the replica's copies of the client's. The
client's script and the replica's must be the same file (sha256), and a module that is still being
imported (it created the strategy) is not searched.

**Serialized** (lambdas, closures, ``functools.partial``, bound methods..., and in an authenticated
cluster every function of the script in ``auto`` mode, so that the replica need not run the script's
top level): variables, optimizers, the strategy, and arrays or PyTorch tensors that are views of a
variable's buffer travel as references, resolved on the replica to its own copies; everything else the
function holds is copied when it is first sent (a function object is serialized once: like
``tf.function``, later changes to what it closes over are not seen; pass changing values as arguments).
"""

from __future__ import annotations

import importlib.util
import itertools
import pickle
import sys
import weakref
from collections import OrderedDict
from typing import Any, Callable

from stratagem.strategies.remote_calls import functions as remote_code
from stratagem.core.errors import ConfigurationError
from stratagem.training.optimizers.rules import Optimizer
from stratagem.training.variables import Variable, is_device_array

#: How step functions may travel (the strategy's ``functions`` option), as :mod:`stratagem.strategies.remote_calls.functions`
#: calls each way.
MODES = {"auto": "auto", "name": "name", "pickle": "value"}
#: The ``__name__`` the script's fresh copy gets on a replica (anything but ``"__main__"``).
REPLICA_MAIN = "__stratagem_replica__"
#: Serialized functions each side remembers per replica (least recently used dropped first).
MAX_CACHED = 32
#: Said when the replica's copy of a module lacks a step function.
_MISSING = ": every task must run the same script (and define the step where the client does, at the top level)"


# -- the client side ----------------------------------------------------------------------------------

def _persistent_ids(strategy, optimizer_key) -> Callable[[Any], Any]:
    """The references a serialized step holds (see the module doc), as pickle persistent ids."""
    buffers: dict = {}           # id of a value, or (address, bytes, shape) -> variable name
    for name, var in strategy.training_state.variables.items():
        array = var.store.array
        buffers[id(array)] = name
        if not is_device_array(array) and array.nbytes:
            buffers[(array.ctypes.data, array.nbytes, tuple(array.shape))] = name

    def persistent_id(obj):
        if obj is strategy:
            return ("strategy",)
        if isinstance(obj, Variable):
            return ("var", obj.name) if obj.strategy is strategy else None
        if isinstance(obj, Optimizer) and obj.strategy is strategy:
            return ("opt", optimizer_key(obj), obj.get_config())
        name = buffers.get(id(obj))
        if name is not None:
            return ("value", name)
        if type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "numel"):
            try:
                key = (obj.data_ptr(), obj.numel() * obj.element_size(), tuple(obj.shape))
            except Exception:  # noqa: BLE001 - not a plain tensor: pickle it as usual
                return None
            name = buffers.get(key)
            if name is not None:
                is_parameter = type(obj).__name__ == "Parameter"
                return ("tensor", name, is_parameter, bool(getattr(obj, "requires_grad", False)))
        return None

    return persistent_id


class FunctionSender:
    """The client's half: a wire description of each step function, serializing it at most once."""

    def __init__(self, strategy, mode: str):
        self._strategy = strategy
        self._policy = remote_code.Policy(MODES[mode], authenticated=strategy.transport.secret is not None,
                                          peers="the replicas", option=f"functions={mode!r}",
                                          main_needs_file=True, main_by_value=True)
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
        what = f"the step function {remote_code.describe(fn)!r}"
        if self._policy.how(fn, what) == "name":
            return remote_code.by_name(fn), None
        digest, data = self._pickle(fn, what)
        return {"kind": "pickle", "sha": digest}, data

    def _pickle(self, fn, what: str) -> tuple[str, bytes]:
        try:
            cached = self._pickled.get(fn)
        except TypeError:  # not weak-referenceable: serialize every time
            cached = None
        if cached is not None:
            return cached
        data = remote_code.dumps_function(fn, what=what, persistent_id=_persistent_ids(self._strategy,
                                                                                      self._optimizer_key))
        result = (remote_code.digest(data), data)
        try:
            self._pickled[fn] = result
        except TypeError:
            pass
        return result


# -- the replica side ---------------------------------------------------------------------------------

class FunctionResolver:
    """The replica's half: finds functions by name and unpickles serialized ones (authenticated only)."""

    def __init__(self, strategy, serving_context: Callable, server):
        self._strategy = strategy
        self._serving_context = serving_context
        self._server = server         # the ReplicaServer: what serialized steps' references resolve to
        self.script_path, self.script_sha = remote_code.main_script()
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
            return self._by_name(meta)
        if kind == "pickle":
            return self._unpickle(str(meta.get("sha")), data)
        raise ConfigurationError(f"unknown kind of step function {kind!r}")

    # -- by name
    def _by_name(self, meta: dict) -> Callable:
        key = (meta.get("module"), meta.get("qualname"), meta.get("code"))
        fn = self._named.get(key) if all(isinstance(part, (str, type(None))) for part in key) else None
        if fn is None:
            fn = remote_code.find_function(meta, where=str(self._strategy.task), module_for=self._module,
                                           main_names=("__main__", REPLICA_MAIN), missing_hint=_MISSING)
            self._named[key] = fn
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
        module = remote_code.user_module(name)
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
        fn = self.pickled.get(digest)
        if fn is None:
            if data is None:
                raise ConfigurationError(f"the client referred to serialized function {digest[:12]} that this "
                                         f"replica does not hold")
            with self._serving_context():
                fn = remote_code.loads_function(data, authenticated=self._strategy.transport.secret is not None,
                                                where=str(self._strategy.task), expected_digest=digest,
                                                persistent_load=_persistent_loads(self._server))
        remember(self.pickled, digest, fn)
        return fn


def remember(cache: "OrderedDict", key, value) -> None:
    """Put ``key`` last in the LRU ``cache``, dropping the oldest beyond :data:`MAX_CACHED` (both sides alike)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > MAX_CACHED:
        cache.popitem(last=False)


def _persistent_loads(replica) -> Callable[[Any], Any]:
    """Resolves the references of :func:`_persistent_ids` to the replica's own objects."""
    tensors: dict[tuple, Any] = {}          # pickle does not memoize persistent ids: one object per tensor

    def persistent_load(pid):
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        kind = pid[0]
        if kind == "strategy":
            return replica.strategy
        if kind == "var" and len(pid) == 2:
            return replica.pickled_variable(str(pid[1]))
        if kind == "opt" and len(pid) == 3:
            return replica.pickled_optimizer(pid[1], pid[2])
        if kind == "value" and len(pid) == 2:
            return replica.held(str(pid[1])).array
        if kind == "tensor" and len(pid) == 4:
            key = (str(pid[1]), bool(pid[2]), bool(pid[3]))
            if key not in tensors:
                import torch

                tensor = torch.from_numpy(replica.held(key[0]).array)
                tensors[key] = (torch.nn.Parameter(tensor, requires_grad=key[2]) if key[1]
                                else tensor.requires_grad_(key[2]))
            return tensors[key]
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")

    return persistent_load
