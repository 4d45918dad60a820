"""The torch half of ``stratagem.horovod``: tensors in and out, ``broadcast_parameters``,
``broadcast_optimizer_state`` and ``DistributedOptimizer``.

Importing this module imports torch; ``stratagem.horovod`` imports it only when a torch tensor or
optimizer is handed to it.

``DistributedOptimizer`` comes in two kinds, chosen by :func:`distributed_optimizer`:

- :class:`AllreduceOptimizer` (``hvd.init()`` without a strategy): Horovod's optimizer over the
  :class:`~stratagem.adapters.horovod_world.HorovodWorld`: at ``synchronize()`` (or ``step()``) it
  all-reduces every parameter's gradient (zeros for a parameter without one, as Horovod does), fused
  into one buffer per dtype, cast to float16 around the exchange with ``Compression.fp16``, averaged
  over the ranks that have not joined (or summed), then runs the torch optimizer's own ``step()``;
- :class:`StrategyOptimizer` (``hvd.init(strategy=...)``): ``stratagem.torch.DistributedOptimizer``
  under the strategy: under ``mirrored`` the strategy all-reduces (its buckets, its compressor);
  under ``between_graph`` the update runs on the ps tasks.

Both count backward passes (``backward_passes_per_step``: gradients of that many passes accumulate
locally before one reduction; one more before ``step()`` is an error, as in Horovod) and both are
followed by ranks that have joined (``hvd.join()``), which then apply the same updates.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from stratagem.core.errors import ConfigurationError
from stratagem.adapters.torch_optim import DistributedOptimizer as _StrategyDistributedOptimizer
from stratagem.adapters.torch_params import variable_of
from stratagem.adapters.torch_tensors import as_array, as_tensor


def is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def to_numpy(tensor) -> np.ndarray:
    """A CPU numpy copy-or-view of ``tensor`` (detached)."""
    return tensor.detach().cpu().numpy()


def like(array: np.ndarray, tensor):
    """``array`` as a new tensor of ``tensor``'s dtype and device."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=tensor.device, dtype=tensor.dtype)


def named_tensors(params, what: str) -> list:
    """``(name, tensor)`` pairs from a ``state_dict``, ``named_parameters()`` or a module, by name."""
    if isinstance(params, torch.nn.Module):
        items = list(params.state_dict().items())
    elif isinstance(params, dict):
        items = list(params.items())
    else:
        try:
            items = [(name, tensor) for name, tensor in params]
        except (TypeError, ValueError):
            raise ConfigurationError(f"{what} takes a state_dict, model.named_parameters() or a module, "
                                     f"not {type(params).__name__}") from None
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ConfigurationError(f"{what}: {name!r} is a {type(tensor).__name__}, not a tensor")
    return sorted(items, key=lambda item: str(item[0]))


def broadcast_parameters(world, params, root_rank: int) -> None:
    """Copy rank ``root_rank``'s tensors into every other rank's (in place, by name)."""
    items = named_tensors(params, "broadcast_parameters()")
    mine = {str(name): tensor for name, tensor in items}
    theirs = world.broadcast({name: to_numpy(tensor) for name, tensor in mine.items()}
                             if world.rank == root_rank else None, root_rank, name="broadcast_parameters")
    if world.rank == root_rank:
        return
    differ = sorted(name for name in mine.keys() | theirs.keys()
                    if name not in mine or name not in theirs or tuple(mine[name].shape) != theirs[name].shape)
    if differ:
        raise ConfigurationError(
            f"broadcast_parameters(): rank {world.rank}'s tensors differ from root rank {root_rank}'s in "
            f"{', '.join(map(repr, differ[:10]))}: every rank must pass the same names and shapes"
        )
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(torch.from_numpy(np.ascontiguousarray(theirs[name])))


