"""A torch module's parameters as stratagem Variables (no copies), and ``broadcast_parameters``.

:func:`wrap_module` creates one Variable per parameter, named like the module's ``state_dict`` keys,
inside the strategy's ``scope()``, and makes the parameter a view of the variable's buffer. Under
``mirrored`` the variables are local arrays that every replica starts from the chief's values; on
parameter servers they are this task's copies of the values on the ps tasks, refreshed in place. In
both cases the module computes with the current values, and nothing is copied per step.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from stratagem.core.errors import ConfigurationError
from stratagem.training.replica_sync import allgather_json, broadcast_arrays, dtype_key
from stratagem.training.variables import Variable, resolve_strategy
from stratagem.adapters.torch_tensors import as_array, as_tensor

#: The attribute a wrapped parameter carries: its Variable.
VARIABLE_ATTR = "_stratagem_variable"


def variable_of(param) -> Variable | None:
    """The Variable a parameter was made a view of by :func:`wrap_module` (``None`` if it was not)."""
    return getattr(param, VARIABLE_ATTR, None)


def wrap_parameters(named_parameters: Iterable, strategy=None) -> dict[str, Variable]:
    """Make each ``(name, parameter)`` a view of a new Variable of ``strategy`` named ``name``; return
    ``{name: Variable}``. Parameters wrapped before keep their Variable (it must be ``strategy``'s)."""
    strategy = resolve_strategy(strategy, "wrapping torch parameters")
    named = list(named_parameters)
    variables: dict[str, Variable] = {}
    fresh = []
    with strategy.scope():      # one scope block: the replicas check and sync these variables together
        for name, param in named:
            existing = variable_of(param)
            if existing is not None:
                if existing.strategy is not strategy:
                    raise ConfigurationError(
                        f"parameter {name!r} is already a view of variable {existing.name!r} of another "
                        f"strategy; wrap a module once per strategy"
                    )
                variables[name] = existing
                continue
            if param.is_sparse or param.layout != _strided():
                raise ConfigurationError(f"parameter {name!r} is not a dense tensor; only dense parameters can be wrapped")
            var = Variable(as_array(param), name=name)      # the variable copies the initial value once
            fresh.append((param, var))
            variables[name] = var
        for param, var in fresh:
            # Inside the scope: the buffer is the variable's own (mirrored) or this task's copy of the
            # values on the ps tasks; either way later values are written into it in place.
            param.data = as_tensor(var.value)
            setattr(param, VARIABLE_ATTR, var)
    return variables


def wrap_module(module, strategy=None, *, prefix: str = "") -> dict[str, Variable]:
    """Make every parameter of ``module`` a view of a stratagem Variable of ``strategy`` (the strategy
    whose ``scope()`` is active if not given), named ``prefix + `` its ``state_dict`` key; return
    ``{name: Variable}``. Every replica must wrap the same module (same names, shapes, dtypes).

    Under ``mirrored`` every replica's module then holds the chief's initial values; on parameter
    servers, the chief's values are sent to the ps tasks and the others pull them.
    """
    return wrap_parameters(((prefix + name, param) for name, param in module.named_parameters()), strategy)


def broadcast_parameters(params, root: int = 0, strategy=None) -> None:
    """Copy the replica ``root``'s tensors into the same tensors of every other replica, in place.

    ``params`` is a module (its ``state_dict()``: parameters and buffers), a dict ``{name: tensor}``
    (a ``state_dict``) or a list of ``(name, tensor)`` pairs (``module.named_parameters()``), the same
    names, shapes and dtypes on every replica (checked first: a difference is an error naming it).
    ``root`` is a replica's rank (0 is the chief). Every replica calls it at the same point. Under a
    world of one it does nothing. Parameters wrapped by :func:`wrap_module` are already the chief's
    after the scope; this is for anything else (buffers, a module loaded on one replica only).
    """
    import torch

    strategy = resolve_strategy(strategy, "broadcast_parameters()")
    items = _named_tensors(params, torch)
    replicas = strategy.cluster.replicas()
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < len(replicas):
        raise ConfigurationError(f"root must be a replica rank in 0..{len(replicas) - 1}, got {root!r}")
    if len(replicas) == 1:
        return
    comm = strategy.communicator
    specs = [[name, list(t.shape), dtype_key(_numpy_dtype(t))] for name, t in items]
    everyone = allgather_json(comm, specs)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[root]:
            mine, ref = {s[0]: s[1:] for s in theirs}, {s[0]: s[1:] for s in everyone[root]}
            diff = sorted(k for k in mine.keys() | ref.keys() if mine.get(k) != ref.get(k))
            raise ConfigurationError(
                f"broadcast_parameters(): {replicas[rank]} holds tensors that differ from the root's "
                f"({replicas[root]}) in {', '.join(map(repr, diff[:10]))}: every replica must pass the same "
                f"names, shapes and dtypes"
            )
    arrays = [t.detach().cpu().numpy() for _, t in items] if comm.rank == root else None
    received = broadcast_arrays(comm, [(shape, dtype) for _, shape, dtype in specs], arrays, root=root)
    if comm.rank == root:
        return
    with torch.no_grad():
        for (_, tensor), value in zip(items, received):
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def _named_tensors(params, torch) -> list[tuple[str, Any]]:
    if isinstance(params, torch.nn.Module):
        items = list(params.state_dict().items())
    elif isinstance(params, Mapping):
        items = list(params.items())
    else:
        try:
            items = [(name, tensor) for name, tensor in params]
        except (TypeError, ValueError):
            raise ConfigurationError(
                "broadcast_parameters() takes a module, a state_dict or (name, tensor) pairs "
                f"(module.named_parameters()), not {type(params).__name__}"
            ) from None
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigurationError(f"broadcast_parameters(): {name!r} is a {type(tensor).__name__}, not a tensor")
    return sorted(items, key=lambda item: item[0])


def _numpy_dtype(tensor) -> np.dtype:
    import torch

    return np.dtype(torch.empty(0, dtype=tensor.dtype).numpy().dtype)


def _strided():
    import torch

    return torch.strided
