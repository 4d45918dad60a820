"""Variables: named, mutable arrays that a strategy can mirror, shard or hold (README: "Training with a strategy").

A :class:`Variable` is created by the user; inside ``strategy.scope()`` it is handed to that strategy
(``strategy.on_variable(var)``), which decides what it is: a local replica kept identical on
every worker (``mirrored``), or later a shard on a parameter server. Outside any scope it is a plain
local variable::

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.zeros(3, np.float32), name="w")
    >>> w.assign_add(np.ones(3, np.float32)).numpy()
    array([1., 1., 1.], dtype=float32)
    >>> w.name, w.shape, w.dtype, w.strategy
    ('w', (3,), dtype('float32'), None)

The strategy whose ``scope()`` is active lives in a :class:`contextvars.ContextVar` (scoped state: each
thread and each asyncio task sees its own), read with :func:`current_strategy` and set by
:func:`strategy_scope`, which ``Strategy.scope()`` uses.

Values are numpy arrays, or cupy arrays when the initial value is one (cupy is imported only when the
caller already holds a cupy array). A variable's storage sits behind :class:`VariableStore`
(``read()`` / ``write(array)``) so that a strategy can make reads and writes remote; the default,
:class:`LocalStore`, holds one local array that is always updated in place.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from stratagem.core.errors import ConfigurationError

__all__ = [
    "Variable", "VariableStore", "LocalStore", "current_strategy", "strategy_scope",
    "is_device_array", "array_module",
]

#: The strategy whose ``scope()`` is active in this context (``None`` outside any scope).
_CURRENT_STRATEGY: contextvars.ContextVar[Any] = contextvars.ContextVar("stratagem_strategy", default=None)


def current_strategy():
    """The strategy whose ``scope()`` is active in this thread / task, or ``None``.

    >>> current_strategy() is None
    True
    """
    return _CURRENT_STRATEGY.get()


def resolve_strategy(strategy, what: str):
    """``strategy``, else the one whose ``scope()`` is active; a clear error naming ``what`` needs
    one if there is none (the framework adapters' ``strategy=None`` arguments).

    >>> resolve_strategy(None, "TreeVariables")
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: TreeVariables needs a strategy: pass strategy=stratagem.strategy(...), or call it inside `with strategy.scope():`
    """
    strategy = strategy if strategy is not None else current_strategy()
    if strategy is None:
        raise ConfigurationError(
            f"{what} needs a strategy: pass strategy=stratagem.strategy(...), or call it inside "
            f"`with strategy.scope():`"
        )
    return strategy


@contextlib.contextmanager
def strategy_scope(strategy) -> Iterator[Any]:
    """Make ``strategy`` the current one for the ``with`` block (what ``Strategy.scope()`` does).

    Scopes nest; leaving one restores the strategy that was current before it, even on an error.

    >>> class Toy:
    ...     def on_variable(self, var):
    ...         pass
    >>> toy = Toy()
    >>> with strategy_scope(toy):
    ...     current_strategy() is toy
    True
    >>> current_strategy() is None
    True
    """
    token = _CURRENT_STRATEGY.set(strategy)
    try:
        yield strategy
    finally:
        _CURRENT_STRATEGY.reset(token)


# -- array-module dispatch ------------------------------------------------------------------------

def is_device_array(x) -> bool:
    """True for a cupy array, decided without importing cupy (which may not be installed).

    >>> is_device_array(np.zeros(2))
    False
    """
    return type(x).__module__.startswith("cupy")


def array_module(x):
    """``numpy``, or ``cupy`` when ``x`` is a cupy array (imported only then).

    >>> array_module(np.zeros(2)) is np
    True
    """
    if is_device_array(x):
        return importlib.import_module("cupy")
    return np


def to_module(x, xp):
    """``x`` as an array of module ``xp`` (host <-> device copies only where the kinds differ)."""
    if xp is np:
        if is_device_array(x):
            return x.get()
        return np.asarray(x)
    if is_device_array(x):
        return x
    return xp.asarray(np.asarray(x))


#: Dtype kinds a variable cannot hold (they cannot be computed with, nor checkpointed without pickle).
_REFUSED_KINDS = {"O": "Python objects", "U": "strings", "S": "bytes", "M": "datetimes", "m": "timedeltas"}


def _check_dtype(dtype: np.dtype, what: str) -> None:
    if dtype.kind in _REFUSED_KINDS or dtype.fields is not None or (dtype.kind == "V" and not _is_ml_dtype(dtype)):
        kind = _REFUSED_KINDS.get(dtype.kind, "structured or raw records")
        raise ConfigurationError(
            f"{what} has dtype {dtype} ({kind}); a variable holds numbers: pass a numeric array "
            f"(e.g. np.float32)"
        )


def _is_ml_dtype(dtype: np.dtype) -> bool:
    """bfloat16, float8_* ...: the extra numeric dtypes of ``ml_dtypes``."""
    return dtype.type.__module__.startswith("ml_dtypes")


# -- storage ----------------------------------------------------------------------------------------

class VariableStore:
    """Where a variable's value lives: the small interface a strategy can re-implement.

    ``read()`` returns the value; ``write(array)`` replaces it with ``array`` (already of the
    variable's shape and dtype). ``live`` says whether ``read()`` returns the buffer itself, so that
    writing into it updates the variable (then in-place updates need no ``write``); a remote store
    returns a copy and sets ``live = False``.

    >>> class Logged(VariableStore):
    ...     def __init__(self, array):
    ...         self.array, self.writes = array, 0
    ...     def read(self):
    ...         return self.array.copy()
    ...     def write(self, array):
    ...         self.array, self.writes = array.copy(), self.writes + 1
    >>> store = Logged(np.zeros(2))
    >>> store.write(np.ones(2)); store.read(), store.writes
    (array([1., 1.]), 1)
    """

    #: True if ``read()`` returns the variable's own buffer (writes through it are the variable's).
    live: bool = False

    def read(self):
        """The current value (the live buffer when ``live``, else a copy)."""
        raise NotImplementedError

    def write(self, array) -> None:
        """Make ``array`` (the variable's shape and dtype) the value."""
        raise NotImplementedError

    def gather(self, indices):
        """A copy of the rows ``indices`` (checked, int64) of the value. A remote store overrides it to
        fetch just those rows."""
        return self.read()[indices]


class LocalStore(VariableStore):
    """The default store: one local array (numpy or cupy), written in place so views stay valid.

    >>> store = LocalStore(np.zeros(2, np.float32))
    >>> buffer = store.read()
    >>> store.write(np.array([1, 2], np.float32))
    >>> buffer                         # the same buffer, updated in place
    array([1., 2.], dtype=float32)
    """

    live = True

    def __init__(self, array):
        self._array = array

    def read(self):
        return self._array

    def write(self, array) -> None:
        xp = array_module(self._array)
        xp.copyto(self._array, to_module(array, xp), casting="same_kind")


# -- names ------------------------------------------------------------------------------------------

class _Names:
    """Default names "Variable", "Variable_1", ... and, for a strategy, the names taken in it."""

    def __init__(self, track_taken: bool):
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}
        self._taken: set[str] | None = set() if track_taken else None

    def reserve(self, name: str | None, base: str = "Variable") -> str:
        with self._lock:
            if name is None:
                while True:
                    index = self._next.get(base, 0)
                    self._next[base] = index + 1
                    candidate = base if index == 0 else f"{base}_{index}"
                    if self._taken is None or candidate not in self._taken:
                        name = candidate
                        break
            elif self._taken is not None and name in self._taken:
                raise ConfigurationError(
                    f"a variable named {name!r} already exists in this strategy; give each variable "
                    f"in a strategy a unique name (or leave name out for a generated one)"
                )
            if self._taken is not None:
                self._taken.add(name)
            return name

    def release(self, name: str) -> None:
        with self._lock:
            if self._taken is not None:
                self._taken.discard(name)


_PROCESS_NAMES = _Names(track_taken=False)
_STRATEGY_NAMES: "weakref.WeakKeyDictionary[Any, _Names]" = weakref.WeakKeyDictionary()
_STRATEGY_NAMES_LOCK = threading.Lock()


def _names_for(strategy) -> _Names:
    if strategy is None:
        return _PROCESS_NAMES
    with _STRATEGY_NAMES_LOCK:
        try:
            names = _STRATEGY_NAMES.get(strategy)
            if names is None:
                names = _STRATEGY_NAMES[strategy] = _Names(track_taken=True)
        except TypeError as exc:
            raise ConfigurationError(
                f"strategy {strategy!r} cannot hold variables: it must be hashable and weak-referenceable ({exc})"
            ) from None
    return names


# -- the variable -------------------------------------------------------------------------------------

class Variable:
    """A named, mutable array, created by the strategy whose ``scope()`` is active.

    Args:
        initial_value: an array (numpy or cupy), a nested list, a number, a CPU torch tensor...; it is
            copied (a cupy value stays on its device, anything else becomes a C-ordered numpy array).
        name: unique within a strategy; default ``"Variable"``, ``"Variable_1"``, ... (per strategy, or
            per process outside any scope).
        trainable: whether optimizers may update it.
        dtype: the variable's dtype (default: the initial value's). It never changes afterwards.

    Assignments (``assign``, ``assign_add``, ``assign_sub``) write into the existing buffer, so a view
    of ``var.value`` (``torch.from_numpy(var.value)``) stays valid. Values are cast to the variable's
    dtype with numpy's ``same_kind`` rule (float64 into float32 is fine, float into int is refused).
    ``==`` and hashing are by identity, as for any Python object; compare values with ``var.numpy()``.

    >>> import numpy as np
    >>> w = Variable([[1.0, 2.0]], name="kernel", dtype=np.float32)
    >>> view = w.value
    >>> w.assign([[3.0, 4.0]]) is w
    True
    >>> view                                 # the same buffer, updated in place
    array([[3., 4.]], dtype=float32)
    >>> np.asarray(w) @ np.ones((2, 1), np.float32)
    array([[7.]], dtype=float32)
    >>> w.assign(np.zeros(3))
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: cannot assign to variable 'kernel': the value has shape (3,), the variable (1, 2); pass a value of shape (1, 2)
    """

    def __init__(self, initial_value, name: str | None = None, trainable: bool = True, dtype=None):
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(f"a variable's name must be a non-empty string, not {name!r}")
        if isinstance(initial_value, Variable):
            initial_value = initial_value.value
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except TypeError as exc:
                raise ConfigurationError(f"unknown dtype {dtype!r} for variable {name or ''!r}: {exc}") from None
        value = self._copy_initial(initial_value, dtype, name)
        _check_dtype(value.dtype, f"variable {name!r}" if name else "the variable")
        strategy = current_strategy()
        names = _names_for(strategy)
        self._name = names.reserve(name)
        self._trainable = bool(trainable)
        self._shape = tuple(int(n) for n in value.shape)
        self._dtype = np.dtype(value.dtype)
        self._strategy = strategy
        self._store: VariableStore = LocalStore(value)
        if strategy is not None:
            try:
                strategy.on_variable(self)
            except BaseException:
                names.release(self._name)
                raise

    @staticmethod
    def _copy_initial(initial_value, dtype, name):
        if is_device_array(initial_value):
            xp = array_module(initial_value)
            return xp.array(initial_value, dtype=dtype, order="C", copy=True)
        source = _detach(initial_value)
        try:
            return np.array(source, dtype=dtype, order="C", copy=True)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot make variable {name or '(unnamed)'!r} from {type(initial_value).__name__}: {exc}; "
                f"pass an array, a nested list or a number"
            ) from None

    # -- what it is ---------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The variable's name, unique within its strategy (the key of its checkpoint entry and slots)."""
        return self._name

    @property
    def trainable(self) -> bool:
        """Whether optimizers may update it."""
        return self._trainable

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, fixed at creation."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype, fixed at creation."""
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def strategy(self):
        """The strategy it was created in (``None`` for a plain local variable)."""
        return self._strategy

    @property
    def store(self) -> VariableStore:
        """Where the value lives (:class:`LocalStore` unless the strategy replaced it). A strategy
        sets it when the variable is created (``variable.store = ...``): the value lives there from now on."""
        return self._store

    @store.setter
    def store(self, store: VariableStore) -> None:
        self.set_store(store)

    def set_store(self, store: VariableStore) -> None:
        """For strategies (in ``on_variable``): keep the value in ``store`` from now on."""
        if not isinstance(store, VariableStore):
            raise ConfigurationError(f"a variable's store must be a VariableStore, not {type(store).__name__}")
        self._store = store

    # -- reading ---------------------------------------------------------------------------------------
    @property
    def value(self):
        """The live array (numpy or cupy): writes into it are writes to the variable (for a local store)."""
        return self._store.read()

    def gather(self, indices):
        """A copy of rows ``indices`` of the value (``value[indices]``), for a step that reads a few rows
        of a large table: on parameter servers only those rows are pulled. Pair it with an
        :class:`~stratagem.training.sparse.IndexedSlices` gradient of the same rows.

        >>> table = Variable(np.arange(12.0).reshape(6, 2), name="table")
        >>> table.gather([4, 1]).tolist()
        [[8.0, 9.0], [2.0, 3.0]]
        """
        if not self._shape:
            raise ConfigurationError(f"variable {self._name!r} is a scalar: it has no rows to gather")
        current = self._store.read() if self._store.live else None
        xp = array_module(current) if current is not None else np
        rows = xp.asarray(indices)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise ConfigurationError(f"gather from {self._name!r}: indices must be a 1-D array of integers, "
                                     f"got {rows.dtype} of shape {tuple(rows.shape)}")
        rows = rows.astype(np.int64, copy=False)
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= self._shape[0]):
            raise ConfigurationError(f"gather from {self._name!r}: indices must be rows 0 to "
                                     f"{self._shape[0] - 1}, got {int(rows.min())} to {int(rows.max())}")
        return self._store.gather(rows)

    def numpy(self) -> np.ndarray:
        """A host numpy copy of the value (copied from the device for a cupy variable)."""
        value = self._store.read()
        if is_device_array(value):
            return value.get()
        return np.array(value, copy=True)

    def __array__(self, dtype=None, copy=None):
        value = self._store.read()
        if is_device_array(value):
            raise TypeError(
                f"variable {self._name!r} lives on a GPU (cupy); numpy will not copy it implicitly: "
                f"use var.numpy() for a host copy or var.value for the device array"
            )
        if copy:
            return np.array(value, dtype=dtype, copy=True)
        if dtype is None or np.dtype(dtype) == value.dtype:
            return value
        if copy is False:
            raise ValueError(f"variable {self._name!r} is {value.dtype}: a {np.dtype(dtype)} array needs a copy")
        return value.astype(dtype)

    # -- writing ---------------------------------------------------------------------------------------
    def _checked(self, value, what: str):
        if isinstance(value, Variable):
            value = value.value
        current = self._store.read() if self._store.live else None
        xp = array_module(current) if current is not None else np
        if not is_device_array(value):
            value = _detach(value)
        try:
            value = to_module(value, xp)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(f"cannot {what} variable {self._name!r}: {exc}") from None
        if tuple(value.shape) != self._shape:
            raise ConfigurationError(
                f"cannot {what} variable {self._name!r}: the value has shape {tuple(value.shape)}, "
                f"the variable {self._shape}; pass a value of shape {self._shape}"
            )
        if value.dtype != self._dtype and not np.can_cast(value.dtype, self._dtype, "same_kind"):
            raise ConfigurationError(
                f"cannot {what} variable {self._name!r}: a {value.dtype} value does not fit its dtype "
                f"{self._dtype}; cast it first (value.astype(np.{self._dtype.name}))"
            )
        return value, xp

    def assign(self, value) -> "Variable":
        """Copy ``value`` into the variable (in place); returns the variable."""
        value, _ = self._checked(value, "assign to")
        self._store.write(value.astype(self._dtype, copy=False))
        return self

    def assign_add(self, delta) -> "Variable":
        """Add ``delta`` to the variable in place; returns the variable."""
        return self._accumulate(delta, +1)

    def assign_sub(self, delta) -> "Variable":
        """Subtract ``delta`` from the variable in place; returns the variable."""
        return self._accumulate(delta, -1)

    def _accumulate(self, delta, sign: int) -> "Variable":
        delta, xp = self._checked(delta, "add to" if sign > 0 else "subtract from")
        ufunc = xp.add if sign > 0 else xp.subtract
        if self._store.live:
            buffer = self._store.read()
            ufunc(buffer, delta, out=buffer, casting="same_kind")
        else:
            current = self._store.read()
            self._store.write(ufunc(current, to_module(delta, array_module(current))).astype(self._dtype, copy=False))
        return self

    # -- conveniences ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        if not self._shape:
            raise TypeError(f"variable {self._name!r} is a scalar and has no len()")
        return self._shape[0]

    def __getitem__(self, key):
        return self.value[key]

    def __neg__(self):
        return -self.value

    def __add__(self, other):
        return self.value + _operand(other)

    def __radd__(self, other):
        return _operand(other) + self.value

    def __sub__(self, other):
        return self.value - _operand(other)

    def __rsub__(self, other):
        return _operand(other) - self.value

    def __mul__(self, other):
        return self.value * _operand(other)

    def __rmul__(self, other):
        return _operand(other) * self.value

    def __truediv__(self, other):
        return self.value / _operand(other)

    def __rtruediv__(self, other):
        return _operand(other) / self.value

    def __matmul__(self, other):
        return self.value @ _operand(other)

    def __rmatmul__(self, other):
        return _operand(other) @ self.value

    def __pow__(self, other):
        return self.value ** _operand(other)

    def __repr__(self) -> str:
        where = "" if self._strategy is None else f" in {type(self._strategy).__name__}"
        return f"<stratagem.Variable {self._name!r} shape={self._shape} dtype={self._dtype}{where}>"


def _operand(x):
    return x.value if isinstance(x, Variable) else x


def _detach(x):
    """A torch tensor (CPU or GPU, with or without grad) as numpy, without importing torch."""
    if type(x).__module__.startswith("torch") and hasattr(x, "detach"):
        x = x.detach()
        if hasattr(x, "cpu"):
            x = x.cpu()
        return x.numpy()
    return x
