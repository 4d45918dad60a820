"""Horovod's API on Stratagem: ``import stratagem.horovod as hvd`` is the only change a Horovod PyTorch
script needs (README: "Coming from Horovod").

Torch tensors in, torch tensors out (numpy arrays in, numpy arrays out). Importing this module does not
import torch; handing it a torch tensor or optimizer does (torch is then already loaded).

- ``init()`` finds the world as :func:`stratagem.communicator` does (``stratagem launch``, ``TF_CONFIG``,
  ``mpiexec``, Slurm; alone: a world of one). ``init(strategy="mirrored" | "between_graph" | a strategy
  object, **options)`` runs the same script on that strategy: ``DistributedOptimizer`` then goes
  through it (under ``between_graph`` the update runs on the ps tasks, which serve inside ``init``).
- ``rank()``, ``size()``, ``local_rank()``, ``local_size()`` (the ranks whose address has this host),
  ``cross_rank()``, ``cross_size()``, ``is_initialized()``.
- ``allreduce(t, op=Average)`` (also ``Sum``, ``Min``, ``Max``, ``Product``, and the older
  ``average=True|False``), ``allgather(t)`` (concatenated along dimension 0; ranks may pass different
  numbers of rows), ``broadcast(t, root_rank)`` (a new tensor), ``broadcast_(t, root_rank)`` (in
  place), ``broadcast_object(obj, root_rank)`` (plain data: JSON, never pickle); ``name=`` is accepted
  and names the call in a mismatch error. The ``*_async`` forms and ``synchronize(handle)`` run the call
  at once (the handle holds the result).
- ``broadcast_parameters(state_dict, root_rank=0)``, ``broadcast_optimizer_state(opt, root_rank=0)``
  (before or after the optimizer's first step), ``DistributedOptimizer(opt, named_parameters=...,
  compression=Compression.none | Compression.fp16, backward_passes_per_step=1, op=Average,
  gradient_predivide_factor=1.0)``: the torch optimizer's attributes plus ``synchronize()`` and
  ``skip_synchronize()``.
- ``join()``: this rank has no more data; it answers the others' collectives and optimizer steps
  (contributing nothing: an average divides by the ranks still training; it applies the same updates,
  so every rank keeps the same weights) until all have joined; returns the rank that joined last.
- ``shutdown()``: ends what ``init()`` opened (optional: a script may simply end).

The process holds one Horovod world (Horovod's API is process-global by design): ``init()`` sets it,
``shutdown()`` clears it.

Alone, a world of one::

    >>> import numpy as np
    >>> import stratagem, stratagem.horovod as hvd
    >>> hvd.init(transport="local",        # alone; under `stratagem launch` plain hvd.init()
    ...          transport_options=stratagem.plugin_manager().transport_class("local").world_options())
    >>> hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()
    (0, 1, 0, 1)
    >>> hvd.allreduce(np.array([2.0, 4.0]), op=hvd.Sum)
    array([2., 4.])
    >>> hvd.allgather(np.zeros((3, 2))).shape
    (3, 2)
    >>> hvd.join()
    0
    >>> hvd.shutdown()
"""

from __future__ import annotations

import os

import numpy as np

from stratagem.core.errors import ConfigurationError

#: The environment variable naming the strategy ``hvd.init()`` runs on when the script names none.
STRATEGY_ENV = "STRATAGEM_HOROVOD_STRATEGY"

#: Reduction ops (Horovod's names).
Average = "average"
Sum = "sum"
Min = "min"
Max = "max"
Product = "product"
#: Horovod's Adasum: not supported (``op=hvd.Adasum`` is refused, naming hvd.Average).
Adasum = "adasum"

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "allreduce", "allreduce_", "allgather", "broadcast", "broadcast_", "broadcast_object",
           "allreduce_async", "allgather_async", "broadcast_async", "synchronize", "poll",
           "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer", "join", "Compression",
           "Average", "Sum", "Min", "Max", "Product", "Adasum", "mpi_threads_supported", "nccl_built",
           "mpi_built", "gloo_built"]


class Compression:
    """Gradient compression for ``DistributedOptimizer`` (Horovod's names): ``none``, or ``fp16`` (the
    gradients travel as float16 and come back as their dtype)."""

    none = "none"
    fp16 = "fp16"


class _Horovod:
    """What ``init()`` opened: the world (ranks and collectives), the strategy if any, and what to close."""

    def __init__(self, world, strategy, owned) -> None:
        self.world = world
        self.strategy = strategy
        self.owned = owned     # closed by shutdown(): the communicator, and a strategy init() created


_current: list[_Horovod] = []     # the process's Horovod world, once init() ran (Horovod's API is global)


def _hvd() -> _Horovod:
    if not _current:
        raise ConfigurationError("Horovod has not been initialized; call hvd.init() first")
    return _current[0]


