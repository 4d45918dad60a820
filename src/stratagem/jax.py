"""JAX on a stratagem strategy: a pytree of parameters as Variables, ``jax.grad`` output straight into
the strategy, ``broadcast_parameters`` for pytrees.

Importing this module imports JAX (``import stratagem`` does not). JAX arrays are immutable, so the
variables hold numpy arrays and :meth:`TreeVariables.values` hands JAX a fresh pytree each step; the
gradient pytree from ``jax.grad`` goes to a stratagem optimizer (``tree.apply_gradients(opt, grads)``:
all-reduced under ``mirrored``, applied on the ps tasks under ``between_graph`` / ``parameter_server``)
or, for your own update rule, is reduced without being applied (``tree.reduce_gradients(grads)``,
``mirrored``). Names are the leaves' paths (``"dense/w"``), so checkpoints (``strategy.save`` /
``restore``) name them readably. For torch's exact rules, use ``stratagem.optimizers.TorchAdam`` etc.

Alone, a world of one (the same script runs under ``stratagem launch --worker 4``)::

    >>> import jax, jax.numpy as jnp, numpy as np, stratagem, stratagem.jax
    >>> strategy = stratagem.strategy("mirrored")
    >>> params = {"w": jnp.ones((3, 1)), "b": jnp.zeros(1)}
    >>> with strategy.scope():
    ...     tree = stratagem.jax.TreeVariables(params)
    ...     opt = stratagem.optimizers.SGD(learning_rate=0.1)
    >>> def loss(p, x, y):
    ...     return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> for _ in range(3):
    ...     grads = jax.grad(loss)(tree.values(), x, y)
    ...     _ = tree.apply_gradients(opt, grads)
    >>> sorted(tree.variables), float(loss(tree.values(), x, y)) < float(loss(params, x, y))
    (['b', 'w'], True)
    >>> strategy.shutdown()
"""

from __future__ import annotations

import jax as _jax  # noqa: F401 - this module needs JAX: fail here, with JAX's ImportError

from stratagem.adapters.jax_tree import TreeVariables, broadcast_parameters, leaf_names

__all__ = ["TreeVariables", "broadcast_parameters", "leaf_names"]
