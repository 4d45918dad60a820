"""PyTorch's update rules (``torch.optim.SGD``, ``Adam``/``AdamW``, ``Adagrad``) as stratagem optimizers.

Stratagem's own :class:`~stratagem.training.optimizers.rules.SGD`, ``Adam`` and ``Adagrad`` follow Keras/TF;
these follow ``torch.optim`` equation for equation (its single-tensor CPU path, read from torch 2.x),
over numpy or cupy, without importing torch. They exist so that a torch optimizer can run where torch
is not: on the ps tasks of ``between_graph`` / ``parameter_server``, where
:class:`stratagem.torch.DistributedOptimizer` translates the user's ``torch.optim`` optimizer into one
of these (a ps task rebuilds it by name with ``from_config``). Slots are named like the torch
optimizer's state (``momentum_buffer``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``sum``), so a
checkpoint written on parameter servers restores into the torch optimizer under ``mirrored``.

``t`` is the step (``iterations`` after the increment: 1 at the first update), torch's ``state["step"]``.

- :class:`TorchSGD`: ``g = g + weight_decay * w``; with momentum ``buf = g`` at the first step, then
  ``buf = momentum * buf + (1 - dampening) * g``; ``g = g + momentum * buf`` (Nesterov) or ``g = buf``;
  ``w -= lr * g``.
- :class:`TorchAdam`: ``g = g + weight_decay * w`` (or, decoupled as in ``AdamW``,
  ``w *= 1 - lr * weight_decay``); ``m += (1 - beta_1) * (g - m)``; ``v = beta_2 * v + (1 - beta_2) * g*g``;
  ``denom = sqrt(v) / sqrt(1 - beta_2**t) + eps`` (epsilon *outside* the bias correction, unlike TF's,
  and ``v`` replaced by its running maximum with ``amsgrad``); ``w -= lr / (1 - beta_1**t) * m / denom``.
- :class:`TorchAdagrad`: ``g = g + weight_decay * w``; ``clr = lr / (1 + (t - 1) * lr_decay)``;
  ``sum += g*g``; ``w -= clr * g / (sqrt(sum) + eps)``.

``maximize=True`` negates the gradient first, as in torch.

>>> import numpy as np
>>> from stratagem.training.variables import Variable
>>> w = Variable(np.ones(2, np.float32), name="torch_adam_demo")
>>> opt = TorchAdam(learning_rate=0.1)
>>> opt.apply_gradients([(np.array([0.5, -3.0], np.float32), w)])
1
>>> np.round(w.numpy(), 5)            # torch.optim.Adam(lr=0.1) moves each weight by ~lr at step 1
array([0.9, 1.1], dtype=float32)
>>> TorchAdam.name, sorted(TorchAdam(amsgrad=True).slot_names())
('TorchAdam', ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq'])
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.optimizers.base import Optimizer, _hyper

__all__ = ["TorchSGD", "TorchAdam", "TorchAdagrad"]


def _flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigurationError(f"{name} must be True or False, not {value!r}")
    return bool(value)


def _prepared(xp, w, g, weight_decay: float, maximize: bool):
    """torch's first lines: the gradient negated (``maximize``) and with ``weight_decay * w`` added.
    Returns a new array whenever it changes ``g`` (the caller's gradient is never written)."""
    if maximize:
        g = xp.negative(g)
    if weight_decay:
        g = g + weight_decay * w
    return g


class TorchSGD(Optimizer):
    """``torch.optim.SGD``: momentum with dampening, Nesterov, L2 weight decay (see the module doc).

    >>> import numpy as np
    >>> from stratagem.training.variables import Variable
    >>> w = Variable(np.zeros(1), name="torch_sgd_demo")
    >>> opt = TorchSGD(learning_rate=0.1, momentum=0.5, dampening=0.5)
    >>> for _ in range(2):
    ...     _ = opt.apply_gradients([(np.ones(1), w)])
    >>> w.numpy()                 # buf: 1 (the first gradient, undampened), then 0.5 + 0.5; w: -0.1, -0.2
    array([-0.2])
    """

    name = "TorchSGD"
    elementwise = True

    def __init__(self, learning_rate: float = 0.001, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False):
        super().__init__(learning_rate)
        self.momentum = _hyper("momentum", momentum, low=0.0)
        self.dampening = _hyper("dampening", dampening)
        self.weight_decay = _hyper("weight_decay", weight_decay, low=0.0)
        self.nesterov = _flag("nesterov", nesterov)
        self.maximize = _flag("maximize", maximize)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigurationError("Nesterov momentum requires a momentum > 0 and zero dampening (as in torch)")

    def slot_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum > 0 else ()

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "maximize": self.maximize}

    def _update(self, xp, w, g, slots, t):
        g = _prepared(xp, w, g, self.weight_decay, self.maximize)
        if self.momentum > 0:
            buf = slots["momentum_buffer"]
            if t == 1:        # torch starts the buffer at the first gradient (no dampening)
                xp.copyto(buf, g)
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        w -= self.learning_rate * g


