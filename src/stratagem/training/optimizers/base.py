"""The optimizer base class: how ``apply_gradients`` reaches the strategy, the checks, the slots and
precision, and how a rule is run (whole arrays, chunks, out of place). The rules themselves, SGD,
Adam and Adagrad, are in :mod:`stratagem.training.optimizers.rules`.

An optimizer created inside ``strategy.scope()`` belongs to that strategy: ``apply_gradients`` hands
the gradients to the strategy (``strategy.on_apply_gradients(self, pairs)``), which synchronises the
replicas (all-reduce for ``mirrored``, a push for a parameter server) and then calls
:meth:`Optimizer.apply_dense`, the local update; the call is one ``sync`` event on the strategy's
timeline recorder (``strategy.recorder``, which does nothing when the timeline is off). Outside any scope ``apply_gradients`` updates the
variables at once.

Precision: float32 and float64 variables are updated in their own dtype, in place. Variables of
16-bit (and 8-bit) floating types (float16, bfloat16, ...) are computed in float32 and the result is
cast back into the variable's buffer; their slots are kept in float32, because the second moment of
Adam or the Adagrad accumulator underflow in float16 (``g*g`` is 0 below ``g = 2.4e-4``) and would turn
the update into ``m / epsilon``. Everything else about a slot is "like the variable": same shape, same
array module (numpy or cupy), created lazily at the variable's first update, keyed by its name.

Updates are deterministic (the same inputs give the same bits) and never write into the gradient.
Elementwise rules update large numpy variables in cache-sized chunks with reused temporaries
(:mod:`stratagem.training.optimizers.chunks`): the same bits, without allocating and streaming a
variable-sized temporary per step. An optimizer is not thread-safe: callers serialise
``apply_dense`` (distinct variables may be updated from different threads with ``update_array``).
"""


from __future__ import annotations

import functools
import importlib
import math
import weakref
from typing import Any, Callable, ClassVar, Iterable, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError, StratagemError
from stratagem.training.optimizers.chunks import chunkable, update_chunked
from stratagem.training.optimizers.precision import compute_dtype, is_float_dtype
from stratagem.training.sparse import IndexedSlices, densify, is_sparse
from stratagem.training.variables import Variable, _detach, array_module, current_strategy, is_device_array, to_module

__all__ = ["Optimizer", "from_config", "compute_dtype"]


# -- helpers ------------------------------------------------------------------------------------------