def init(comm=None, *, strategy=None, transport: str | None = None, transport_options: dict | None = None,
         **options) -> None:
    """Join the world (see the module doc). Calling it again does nothing.

    ``strategy``: None (collectives and ``DistributedOptimizer`` over a communicator), a strategy's name
    (created here with ``transport`` and ``options``, e.g. ``compression="fp16"``) or a strategy object.
    Without it, the environment's ``STRATAGEM_HOROVOD_STRATEGY`` names one (so an unchanged script runs
    on, say, parameter servers: ``STRATAGEM_HOROVOD_STRATEGY=between_graph stratagem launch --ps 1 ...``).
    ``transport``: the transport's name (default: ``stratagem launch --transport``, else zmq), with
    ``transport_options`` for its constructor.
    ``comm`` (Horovod's MPI sub-communicator) is not supported: every chief and worker task takes part.
    """
    if _current:
        return
    if comm is not None:
        raise ConfigurationError("hvd.init(comm=...): sub-communicators are not supported; call hvd.init() "
                                 "and every chief and worker task of the job takes part")
    from stratagem.collectives.communicator import Communicator
    from stratagem.adapters.horovod_world import HorovodWorld

    owned = []
    if strategy is None:
        strategy = os.environ.get(STRATEGY_ENV) or None
    if strategy is None:
        if options:
            raise ConfigurationError(f"hvd.init(): {', '.join(sorted(options))} are a strategy's options: pass "
                                     f"strategy='mirrored' (or 'between_graph') with them")
        import stratagem
        from stratagem.core.cluster import ClusterResolver

        resolved = ClusterResolver.from_env()
        if resolved.task not in resolved.cluster.replicas():
            raise ConfigurationError(
                f"hvd.init() on {resolved.task}: only chief and worker tasks run a Horovod script; with ps "
                f"tasks in the job, pass a parameter-server strategy: hvd.init(strategy='between_graph')"
            )
        comm = stratagem.communicator(transport, name="horovod", transport_options=transport_options)
        owned.append(comm)
    else:
        name = strategy if isinstance(strategy, str) else getattr(strategy, "name", None)
        if name not in ("mirrored", "between_graph"):
            raise ConfigurationError(
                f"hvd.init(strategy={name!r}): a Horovod script runs its training loop on every replica; "
                f"under {name!r} one task drives the others (or it is not a strategy). Use 'mirrored' "
                f"(all-reduce) or 'between_graph' (parameter servers)"
            )
        if isinstance(strategy, str):
            import stratagem

            strategy = stratagem.strategy(strategy, transport=transport, transport_options=transport_options,
                                          **options)
            owned.append(strategy)
        elif transport is not None or transport_options is not None or options:
            raise ConfigurationError("hvd.init(strategy=<a strategy object>): give the transport and options to "
                                     "the strategy you create, not to hvd.init()")
        comm = Communicator(strategy.transport, strategy.cluster.replicas(), name="horovod")
        owned.insert(0, comm)
    _current.append(_Horovod(HorovodWorld(comm), strategy, owned))


def shutdown() -> None:
    """End what ``init()`` opened (the communicator; a strategy it created). Idempotent."""
    if not _current:
        return
    state = _current.pop()
    for thing in state.owned:
        (thing.close if hasattr(thing, "close") else thing.shutdown)()


def is_initialized() -> bool:
    return bool(_current)


def rank() -> int:
    return _hvd().world.rank


def size() -> int:
    return _hvd().world.size


def local_rank() -> int:
    """This rank's index among the ranks of its host (by the host of each task's address)."""
    return _hvd().world.local_rank


def local_size() -> int:
    """How many ranks share this rank's host."""
    return _hvd().world.local_size


def cross_rank() -> int:
    """This host's index among the hosts (hosts ordered by their first rank): Horovod's cross rank."""
    return _hvd().world.cross_rank


def cross_size() -> int:
    """How many hosts the ranks are on."""
    return _hvd().world.cross_size


def mpi_threads_supported() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


# -- collectives ---------------------------------------------------------------------------------------
def _torch_part():
    from stratagem.adapters import horovod_torch

    return horovod_torch


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _as_array(x, what: str) -> np.ndarray:
    if _is_torch(x):
        return _torch_part().to_numpy(x)
    if isinstance(x, np.ndarray):
        return x
    raise ConfigurationError(f"hvd.{what}() takes a torch tensor or a numpy array, not {type(x).__name__}")


def _back(result: np.ndarray, x):
    return _torch_part().like(result, x) if _is_torch(x) else result


