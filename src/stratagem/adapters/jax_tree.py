"""A JAX pytree of parameters held as stratagem Variables (:class:`TreeVariables`), and
``broadcast_parameters`` for pytrees.

JAX arrays are immutable, so the variables hold numpy arrays (updated in place by the optimizers or
refreshed from the ps tasks) and :meth:`TreeVariables.values` hands JAX fresh arrays each step. The
gradients ``jax.grad`` returns (a pytree of the same structure) go straight into the strategy: to a
stratagem optimizer (:meth:`TreeVariables.apply_gradients`: all-reduced under ``mirrored``, pushed to
the ps tasks under ``between_graph`` / ``parameter_server``), or, for an update rule of your own
(optax...), reduced without being applied (:meth:`TreeVariables.reduce_gradients`, ``mirrored``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.replica_sync import allgather_json, broadcast_arrays, dtype_key
from stratagem.training.variables import Variable, resolve_strategy


def _key_name(key) -> str:
    """One step of a pytree path as a name part: a dict key, a sequence index, an attribute."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(tree, prefix: str = "") -> list[str]:
    """The names of a pytree's leaves, in ``tree_flatten`` order: their paths joined by ``/``
    (``{"dense": {"w": ...}}`` -> ``"dense/w"``), after ``prefix``."""
    import jax

    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    names = [prefix + "/".join(_key_name(k) for k in path) for path in paths]
    names = [name or "params" for name in names]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"the pytree's leaves do not have distinct names ({names}); use distinct keys")
    return names


class TreeVariables:
    """The leaves of a pytree as stratagem Variables of ``strategy`` (the one whose ``scope()`` is
    active if not given), named by their paths (``prefix`` first). Every replica must create the same
    tree; under ``mirrored`` they all start from the chief's values.

    ``values()``: the current values as a pytree of fresh JAX arrays (copies: JAX arrays are
    immutable, the variables are not). ``apply_gradients(opt, grads)``: one step of a stratagem
    optimizer (made in the strategy's ``scope()``) with the pytree ``grads`` from ``jax.grad``.
    ``reduce_gradients(grads)``: the replicas' weighted mean gradient, as a pytree, not applied.
    ``variables``: ``{name: Variable}``.
    """

    def __init__(self, params, strategy=None, *, prefix: str = ""):
        import jax

        self.strategy = strategy = resolve_strategy(strategy, "TreeVariables")
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.names = leaf_names(params, prefix)
        with strategy.scope():
            self._vars = [Variable(np.asarray(leaf), name=name) for leaf, name in zip(leaves, self.names)]

    @property
    def variables(self) -> dict[str, Variable]:
        return dict(zip(self.names, self._vars))

    def values(self):
        """The current values as a pytree of new JAX arrays (on parameter servers, pulled if stale)."""
        import jax
        import jax.numpy as jnp

        return jax.tree_util.tree_unflatten(self.treedef, [jnp.array(var.value, copy=True) for var in self._vars])

    def numpy(self):
        """The current values as a pytree of numpy copies."""
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, [var.numpy() for var in self._vars])

    def _leaves(self, grads, what: str) -> list:
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(grads)
        if treedef != self.treedef:
            raise ConfigurationError(
                f"{what}: the gradients' tree {treedef} is not the parameters' {self.treedef}; pass what "
                f"jax.grad returns for the pytree of values()"
            )
        # A zero-copy numpy view of each JAX array (read-only: the strategy only reads gradients).
        return [np.asarray(leaf) for leaf in leaves]

    def apply_gradients(self, optimizer, grads) -> int:
        """``optimizer.apply_gradients`` with the pytree ``grads``: the strategy's sync point. Returns
        the optimizer's ``iterations``."""
        return optimizer.apply_gradients(list(zip(self._leaves(grads, "apply_gradients"), self._vars)))

    def reduce_gradients(self, grads):
        """The pytree ``grads`` reduced over the replicas (``strategy.reduce_gradients``: under
        ``mirrored`` the mean weighted by each replica's share of the batch), as new JAX arrays."""
        import jax
        import jax.numpy as jnp

        leaves = self._leaves(grads, "reduce_gradients")
        reduced = self.strategy.reduce_gradients(list(zip(leaves, self._vars)))
        return jax.tree_util.tree_unflatten(self.treedef, [jnp.array(g, copy=True) for g in reduced])

    def __repr__(self) -> str:
        return f"TreeVariables({', '.join(self.names)})"


def broadcast_parameters(tree, root: int = 0, strategy=None) -> Any:
    """The pytree ``tree`` of replica ``root`` (a replica rank; 0 is the chief), returned on every
    replica as a pytree of new JAX arrays (JAX arrays cannot be written in place). Every replica calls
    it with a tree of the same structure, shapes and dtypes (checked first). Alone, it returns copies.
    """
    import jax
    import jax.numpy as jnp

    strategy = resolve_strategy(strategy, "broadcast_parameters()")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    replicas = strategy.cluster.replicas()
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < len(replicas):
        raise ConfigurationError(f"root must be a replica rank in 0..{len(replicas) - 1}, got {root!r}")
    if len(replicas) > 1:
        comm = strategy.communicator
        specs = [[list(a.shape), dtype_key(a.dtype)] for a in arrays]
        everyone = allgather_json(comm, [str(treedef), specs])
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[root]:
                raise ConfigurationError(
                    f"broadcast_parameters(): {replicas[rank]} passed a tree {theirs[0]} with leaves {theirs[1]}, "
                    f"the root ({replicas[root]}) {everyone[root][0]} with {everyone[root][1]}: pass the same tree"
                )
        arrays = broadcast_arrays(comm, [tuple(s) for s in specs], arrays if comm.rank == root else None, root=root)
    return jax.tree_util.tree_unflatten(treedef, [jnp.array(a, copy=True) for a in arrays])