def _hyper(name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigurationError(f"{name} must be a number, not {value!r}")
    value = float(value)
    bad = not math.isfinite(value)
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        interval = f"{'(' if low_open else '['}{low if low is not None else '-inf'}, " \
                   f"{high if high is not None else 'inf'}{')' if high_open or high is None else ']'}"
        raise ConfigurationError(f"{name} must be a finite number in {interval}, got {value!r}")
    return value


def _as_gradient(grad, var_name: str):
    """A gradient as an array: cupy stays cupy, torch tensors become numpy (torch is not imported)."""
    if is_device_array(grad):
        return grad
    try:
        grad = np.asarray(_detach(grad))
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigurationError(
            f"the gradient of variable {var_name!r} ({type(grad).__name__}) is not an array: {exc}"
        ) from None
    if grad.dtype.kind not in "biuf" and not is_float_dtype(grad.dtype):
        raise ConfigurationError(
            f"the gradient of variable {var_name!r} has dtype {grad.dtype}; gradients must be real numbers"
        )
    return grad


# -- the base class -----------------------------------------------------------------------------------

class _Registered(type):
    """Optimizers made in a strategy's ``scope()`` are recorded by it once fully built (not at their first
    step): a coordinator whose steps run on other tasks still sees its optimizer's iterations."""

    def __call__(cls, *args, **kwargs):
        optimizer = super().__call__(*args, **kwargs)
        if optimizer.strategy is not None:
            optimizer.strategy.on_optimizer(optimizer)
        return optimizer


# The base's two hooks, defined here so that this module's dispatch (_rule_of, _known_optimizers) can
# name them without reaching into the class.

def _no_rule(self, xp, w, g, slots: dict[str, Any], t: int) -> None:
    """``Optimizer._update``: a subclass must implement it."""
    raise NotImplementedError(f"{type(self).__name__} must implement _update(xp, w, g, slots, t)")


def _copy_then_update(self, xp, src, w, g, slots: dict[str, Any], t: int) -> None:
    """``Optimizer._update_into``: write the update of ``src`` into ``w`` (``src`` itself, or an array
    of its shape and dtype).

    The default copies ``src`` into ``w`` and calls ``_update``; the built-in rules read ``src`` and
    write ``w`` directly.
    """
    if w is not src:
        xp.copyto(w, src)
    self._update(xp, w, g, slots, t)


class Optimizer(metaclass=_Registered):
    """Base class of the optimizers: owns ``iterations``, the slots, the state and the dispatch.

    Args:
        learning_rate: the step size (a number >= 0; may be changed between steps:
            ``opt.learning_rate = 0.01``).

    A subclass sets ``name``, lists its slots in :meth:`slot_names` and implements
    ``_update(xp, w, g, slots, t)``, which updates ``w`` and the slot arrays in place (all of the
    compute dtype, all of module ``xp``). It may also implement ``_update_into(xp, src, w, g, slots,
    t)``, which writes the update of ``src`` into ``w`` (``src`` itself or another array of its
    shape), so that an update out of place (``update_array(..., out=)``) costs no extra copy; and set
    ``elementwise = True`` when each element of its update depends only on the same element of ``w``,
    ``g`` and the slots, so that large numpy variables are updated chunk by chunk. A subclass of a
    built-in that overrides ``_update`` gets its own rule, whole arrays at a time, unless it sets
    ``elementwise = True`` itself.

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> class SignSGD(Optimizer):
    ...     name = "SignSGD"
    ...     def _update(self, xp, w, g, slots, t):
    ...         w -= self.learning_rate * xp.sign(g)
    >>> v = Variable(np.zeros(2), name="v")
    >>> SignSGD(0.1).apply_gradients([(np.array([3.0, -2.0]), v)]); v.numpy()
    1
    array([-0.1,  0.1])
    """

    #: The optimizer's name, as written in ``get_config()["name"]`` and looked up by ``from_config``.
    name: ClassVar[str] = "Optimizer"
    #: True when an element of the update depends only on the same element of the variable, the
    #: gradient and the slots: the update may then run over chunks of the flat arrays.
    elementwise: ClassVar[bool] = False
    #: Bytes of a variable from which an elementwise update runs in chunks (``None``: the default,
    #: :data:`~stratagem.training.optimizers.chunks.CHUNK_FROM_BYTES`; rules of many passes set less).
    chunk_from_bytes: ClassVar[int | None] = None
    #: True when the class's own ``_update_into`` writes each element of ``w`` only after its last
    #: read of that element of ``g`` (the rule's last operation writes ``w``): then the result may be
    #: written over the gradient (``update_array(name, value, grad, out=grad)``, no copy of it). Not
    #: inherited by a subclass that brings its own rule (see :func:`_writes_over_gradient`).
    result_written_last: ClassVar[bool] = False

    def __init__(self, learning_rate: float):
        self.learning_rate = learning_rate
        #: The strategy whose ``scope()`` was active at construction (``None`` outside any scope).
        self.strategy = current_strategy()
        #: How many times ``apply_dense`` ran (Adam's ``t``); restored by ``load_state_dict``.
        self.iterations: int = 0
        self._slots: dict[str, dict[str, Any]] = {}
        self._owners: dict[str, weakref.ref] = {}

    # -- hyperparameters ------------------------------------------------------------------------------
    @property
    def learning_rate(self) -> float:
        """The step size."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        self._learning_rate = _hyper("learning_rate", value, low=0.0)

    def slot_names(self) -> tuple[str, ...]:
        """The names of the per-variable state arrays this optimizer keeps (e.g. ``("m", "v")``)."""
        return ()

    def _initial_slot(self, slot_name: str, xp, shape, dtype):
        return xp.zeros(shape, dtype)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments as a plain dict, with ``"name"``: ``from_config`` rebuilds it.

        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> SGD(0.1, momentum=0.9).get_config()
        {'name': 'SGD', 'learning_rate': 0.1, 'momentum': 0.9, 'nesterov': False}
        """
        return {"name": self.name, "learning_rate": self.learning_rate}

    # -- applying gradients ---------------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars: Iterable) -> int:
        """Apply one step of ``(gradient, variable)`` pairs; returns ``iterations`` after it.

        Gradients that are ``None`` are skipped; the others may be numpy or cupy arrays, torch tensors
        (converted with ``.detach().cpu().numpy()``, torch is not imported) or anything ``np.asarray``
        takes, and must have their variable's shape. Under a strategy this is the replicas' sync point
        (``strategy.on_apply_gradients``); otherwise the variables are updated here (``apply_dense``).
        """
        pairs = self._normalise(grads_and_vars)
        if self.strategy is not None:
            with self.strategy.recorder.span("sync", "apply_gradients", {"gradients": len(pairs)}):
                self.strategy.on_apply_gradients(self, pairs)
        else:
            self.apply_dense(pairs)
        return self.iterations

    def _normalise(self, grads_and_vars) -> list[tuple[Any, Variable]]:
        if isinstance(grads_and_vars, Mapping) or isinstance(grads_and_vars, (str, bytes)):
            raise ConfigurationError("apply_gradients takes a list of (gradient, variable) pairs, "
                                     "e.g. opt.apply_gradients(zip(grads, variables))")
        pairs: list[tuple[Any, Variable]] = []
        seen: set[int] = set()
        count = 0
        for index, item in enumerate(grads_and_vars):
            count += 1
            try:
                grad, var = item
            except (TypeError, ValueError):
                raise ConfigurationError(
                    f"apply_gradients takes (gradient, variable) pairs; item {index} is a "
                    f"{type(item).__name__}: pass e.g. zip(grads, variables)"
                ) from None
            if not isinstance(var, Variable):
                raise ConfigurationError(
                    f"item {index} of apply_gradients: the second element must be a stratagem.Variable, "
                    f"not {type(var).__name__}; create the weights with stratagem.Variable(...)"
                )
            if id(var) in seen:
                raise ConfigurationError(
                    f"variable {var.name!r} appears twice in one apply_gradients call; sum its gradients first"
                )
            seen.add(id(var))
            if grad is None:
                continue
            if not var.trainable:
                raise ConfigurationError(
                    f"variable {var.name!r} is not trainable (trainable=False); leave it out of "
                    f"apply_gradients or create it with trainable=True"
                )
            if is_sparse(grad):
                grad = self._sparse_gradient(grad, var)
            else:
                grad = _as_gradient(grad, var.name)
                self._check_pair(grad, var)
            pairs.append((grad, var))
        if not pairs:
            raise ConfigurationError(
                "no gradient for any variable" + (f" (all {count} were None)" if count else " (the list was empty)")
                + "; check that the loss depends on the variables passed to apply_gradients"
            )
        for _, var in pairs:
            self._check_same_strategy(var)
        return pairs

    def _check_pair(self, grad, var: Variable) -> None:
        if tuple(grad.shape) != var.shape:
            raise ConfigurationError(
                f"the gradient of variable {var.name!r} has shape {tuple(grad.shape)}, the variable "
                f"{var.shape}; gradients must have their variable's shape"
            )
        if not is_float_dtype(var.dtype):
            raise ConfigurationError(
                f"variable {var.name!r} has dtype {var.dtype}; optimizers update floating-point "
                f"variables only: create it with a float dtype (e.g. dtype=np.float32)"
            )

    def _check_same_strategy(self, var: Variable) -> None:
        if var.strategy is self.strategy:
            return
        if self.strategy is None:
            raise ConfigurationError(
                f"variable {var.name!r} belongs to a strategy but this {self.name} optimizer was created "
                f"outside strategy.scope(): create the optimizer inside `with strategy.scope():` so "
                f"that apply_gradients keeps the replicas in sync"
            )
        if var.strategy is None:
            raise ConfigurationError(
                f"variable {var.name!r} was created outside strategy.scope() but this {self.name} "
                f"optimizer inside it: create the variable inside `with strategy.scope():` too"
            )
        raise ConfigurationError(
            f"variable {var.name!r} and this {self.name} optimizer belong to different strategies; "
            f"create both inside the same strategy.scope()"
        )

    def _sparse_gradient(self, grad: IndexedSlices, var: Variable):
        """Check an ``IndexedSlices`` gradient against its variable; keep it for a strategy that moves
        rows (``sparse_gradients = True``: the parameter servers), else make it dense, so every other
        path sees the same arrays as before (and the update is exactly the dense one)."""
        if grad.dense_shape != var.shape:
            raise ConfigurationError(
                f"the sparse gradient of {var.name!r} is for shape {grad.dense_shape}, the variable is "
                f"{var.shape}; build IndexedSlices(values, indices, dense_shape=var.shape)"
            )
        grad = IndexedSlices(_as_gradient(grad.values, var.name), grad.indices, grad.dense_shape)
        if getattr(self.strategy, "sparse_gradients", False):
            # The same checks as a dense gradient's, on a zero-stride view: no table-sized array per step.
            self._check_pair(np.broadcast_to(np.zeros((), np.dtype(grad.values.dtype)), grad.dense_shape), var)
            return grad.merged()
        dense = densify(grad)
        self._check_pair(dense, var)
        return dense

    def apply_dense(self, pairs: Iterable[tuple[Any, Variable]]) -> None:
        """The local update: ``iterations += 1``, then :meth:`update_array` for each (grad, variable).

        Strategies call it after synchronising the gradients. Every pair is checked before anything is
        updated, so a bad pair changes nothing.
        """
        checked = []
        for grad, var in pairs:
            grad = _as_gradient(grad, var.name)
            self._check_pair(grad, var)
            self._check_owner(var)
            checked.append((grad, var))
        self.iterations += 1
        for grad, var in checked:
            value = var.value
            self.update_array(var.name, value, grad)
            if not var.store.live:
                var.store.write(value)

    def _check_owner(self, var: Variable) -> None:
        ref = self._owners.get(var.name)
        owner = ref() if ref is not None else None
        if owner is not None and owner is not var:
            raise ConfigurationError(
                f"two different variables named {var.name!r} were passed to this {self.name} optimizer; "
                f"its state is keyed by variable name: give the variables distinct names"
            )
        if owner is None:
            self._owners[var.name] = weakref.ref(var)

    def update_array(self, name: str, value, grad, out=None) -> None:
        """Update the array ``value`` (numpy or cupy) in place with ``grad``, using the slots of ``name``.

        The per-variable step of :meth:`apply_dense`, also usable where there is no ``Variable`` (a
        parameter server applying a pushed gradient to its shard). It uses ``iterations`` as it is:
        increment it first (``apply_dense`` does). With ``out`` (an array of ``value``'s shape, dtype
        and module) the new value is written there and ``value`` is left as it was; the slots are
        updated either way. A parameter server uses it to update into a second buffer while the
        first is still being sent, or into the received gradient itself (``out=grad``: without a
        copy of the gradient when the rule allows it, see ``result_written_last``).

        >>> import numpy as np
        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> opt = Adagrad(learning_rate=0.1, initial_accumulator_value=0.0, epsilon=0.0)
        >>> opt.iterations += 1
        >>> shard = np.ones(2, np.float32)
        >>> opt.update_array("shard", shard, np.array([2.0, -2.0], np.float32)); shard
        array([0.9, 1.1], dtype=float32)
        """
        if self.iterations < 1:
            raise StratagemError(
                f"{self.name}.update_array needs iterations >= 1 (it is {self.iterations}): "
                f"increment opt.iterations before the step, or call apply_dense"
            )
        dtype = np.dtype(value.dtype)
        if not is_float_dtype(dtype):
            raise ConfigurationError(
                f"variable {name!r} has dtype {dtype}; optimizers update floating-point variables only"
            )
        xp = array_module(value)
        grad = to_module(_detach(grad) if not is_device_array(grad) else grad, xp)
        if tuple(grad.shape) != tuple(value.shape):
            raise ConfigurationError(
                f"the gradient of {name!r} has shape {tuple(grad.shape)}, the variable "
                f"{tuple(value.shape)}; gradients must have their variable's shape"
            )
        if out is None:
            out = value
        elif (tuple(out.shape) != tuple(value.shape) or np.dtype(out.dtype) != dtype
              or array_module(out) is not xp or xp.may_share_memory(out, value)):
            raise ConfigurationError(
                f"update_array(out=) of {name!r} must be a separate array of the variable's shape "
                f"{tuple(value.shape)}, dtype {dtype} and module {xp.__name__}"
            )
        over_grad = out is grad and self.writes_over_gradient
        if xp.may_share_memory(grad, value) or (out is not value and not over_grad
                                                 and xp.may_share_memory(grad, out)):
            grad = grad.copy()  # the update must not change the gradient while reading it
        work_dtype = compute_dtype(dtype)
        slots = self._slots_for(name, xp, tuple(value.shape), work_dtype)
        update_into, elementwise = self._rule()
        if elementwise and chunkable(value, out, grad, slots, self.chunk_from_bytes):
            update_chunked(update_into, value, out, grad, slots, self.iterations, work_dtype)
            return
        g = grad.astype(work_dtype, copy=False)
        if work_dtype == dtype:
            update_into(xp, value, out, g, slots, self.iterations)
            return
        w = value.astype(work_dtype)
        update_into(xp, w, w, g, slots, self.iterations)
        xp.copyto(out, w, casting="unsafe")

    @property
    def writes_over_gradient(self) -> bool:
        """True when ``update_array(name, value, grad, out=grad)`` writes the result over the
        gradient without copying it first (the rule writes each element last: see
        ``result_written_last``)."""
        return _writes_over_gradient(type(self))

    @property
    def sparse_exact(self) -> bool:
        """True when updating only the rows a sparse gradient touches gives exactly the dense update:
        the rule leaves a row whose gradient is zero, and that row's slots, as they are (plain SGD,
        Adagrad). False for rules where a zero gradient still moves the row (momentum, Adam) and for
        any rule this class cannot vouch for (a subclass with its own ``_update``). A parameter server
        applies row gradients with :meth:`update_rows` when it is True, else densifies them."""
        return False

    def update_rows(self, name: str, value, rows, grad_rows) -> None:
        """Update rows ``rows`` of ``value`` in place with their gradient ``grad_rows``, using the
        slots of ``name``: the rows of ``value`` and of the slots are gathered, the same rule runs on
        them with the same ufuncs, and they are scattered back, so the result equals the dense update
        bit for bit when :attr:`sparse_exact` (refused otherwise). ``rows`` must be unique (int64);
        ``grad_rows`` has shape ``(len(rows),) + value.shape[1:]``. Like :meth:`update_array`, it uses
        ``iterations`` as it is.

        >>> import numpy as np
        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> opt = SGD(learning_rate=0.5)
        >>> opt.iterations += 1
        >>> table = np.zeros((4, 2), np.float32)
        >>> opt.update_rows("table", table, np.array([3, 0]), np.ones((2, 2), np.float32)); table[:, 0]
        array([-0.5,  0. ,  0. , -0.5], dtype=float32)
        """
        from stratagem.training.optimizers.rows import update_rows

        update_rows(self, name, value, rows, grad_rows, slots_for=self._slots_for, update_into=self._rule()[0])

    _update = _no_rule

    def _rule(self) -> tuple[Callable, bool]:
        """The update to run, ``(update_into, may run in chunks)``, by :func:`_rule_of` its class."""
        into, chunked = _rule_of(type(self))
        return into.__get__(self), chunked

    _update_into = _copy_then_update

    def _slots_for(self, name: str, xp, shape, dtype) -> dict[str, Any]:
        slots = self._slots.get(name)
        if slots is None:
            slots = {slot: self._initial_slot(slot, xp, shape, dtype) for slot in self.slot_names()}
            self._slots[name] = slots
            return slots
        for slot, array in slots.items():
            if tuple(array.shape) != shape:
                raise ConfigurationError(
                    f"{self.name} state for variable {name!r}: slot {slot!r} has shape "
                    f"{tuple(array.shape)}, the variable {shape}; the state was saved for another model "
                    f"(or two variables share the name {name!r})"
                )
            if array_module(array) is not xp or array.dtype != dtype:
                slots[slot] = to_module(array, xp).astype(dtype, copy=False)  # once, after load_state_dict
        return slots

    # -- state ------------------------------------------------------------------------------------------
    def get_slot(self, var, slot_name: str):
        """The live slot array ``slot_name`` of a variable (or a variable name).

        >>> import numpy as np
        >>> from stratagem.training.variables import Variable
        >>> w = Variable(np.zeros(2, np.float32), name="w_slot_demo")
        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> opt = SGD(0.1, momentum=0.9)
        >>> opt.apply_gradients([(np.ones(2, np.float32), w)]); opt.get_slot(w, "momentum")
        1
        array([-0.1, -0.1], dtype=float32)
        """
        name = var.name if isinstance(var, Variable) else var
        if slot_name not in self.slot_names():
            raise ConfigurationError(
                f"{self.name} has no slot {slot_name!r}; its slots are {list(self.slot_names())}"
            )
        try:
            return self._slots[name][slot_name]
        except KeyError:
            raise ConfigurationError(
                f"{self.name} has no state for variable {name!r} yet: slots are created at its first update"
            ) from None

    def state_dict(self) -> dict[str, Any]:
        """``{"iterations": int, "slots": {variable_name: {slot_name: array}}}``, arrays copied.

        >>> import numpy as np
        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> opt = Adam()
        >>> opt.state_dict()
        {'iterations': 0, 'slots': {}}
        """
        return {
            "iterations": int(self.iterations),
            "slots": {name: {slot: array.copy() for slot, array in slots.items()}
                      for name, slots in self._slots.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the state with ``state`` (from :meth:`state_dict` or a checkpoint); arrays are copied.

        Slots are moved to the variable's array module and compute dtype at its next update.

        >>> import numpy as np
        >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
        >>> opt = SGD(0.1, momentum=0.9)
        >>> opt.load_state_dict({"iterations": 3, "slots": {"w": {"momentum": np.ones(2, np.float32)}}})
        >>> opt.iterations, opt.get_slot("w", "momentum")
        (3, array([1., 1.], dtype=float32))
        >>> opt.load_state_dict({"iterations": 3, "slots": {"w": {"m": np.ones(2)}}})
        Traceback (most recent call last):
        ...
        stratagem.core.errors.ConfigurationError: SGD state for variable 'w' has slots ['m'], this optimizer keeps ['momentum']; was the state saved by another optimizer (or other settings)?
        """
        if not isinstance(state, Mapping) or "iterations" not in state or "slots" not in state:
            raise ConfigurationError(
                f"an optimizer state is a dict {{'iterations': int, 'slots': {{...}}}} from state_dict(), "
                f"not {type(state).__name__}" + (f" with keys {sorted(state)}" if isinstance(state, Mapping) else "")
            )
        iterations = state["iterations"]
        if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 0:
            raise ConfigurationError(f"the state's iterations must be an integer >= 0, got {iterations!r}")
        if not isinstance(state["slots"], Mapping):
            raise ConfigurationError(f"the state's slots must be a dict, not {type(state['slots']).__name__}")
        expected = sorted(self.slot_names())
        loaded: dict[str, dict[str, Any]] = {}
        for name, slots in state["slots"].items():
            if not isinstance(slots, Mapping) or sorted(slots) != expected:
                found = sorted(slots) if isinstance(slots, Mapping) else type(slots).__name__
                raise ConfigurationError(
                    f"{self.name} state for variable {name!r} has slots {found}, this optimizer keeps "
                    f"{expected}; was the state saved by another optimizer (or other settings)?"
                )
            copies = {}
            for slot, array in slots.items():
                copy = array.copy() if is_device_array(array) else np.array(array, copy=True)
                if not is_float_dtype(np.dtype(copy.dtype)):
                    raise ConfigurationError(
                        f"{self.name} state for variable {name!r}: slot {slot!r} has dtype {copy.dtype}, "
                        f"not a floating-point type"
                    )
                copies[slot] = copy
            loaded[name] = copies
        self.iterations = int(iterations)
        self._slots = loaded
        self._owners = {}

    def __repr__(self) -> str:
        config = self.get_config()
        config.pop("name")
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in config.items())})"


@functools.lru_cache(maxsize=None)
def _writes_over_gradient(cls: type) -> bool:
    """True when ``cls``'s update may write its result over the gradient: the class that provides its
    rule (as :func:`_rule_of` finds it) defines ``_update_into`` itself and says
    ``result_written_last = True``. The generic ``_update_into`` copies ``src`` into ``w`` before the
    rule reads ``g``, so a rule given as ``_update`` never qualifies.

    >>> from stratagem.training.optimizers.rules import SGD, Adam
    >>> class Clipped(SGD):
    ...     def _update(self, xp, w, g, slots, t):
    ...         super()._update(xp, w, g / max(1.0, float(np.linalg.norm(g))), slots, t)
    >>> _writes_over_gradient(SGD), _writes_over_gradient(Adam), _writes_over_gradient(Clipped)
    (True, True, False)
    """
    for klass in cls.__mro__:
        if "_update_into" in vars(klass) or "_update" in vars(klass):
            return "_update_into" in vars(klass) and bool(vars(klass).get("result_written_last", False))
    return False


@functools.lru_cache(maxsize=None)
def _rule_of(cls: type) -> tuple[Callable, bool]:
    """``(the _update_into function, whether it may run in chunks)`` for an optimizer class.

    The most derived class that defines ``_update`` or ``_update_into`` decides: its ``_update_into``
    if it defines one, else the generic ``Optimizer._update_into`` around its ``_update`` (e.g. a
    subclass of SGD clipping the gradient by its norm); in chunks only if that class or a subclass
    of it says ``elementwise = True``.

    >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
    >>> class Clipped(SGD):
    ...     def _update(self, xp, w, g, slots, t):
    ...         super()._update(xp, w, g / max(1.0, float(np.linalg.norm(g))), slots, t)
    >>> _rule_of(SGD) == (SGD._update_into, True), _rule_of(Clipped) == (Optimizer._update_into, False)
    (True, True)
    """
    mro = cls.__mro__
    for index, klass in enumerate(mro):
        if "_update_into" in vars(klass) or "_update" in vars(klass):
            # klass is the first class of the MRO with either hook, so cls._update_into is klass's own
            into = cls._update_into if "_update_into" in vars(klass) else _copy_then_update
            declared = next((vars(k)["elementwise"] for k in mro[:index + 1] if "elementwise" in vars(k)), False)
            return into, bool(declared)
    return _copy_then_update, False


# -- configs ------------------------------------------------------------------------------------------

def _known_optimizers() -> dict[str, type]:
    found: dict[str, type] = {}
    pending = list(Optimizer.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if cls._update is not _no_rule:
            found.setdefault(cls.name.lower(), cls)
    return found


def from_config(config: Mapping[str, Any]) -> Optimizer:
    """Rebuild an optimizer from ``opt.get_config()`` (in the current strategy scope, if any).

    ``config["name"]`` is looked up (case-insensitively) among SGD, Adam, Adagrad and the subclasses of
    :class:`Optimizer` defined in this process.

    >>> from stratagem.training.optimizers.rules import SGD, Adam, Adagrad
    >>> opt = from_config(Adam(learning_rate=0.01).get_config())
    >>> opt
    Adam(learning_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-07)
    >>> from_config({"name": "RMSprop"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    stratagem.core.errors.ConfigurationError: unknown optimizer 'RMSprop'; known: Adagrad, Adam, SGD...
    """
    if not isinstance(config, Mapping) or not isinstance(config.get("name"), str):
        raise ConfigurationError(
            f"an optimizer config is a dict with a 'name' (from opt.get_config()), got {config!r}"
        )
    importlib.import_module(f"{__package__}.rules")  # the built-in rules: found as subclasses

    known = _known_optimizers()
    options = dict(config)
    name = options.pop("name")
    cls = known.get(name.lower())
    if cls is None:
        names = ", ".join(sorted(c.name for c in known.values()))
        raise ConfigurationError(f"unknown optimizer {name!r}; known: {names}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ConfigurationError(f"bad config for optimizer {cls.name}: {exc}") from None