class TorchAdam(Optimizer):
    """``torch.optim.Adam`` and, with ``decoupled_weight_decay=True``, ``torch.optim.AdamW`` (see the
    module doc; note ``epsilon`` defaults to torch's 1e-8 and sits outside the bias correction)."""

    name = "TorchAdam"
    elementwise = True
    chunk_from_bytes = 1 << 20

    def __init__(self, learning_rate: float = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 decoupled_weight_decay: bool = False, maximize: bool = False):
        super().__init__(learning_rate)
        self.beta_1 = _hyper("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = _hyper("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = _hyper("epsilon", epsilon, low=0.0)
        self.weight_decay = _hyper("weight_decay", weight_decay, low=0.0)
        self.amsgrad = _flag("amsgrad", amsgrad)
        self.decoupled_weight_decay = _flag("decoupled_weight_decay", decoupled_weight_decay)
        self.maximize = _flag("maximize", maximize)

    def slot_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if self.amsgrad else ("exp_avg", "exp_avg_sq")

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                "weight_decay": self.weight_decay, "amsgrad": self.amsgrad,
                "decoupled_weight_decay": self.decoupled_weight_decay, "maximize": self.maximize}

    def _update(self, xp, w, g, slots, t):
        lr, b1, b2 = self.learning_rate, self.beta_1, self.beta_2
        if self.decoupled_weight_decay and self.weight_decay:
            g = _prepared(xp, w, g, 0.0, self.maximize)
            w *= 1.0 - lr * self.weight_decay
        else:
            g = _prepared(xp, w, g, self.weight_decay, self.maximize)
        m, v = slots["exp_avg"], slots["exp_avg_sq"]
        m += (1.0 - b1) * (g - m)                             # exp_avg.lerp_(g, 1 - beta_1)
        v *= b2
        v += (1.0 - b2) * (g * g)                             # exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
        if self.amsgrad:
            xp.maximum(slots["max_exp_avg_sq"], v, out=slots["max_exp_avg_sq"])
            v = slots["max_exp_avg_sq"]
        step_size = lr / (1.0 - b1 ** t)
        denom = xp.sqrt(v) / math.sqrt(1.0 - b2 ** t)
        denom += self.epsilon                                 # sqrt(v) / sqrt(bc2) + eps
        w -= step_size * m / denom                            # param.addcdiv_(m, denom, value=-step_size)


class TorchAdagrad(Optimizer):
    """``torch.optim.Adagrad``: learning-rate decay, L2 weight decay, accumulator ``sum`` (see the
    module doc; ``epsilon`` defaults to torch's 1e-10 and ``initial_accumulator_value`` to 0)."""

    name = "TorchAdagrad"
    elementwise = True
    chunk_from_bytes = 1 << 20

    def __init__(self, learning_rate: float = 0.01, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, epsilon: float = 1e-10, maximize: bool = False):
        super().__init__(learning_rate)
        self.lr_decay = _hyper("lr_decay", lr_decay, low=0.0)
        self.weight_decay = _hyper("weight_decay", weight_decay, low=0.0)
        self.initial_accumulator_value = _hyper("initial_accumulator_value", initial_accumulator_value, low=0.0)
        self.epsilon = _hyper("epsilon", epsilon, low=0.0)
        self.maximize = _flag("maximize", maximize)

    def slot_names(self) -> tuple[str, ...]:
        return ("sum",)

    def _initial_slot(self, slot_name, xp, shape, dtype):
        return xp.full(shape, self.initial_accumulator_value, dtype)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "lr_decay": self.lr_decay, "weight_decay": self.weight_decay,
                "initial_accumulator_value": self.initial_accumulator_value, "epsilon": self.epsilon,
                "maximize": self.maximize}

    def _update(self, xp, w, g, slots, t):
        g = _prepared(xp, w, g, self.weight_decay, self.maximize)
        clr = self.learning_rate / (1.0 + (t - 1) * self.lr_decay)
        total = slots["sum"]
        total += g * g                                        # state_sum.addcmul_(g, g, value=1)
        std = xp.sqrt(total)
        std += self.epsilon
        w -= clr * g / std                                    # param.addcdiv_(g, std, value=-clr)