def broadcast_optimizer_state(world, optimizer, root_rank: int) -> None:
    """Give every rank the root's optimizer state (``state_dict()``: the per-parameter state and the
    hyperparameters of ``param_groups``), before or after its first step: a root without state yet
    (Adam before its first step) leaves every rank without state."""
    optimizer = torch_optimizer(optimizer, "broadcast_optimizer_state()")
    state = _to_numpy_tree(optimizer.state_dict()) if world.rank == root_rank else None
    received = world.broadcast(state, root_rank, name="broadcast_optimizer_state")
    if world.rank == root_rank:
        return
    try:
        optimizer.load_state_dict(_to_torch_tree(received))
    except (ValueError, KeyError) as exc:
        raise ConfigurationError(f"broadcast_optimizer_state(): root rank {root_rank}'s optimizer does not fit "
                                 f"this rank's ({exc}): every rank must create the same optimizer") from None


def torch_optimizer(optimizer, what: str):
    """The ``torch.optim`` optimizer of ``optimizer`` (itself, or the one a DistributedOptimizer wraps)."""
    if isinstance(optimizer, (AllreduceOptimizer, StrategyOptimizer)):
        return optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(f"{what} takes a torch.optim optimizer (or hvd.DistributedOptimizer), "
                                 f"not {type(optimizer).__name__}")
    return optimizer


