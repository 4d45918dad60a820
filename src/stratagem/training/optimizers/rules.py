"""Optimizers: the Keras/TF update rules, written once over the array module (numpy or cupy).

An optimizer created inside ``strategy.scope()`` belongs to that strategy: ``apply_gradients`` hands
the gradients to the strategy (``strategy.on_apply_gradients(self, pairs)``), which synchronises the
replicas (all-reduce for ``mirrored``, a push for a parameter server) and then calls
:meth:`Optimizer.apply_dense`, the local update. Outside any scope ``apply_gradients`` updates the
variables at once::

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.array([1.0, 2.0], np.float32), name="w")
    >>> opt = SGD(learning_rate=0.5)
    >>> opt.apply_gradients([(np.array([1.0, -1.0], np.float32), w)])
    1
    >>> w.numpy()
    array([0.5, 2.5], dtype=float32)

The update rules (``t`` is ``iterations`` after the increment, i.e. 1 at the first update):

- :class:`SGD`: ``w -= lr * g``; with momentum ``v = momentum * v - lr * g; w += v``; Nesterov
  ``v = momentum * v - lr * g; w += momentum * v - lr * g`` (Keras' formulation; equal to PyTorch's
  ``SGD(momentum, nesterov)`` with ``dampening=0``).
- :class:`Adam`: ``lr_t = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``, ``m += (g - m) * (1 - beta_1)``,
  ``v += (g*g - v) * (1 - beta_2)``, ``w -= lr_t * m / (sqrt(v) + epsilon)`` (TF's ``ApplyAdam``;
  PyTorch adds its ``eps`` to ``sqrt(v) / sqrt(1 - beta_2**t)`` instead, which differs only through
  epsilon).
- :class:`Adagrad`: ``acc += g*g; w -= lr * g / (sqrt(acc) + epsilon)``, ``acc`` starting at
  ``initial_accumulator_value`` (TF's ``ApplyAdagradV2`` and PyTorch's ``Adagrad``; Keras 3 writes
  ``sqrt(acc + epsilon)``, a difference of order epsilon).

The base class (checks, slots, precision, chunked and out-of-place updates, ``from_config``) is
:mod:`stratagem.training.optimizers.base`; its public names are importable from here too. PyTorch's own
rules (``TorchSGD``, ``TorchAdam``, ``TorchAdagrad``: :mod:`stratagem.training.optimizers.torch_rules`) are
importable from here as well, so that ``from_config`` finds them on every task.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.optimizers.base import Optimizer, _hyper, _rule_of, compute_dtype, from_config
from stratagem.training.optimizers.chunks import scratch

__all__ = ["Optimizer", "SGD", "Adam", "Adagrad", "TorchSGD", "TorchAdam", "TorchAdagrad", "from_config",
           "compute_dtype"]


def _own_rule(optimizer, cls) -> bool:
    """True when ``optimizer`` runs ``cls``'s rule (not a subclass's own ``_update``)."""
    return _rule_of(type(optimizer))[0] is cls._update_into


# -- the optimizers -------------------------------------------------------------------------------------

class SGD(Optimizer):
    """Stochastic gradient descent, with optional (Nesterov) momentum — the Keras/TF rule.

    ``w -= lr * g``; with ``momentum``: ``v = momentum * v - lr * g; w += v``; with ``nesterov``:
    ``v = momentum * v - lr * g; w += momentum * v - lr * g``. Slot: ``"momentum"`` (``v``, only when
    momentum > 0).

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.zeros(1), name="sgd_demo")
    >>> opt = SGD(learning_rate=0.1, momentum=0.5)
    >>> for _ in range(2):
    ...     _ = opt.apply_gradients([(np.ones(1), w)])
    >>> w.numpy()                     # v: -0.1, then -0.15; w: -0.1, then -0.25
    array([-0.25])
    """

    name = "SGD"
    elementwise = True
    result_written_last = True     # _update_into reads g first, writes w last

    def __init__(self, learning_rate: float = 0.01, momentum: float = 0.0, nesterov: bool = False):
        super().__init__(learning_rate)
        self.momentum = _hyper("momentum", momentum, low=0.0, high=1.0)
        if not isinstance(nesterov, (bool, np.bool_)):
            raise ConfigurationError(f"nesterov must be True or False, not {nesterov!r}")
        self.nesterov = bool(nesterov)

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum > 0 else ()

    @property
    def sparse_exact(self) -> bool:
        # w - lr * 0 == w; with momentum a zero gradient still moves v and w.
        return self.momentum == 0 and _own_rule(self, SGD)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}

    def _update(self, xp, w, g, slots, t):
        self._update_into(xp, w, w, g, slots, t)

    def _update_into(self, xp, src, w, g, slots, t):
        # The same ufuncs, in the same order and dtypes, as ``scaled = lr * g; w -= scaled`` etc.
        # over whole arrays (bit-for-bit), with the temporaries from ``scratch``. Written over the
        # gradient (``update_array(out=grad)``: then w is g), w itself holds ``lr * g``: one pass
        # over the memory less.
        over_gradient = w is g or xp.may_share_memory(w, g)
        if self.momentum == 0:
            scaled = w if over_gradient else scratch(xp, g, 1)[0]
            xp.multiply(g, self.learning_rate, out=scaled)    # lr * g
            xp.subtract(src, scaled, out=w)
            return
        if over_gradient:
            scaled, step = w, (scratch(xp, g, 1)[0] if self.nesterov else None)
        else:
            scaled, step = scratch(xp, g, 2) if self.nesterov else (*scratch(xp, g, 1), None)
        xp.multiply(g, self.learning_rate, out=scaled)
        v = slots["momentum"]
        v *= self.momentum
        v -= scaled                                           # v = momentum * v - lr * g
        if self.nesterov:
            xp.multiply(v, self.momentum, out=step)
            step -= scaled                                    # momentum * v - lr * g
            xp.add(src, step, out=w)
        else:
            xp.add(src, v, out=w)


class Adam(Optimizer):
    """Adam (Kingma & Ba), the Keras/TF rule with epsilon outside the bias correction.

    ``lr_t = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``; ``m += (g - m) * (1 - beta_1)``;
    ``v += (g*g - v) * (1 - beta_2)``; ``w -= lr_t * m / (sqrt(v) + epsilon)``. Slots ``"m"`` and ``"v"``.

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.ones(2, np.float32), name="adam_demo")
    >>> opt = Adam(learning_rate=0.1)
    >>> opt.apply_gradients([(np.array([0.5, -3.0], np.float32), w)])
    1
    >>> np.round(w.numpy(), 5)      # the first Adam step moves every weight by ~lr against its gradient
    array([0.9, 1.1], dtype=float32)
    """

    name = "Adam"
    elementwise = True
    result_written_last = True
    chunk_from_bytes = 1 << 20     # ten passes over the arrays: chunks pay from the smallest size

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7):
        super().__init__(learning_rate)
        self.beta_1 = _hyper("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _hyper("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = _hyper("epsilon", epsilon, low=0.0)

    def slot_names(self) -> tuple[str, ...]:
        return ("m", "v")

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon}

    def _update(self, xp, w, g, slots, t):
        self._update_into(xp, w, w, g, slots, t)

    def _update_into(self, xp, src, w, g, slots, t):
        b1, b2 = self.beta_1, self.beta_2
        lr_t = self.learning_rate * math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        m, v = slots["m"], slots["v"]
        tmp, step = scratch(xp, g, 2)
        xp.subtract(g, m, out=tmp)
        tmp *= 1.0 - b1
        m += tmp                                              # m += (g - m) * (1 - beta_1)
        xp.multiply(g, g, out=tmp)
        tmp -= v
        tmp *= 1.0 - b2
        v += tmp                                              # v += (g*g - v) * (1 - beta_2)
        xp.sqrt(v, out=tmp)
        tmp += self.epsilon                                   # sqrt(v) + epsilon
        xp.multiply(m, lr_t, out=step)
        step /= tmp
        xp.subtract(src, step, out=w)                         # w -= lr_t * m / (sqrt(v) + epsilon)


class Adagrad(Optimizer):
    """Adagrad (Duchi et al.), the TF rule: ``acc += g*g; w -= lr * g / (sqrt(acc) + epsilon)``.

    The accumulator (slot ``"accumulator"``) starts at ``initial_accumulator_value``.

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.zeros(1), name="adagrad_demo")
    >>> opt = Adagrad(learning_rate=1.0, initial_accumulator_value=0.0, epsilon=0.0)
    >>> opt.apply_gradients([(np.array([3.0]), w)]); w.numpy()     # 3 / sqrt(9)
    1
    array([-1.])
    """

    name = "Adagrad"
    elementwise = True
    result_written_last = True
    chunk_from_bytes = 1 << 20     # seven passes over the arrays: chunks pay from the smallest size

    def __init__(self, learning_rate: float = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7):
        super().__init__(learning_rate)
        self.initial_accumulator_value = _hyper("initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.epsilon = _hyper("epsilon", epsilon, low=0.0)

    def slot_names(self) -> tuple[str, ...]:
        return ("accumulator",)

    def _initial_slot(self, slot_name, xp, shape, dtype):
        return xp.full(shape, self.initial_accumulator_value, dtype)

    @property
    def sparse_exact(self) -> bool:
        # acc + 0*0 == acc and w - lr*0 / (sqrt(acc) + eps) == w, unless sqrt(acc) + eps is 0 (an
        # accumulator starting at 0 with epsilon 0), where the dense update writes 0/0 = NaN.
        return (self.initial_accumulator_value > 0 or self.epsilon > 0) and _own_rule(self, Adagrad)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "initial_accumulator_value": self.initial_accumulator_value,
                "epsilon": self.epsilon}

    def _update(self, xp, w, g, slots, t):
        self._update_into(xp, w, w, g, slots, t)

    def _update_into(self, xp, src, w, g, slots, t):
        acc = slots["accumulator"]
        tmp, step = scratch(xp, g, 2)
        xp.multiply(g, g, out=tmp)
        acc += tmp                                            # acc += g*g
        xp.sqrt(acc, out=tmp)
        tmp += self.epsilon
        xp.multiply(g, self.learning_rate, out=step)
        step /= tmp
        xp.subtract(src, step, out=w)                         # w -= lr * g / (sqrt(acc) + epsilon)


# torch.optim's rules, defined beside these so that from_config (which imports this module) finds them.
from stratagem.training.optimizers.torch_rules import TorchAdagrad, TorchAdam, TorchSGD  # noqa: E402