def _op(op, average, what: str) -> str:
    if average is not None:
        if op is not None:
            raise ConfigurationError(f"hvd.{what}(): pass op= or the older average=, not both")
        return Average if average else Sum
    op = Average if op is None else op
    if op == Adasum:
        raise ConfigurationError(f"hvd.{what}(op=hvd.Adasum) is not supported; use hvd.Average")
    if op not in (Average, Sum, Min, Max, Product):
        raise ConfigurationError(f"hvd.{what}(): unknown op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max "
                                 f"or hvd.Product")
    return op


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """``tensor`` reduced over the ranks (default: averaged), as a new tensor of its kind."""
    op = _op(op, average, "allreduce")
    _no_process_set(process_set)
    array = _as_array(tensor, "allreduce")
    if prescale_factor != 1.0:
        array = array * array.dtype.type(prescale_factor)
    if compression == Compression.fp16 and np.issubdtype(array.dtype, np.floating):
        result = _hvd().world.allreduce(array.astype(np.float16), op, name).astype(array.dtype)
    else:
        result = _hvd().world.allreduce(array, op, name)
    if postscale_factor != 1.0:
        result = result * result.dtype.type(postscale_factor)
    return _back(result, tensor)


def allreduce_(tensor, average=None, name=None, op=None, **kwargs):
    """:func:`allreduce` into ``tensor`` itself; returns it."""
    result = allreduce(tensor, average=average, name=name, op=op, **kwargs)
    return _copy_into(tensor, result)


def allgather(tensor, name=None, process_set=None):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (ranks may differ in it)."""
    _no_process_set(process_set)
    return _back(_hvd().world.allgather(_as_array(tensor, "allgather"), name), tensor)


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Rank ``root_rank``'s ``tensor`` on every rank, as a new tensor."""
    _no_process_set(process_set)
    array = _as_array(tensor, "broadcast")
    return _back(_hvd().world.broadcast(array, root_rank, name), tensor)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Rank ``root_rank``'s ``tensor`` copied into ``tensor`` on every rank; returns it."""
    return _copy_into(tensor, broadcast(tensor, root_rank, name, process_set))


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Rank ``root_rank``'s ``obj`` on every rank: plain data (dicts, lists, numbers, strings) and numpy
    arrays, sent as JSON and raw arrays (never pickled)."""
    _no_process_set(process_set)
    return _hvd().world.broadcast(obj, root_rank, name)


def _copy_into(tensor, result):
    if _is_torch(tensor):
        import torch

        with torch.no_grad():
            tensor.copy_(result)
    else:
        tensor[...] = result
    return tensor


def _no_process_set(process_set) -> None:
    if process_set is not None:
        raise ConfigurationError("process_set= is not supported: every rank takes part in each collective")


class _Handle:
    """What the ``*_async`` calls return: the call already ran; ``synchronize(handle)`` gives its result."""

    def __init__(self, result) -> None:
        self.result = result


def allreduce_async(tensor, average=None, name=None, op=None, **kwargs):
    return _Handle(allreduce(tensor, average=average, name=name, op=op, **kwargs))


def allgather_async(tensor, name=None, process_set=None):
    return _Handle(allgather(tensor, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return _Handle(broadcast(tensor, root_rank, name, process_set))


def poll(handle) -> bool:
    return True


def synchronize(handle):
    """The result of an ``*_async`` call."""
    if not isinstance(handle, _Handle):
        raise ConfigurationError(f"hvd.synchronize() takes the handle an *_async call returned, not "
                                 f"{type(handle).__name__}")
    return handle.result


def join(device=-1) -> int:
    """This rank has no more data: answer the others' collectives and optimizer steps until every rank
    has joined; returns the rank that joined last (see the module doc)."""
    return _hvd().world.join()


# -- torch models and optimizers -----------------------------------------------------------------------
def broadcast_parameters(params, root_rank=0) -> None:
    """Copy rank ``root_rank``'s tensors (``model.state_dict()``, ``model.named_parameters()``) into
    every other rank's, in place."""
    state = _hvd()
    _torch_part().broadcast_parameters(state.world, params, state.world.check_root(root_rank))


def broadcast_optimizer_state(optimizer, root_rank=0) -> None:
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters (torch's Adam too, before
    or after its first step)."""
    state = _hvd()
    _torch_part().broadcast_optimizer_state(state.world, optimizer, state.world.check_root(root_rank))


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
    """Wrap a ``torch.optim`` optimizer: ``step()`` reduces the gradients over the ranks (under
    ``hvd.init(strategy=...)``, through the strategy), then runs the torch optimizer's step."""
    state = _hvd()
    _no_process_set(process_set)
    if compression not in (Compression.none, Compression.fp16):
        raise ConfigurationError(f"compression must be hvd.Compression.none or hvd.Compression.fp16, got {compression!r}")
    if op == Adasum:
        raise ConfigurationError("op=hvd.Adasum is not supported; use hvd.Average")
    return _torch_part().distributed_optimizer(
        state.world, state.strategy, optimizer, named_parameters, compression=compression,
        backward_passes_per_step=backward_passes_per_step, op=op,
        gradient_predivide_factor=gradient_predivide_factor)