def _to_numpy_tree(node):
    if isinstance(node, torch.Tensor):
        return to_numpy(node).copy()
    if isinstance(node, dict):
        return {key: _to_numpy_tree(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_to_numpy_tree(value) for value in node)
    return node


def _to_torch_tree(node):
    if isinstance(node, np.ndarray):
        return torch.from_numpy(np.array(node))
    if isinstance(node, dict):
        return {key: _to_torch_tree(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_to_torch_tree(value) for value in node)
    return node


def distributed_optimizer(world, strategy, optimizer, named_parameters=None, *, compression: str = "none",
                          backward_passes_per_step: int = 1, op: str = "average",
                          gradient_predivide_factor: float = 1.0):
    """``hvd.DistributedOptimizer``: an :class:`AllreduceOptimizer`, or a :class:`StrategyOptimizer`
    under a strategy. Arguments as Horovod's (checked here)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(f"DistributedOptimizer wraps a torch.optim optimizer, not {type(optimizer).__name__}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ConfigurationError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
    if op not in ("average", "sum"):
        raise ConfigurationError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum, got {op!r} "
                                 f"(Adasum is not supported: use hvd.Average)")
    if not (isinstance(gradient_predivide_factor, (int, float)) and gradient_predivide_factor > 0):
        raise ConfigurationError(f"gradient_predivide_factor must be a number > 0, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ConfigurationError("gradient_predivide_factor applies to op=hvd.Average only")
    named = _named_parameters(optimizer, named_parameters)
    if strategy is None:
        return AllreduceOptimizer(world, optimizer, named, compression, backward_passes_per_step, op,
                                  float(gradient_predivide_factor))
    return StrategyOptimizer(world, strategy, optimizer, named, compression, backward_passes_per_step, op)


def _named_parameters(optimizer, named_parameters) -> list:
    """``(name, parameter)`` for every parameter of the optimizer, in ``param_groups`` order."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ConfigurationError("a parameter appears twice in the optimizer's param_groups")
    names = {}
    if named_parameters is not None:
        pairs = list(named_parameters)
        if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in pairs):
            raise ConfigurationError("named_parameters must be (name, parameter) pairs: model.named_parameters()")
        seen = [name for name, _ in pairs]
        repeated = sorted({name for name in seen if seen.count(name) > 1})
        if repeated:
            raise ConfigurationError(f"named_parameters has repeated names: {', '.join(repeated)}")
        names = {id(p): name for name, p in pairs}
        unnamed = [index for index, p in enumerate(params) if id(p) not in names]
        if unnamed:
            raise ConfigurationError(
                f"named_parameters does not name {len(unnamed)} of the optimizer's parameters (the first is "
                f"#{unnamed[0]} in param_groups order): pass model.named_parameters() of the model they belong to"
            )
    return [(names.get(id(p), f"allreduce.noname.{index}"), p) for index, p in enumerate(params)]


class _Synchronizing:
    """What both kinds share: the backward-pass count, ``synchronize()`` / ``skip_synchronize()``, and
    the torch optimizer's other attributes."""

    def __init__(self, world, optimizer, named: list, passes: int):
        self.optimizer = optimizer
        self.world = world
        self.backward_passes_per_step = passes
        self._named = [(name, p) for name, p in named if p.requires_grad]
        for name, param in self._named:
            if param.is_sparse:
                raise ConfigurationError(f"parameter {name!r} is sparse: only dense parameters are reduced")
        self._passes = {name: 0 for name, _ in self._named}
        self._hooks = [param.register_post_accumulate_grad_hook(self._counter(name)) for name, param in self._named]
        self._synchronized = False
        self._skip = False

    def _counter(self, name: str):
        def count(param) -> None:
            self._passes[name] += 1
            if self._passes[name] > self.backward_passes_per_step:
                self._passes[name] = 0
                raise ConfigurationError(
                    f"gradients were computed more than backward_passes_per_step={self.backward_passes_per_step} "
                    f"times before step() (parameter {name!r}): call step() after each backward pass, or pass "
                    f"backward_passes_per_step=N to accumulate N passes locally"
                )
        return count

    def _dense_grads(self, zero: bool) -> list:
        """Every parameter's gradient (created as zeros where missing, as Horovod does); ``zero``: all zeros."""
        grads = []
        for name, param in self._named:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif zero:
                param.grad.zero_()
            if param.grad.is_sparse:
                raise ConfigurationError(f"parameter {name!r} has a sparse gradient; only dense gradients are reduced")
            grads.append(param.grad)
        return grads

    def _layout(self) -> list:
        return [(name, tuple(p.shape), str(p.dtype)) for name, p in self._named]

    def synchronize(self) -> None:
        """Reduce the gradients now (into ``param.grad``); then ``with opt.skip_synchronize(): opt.step()``
        applies them without reducing again (e.g. after ``clip_grad_norm_``)."""
        self._synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside applies the gradients ``synchronize()`` reduced, without reducing again."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        """Reduce the gradients (unless ``synchronize()`` did, or inside ``skip_synchronize()``) and run
        the torch optimizer's step. ``closure`` is the torch optimizer's (called by it)."""
        if self._skip or self._synchronized:
            loss = self._apply(closure)
        else:
            loss = self._reduce_and_apply(closure)
        self._synchronized = False
        self._passes = dict.fromkeys(self._passes, 0)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The torch optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def __class__(self):
        # isinstance(opt, torch.optim.SGD) holds, as for Horovod's optimizer (a subclass of the wrapped
        # one's class), so that learning-rate schedulers and other code checking the kind accept it.
        return type(self.optimizer)

    def __getattr__(self, name: str):
        if name in ("optimizer", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)


class AllreduceOptimizer(_Synchronizing):
    """Horovod's ``DistributedOptimizer`` over a :class:`~stratagem.adapters.horovod_world.HorovodWorld`
    (see the module doc)."""

    def __init__(self, world, optimizer, named: list, compression: str, passes: int, op: str, predivide: float):
        super().__init__(world, optimizer, named, passes)
        self.compression, self.op, self.predivide = compression, op, predivide
        self._ident = world.follow(self._follow)

    def _synchronize(self) -> None:
        grads = self._dense_grads(zero=False)
        active = self.world.step_round(self._ident, [self._layout(), self.op, self.compression])
        self._reduce(grads, active)

    def _reduce_and_apply(self, closure):
        self._synchronize()
        return self._apply(closure)

    def _apply(self, closure):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def _follow(self, active: int) -> None:
        """On a joined rank: the step the others make, with zeros for gradients, applied here too."""
        self._reduce(self._dense_grads(zero=True), active)
        self._apply(None)

    def _reduce(self, grads: list, active: int) -> None:
        groups: dict = {}
        for index, grad in enumerate(grads):
            groups.setdefault(grad.dtype, []).append(index)
        for indices in groups.values():
            flat = np.concatenate([to_numpy(grads[i]).reshape(-1) for i in indices])
            dtype = flat.dtype
            if self.compression == "fp16" and np.issubdtype(dtype, np.floating):
                flat = flat.astype(np.float16)
            if self.op == "average" and self.predivide != 1.0:
                flat = flat * flat.dtype.type(1.0 / self.predivide)
                total = self.world.reduce_announced(flat, "sum", flat.dtype, flat.size, active)
                total *= total.dtype.type(self.predivide / active)
            else:
                total = self.world.reduce_announced(flat, self.op, flat.dtype, flat.size, active)
            total = total.astype(dtype, copy=False)
            offset = 0
            with torch.no_grad():
                for i in indices:
                    n = grads[i].numel()
                    grads[i].copy_(torch.from_numpy(total[offset:offset + n]).reshape(grads[i].shape))
                    offset += n

    def __repr__(self) -> str:
        return (f"hvd.DistributedOptimizer({type(self.optimizer).__name__}, {len(self._named)} parameters, "
                f"op={self.op}, compression={self.compression})")


class StrategyOptimizer(_Synchronizing):
    """``hvd.DistributedOptimizer`` under ``hvd.init(strategy=...)``: ``stratagem.torch``'s
    DistributedOptimizer on that strategy (see the module doc)."""

    def __init__(self, world, strategy, optimizer, named: list, compression: str, passes: int, op: str):
        if strategy.name not in ("mirrored", "between_graph"):
            raise ConfigurationError(f"hvd.DistributedOptimizer runs under 'mirrored' and 'between_graph', "
                                     f"not {strategy.name!r}")
        self.mirrored = strategy.name == "mirrored"
        if op == "sum" and not self.mirrored:
            raise ConfigurationError("op=hvd.Sum: under 'between_graph' the ps tasks aggregate the gradients "
                                     "their own way; use op=hvd.Average there")
        compressor = getattr(strategy, "compressor", None)
        has = getattr(compressor, "name", "none") if compressor is not None else "none"
        if compression == "fp16" and has != "fp16":
            raise ConfigurationError(
                f"compression=hvd.Compression.fp16 under the {strategy.name!r} strategy: the strategy compresses "
                f"the gradients; create it with it: hvd.init(strategy={strategy.name!r}, compression='fp16')"
            )
        self.strategy, self.op, self.compression = strategy, op, compression
        ident = world.follow(self._follow)
        self._ident = ident
        # Each parameter becomes a variable of the strategy named by named_parameters; a second model
        # with the same names (a GAN's two networks, a model built again) gets them prefixed.
        taken = {variable.name for variable in strategy.variables}
        unique = [(name if variable_of(p) is not None or name not in taken else f"optimizer{ident}/{name}", p)
                  for name, p in named]
        # Reduced at step(), not during the backward pass: Horovod's Sum and join() scale the gradients
        # between the backward pass and the step.
        self.inner = _StrategyDistributedOptimizer(optimizer, unique, strategy=strategy, overlap=False)
        super().__init__(world, optimizer, named, passes)

    @property
    def variables(self) -> dict:
        """``{name: Variable}`` of the parameters (``stratagem.torch.DistributedOptimizer.variables``)."""
        return self.inner.variables

    def _announce(self) -> int:
        """Under mirrored: tell joined ranks that a step's all-reduce comes; the ranks taking part."""
        if not self.mirrored:
            return self.world.size
        return self.world.step_round(self._ident, [self._layout(), self.op])

    def _scale(self, grads: list, active: int) -> None:
        # mirrored averages over every replica: a sum is that times the replicas, and an average over
        # the ranks that have not joined is that times size / active.
        factor = self.world.size / (1 if self.op == "sum" else active)
        if factor != 1:
            with torch.no_grad():
                for grad in grads:
                    grad.mul_(factor)

    def _synchronize(self) -> None:
        if not self.mirrored:
            raise ConfigurationError(
                "synchronize() under 'between_graph': the ps tasks reduce and apply the gradients in one "
                "step(); call step() (clip each replica's gradients before it if you must)"
            )
        grads = self._dense_grads(zero=False)
        self._scale(grads, self._announce())
        pairs = [(as_array(param.grad), variable_of(param)) for _, param in self._named]
        reduced = self.strategy.reduce_gradients(pairs)
        with torch.no_grad():
            for (_, param), grad in zip(self._named, reduced):
                param.grad.copy_(as_tensor(grad))

    def _reduce_and_apply(self, closure):
        grads = self._dense_grads(zero=False)
        self._scale(grads, self._announce())
        return self.inner.step(closure)

    def _apply(self, closure):
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def _follow(self, active: int) -> None:
        self._dense_grads(zero=True)
        self.inner.step()

    def __repr__(self) -> str:
        return f"hvd.DistributedOptimizer({self.inner!r}, op={self.op})"
