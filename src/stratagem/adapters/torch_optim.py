"""``DistributedOptimizer``: any ``torch.optim`` optimizer, its gradients reduced by the strategy.

Under ``mirrored`` (and a world of one), ``step()`` all-reduces the parameters' gradients through the
strategy (``strategy.reduce_gradients``: the weighted mean over the replicas, each weighted by its
share of the global batch), writes them back into ``param.grad`` and calls the torch optimizer's own
``step()``: every ``torch.optim`` rule works, unchanged, and N replicas make the update one process
makes on the whole batch. The parameters are views of the strategy's variables, so the update lands
in them.

With more than one ``mirrored`` replica the reduction is DDP's: buckets all-reduced by a background
thread while the backward pass runs (:mod:`stratagem.adapters.torch_overlap`), ``no_sync()`` for
gradient accumulation, ``find_unused_parameters``, and ``on_reduced_gradients`` (clip the reduced
gradients) before the torch step.

Under ``between_graph`` the update runs on the ps tasks, which have no torch:
the torch optimizer is translated into the stratagem rule with torch's exact equations
(:mod:`stratagem.training.optimizers.torch_rules`) — ``torch.optim.SGD`` (momentum, dampening, Nesterov, weight
decay, maximize), ``Adam`` and ``AdamW`` (weight decay, amsgrad, maximize) and ``Adagrad`` (lr decay,
weight decay, initial accumulator) — and ``step()`` pushes the gradients; the new values come back
into the parameters' buffers. Other optimizers are refused there with the list of supported ones.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from stratagem.core.errors import ConfigurationError
from stratagem.adapters.torch_params import variable_of, wrap_parameters
from stratagem.training.variables import resolve_strategy
from stratagem.adapters.torch_state import TorchOptimizerState
from stratagem.adapters.torch_tensors import as_array, as_tensor
from stratagem.adapters.torch_overlap import GradientReducer

#: What runs on the ps tasks: torch optimizer class name -> the rule's name.
PS_RULES = {"SGD": "TorchSGD", "Adam": "TorchAdam", "AdamW": "TorchAdam", "Adagrad": "TorchAdagrad"}


def ps_rule_config(optimizer) -> dict[str, Any]:
    """The ``get_config()`` of the stratagem rule equal to ``optimizer`` (a ``torch.optim`` optimizer),
    or a ``ConfigurationError`` naming the supported optimizers and settings."""
    import torch

    cls = type(optimizer)
    supported = {torch.optim.SGD: "SGD", torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW",
                 torch.optim.Adagrad: "Adagrad"}
    kind = supported.get(cls)
    if kind is None:
        raise ConfigurationError(
            f"{cls.__module__}.{cls.__name__} cannot run on the ps tasks: under between_graph the "
            f"update runs there, and stratagem has torch's exact rules for "
            f"torch.optim.SGD, Adam, AdamW and Adagrad only. Use one of those, or the 'mirrored' strategy "
            f"(where any torch optimizer runs as it is)"
        )
    configs = [_group_config(kind, group) for group in optimizer.param_groups]
    if any(config != configs[0] for config in configs[1:]):
        raise ConfigurationError(
            f"the {kind} optimizer's parameter groups have different settings ({configs}); on the ps tasks "
            f"one rule updates every parameter: use one group (or the 'mirrored' strategy)"
        )
    return configs[0]


def _group_config(kind: str, group: dict) -> dict[str, Any]:
    def number(key):
        value = group[key]
        return float(value.item() if hasattr(value, "item") else value)

    if group.get("differentiable"):
        raise ConfigurationError(f"{kind}(differentiable=True) cannot run on the ps tasks")
    if kind == "SGD":
        return {"name": "TorchSGD", "learning_rate": number("lr"), "momentum": number("momentum"),
                "dampening": number("dampening"), "weight_decay": number("weight_decay"),
                "nesterov": bool(group["nesterov"]), "maximize": bool(group.get("maximize", False))}
    if kind in ("Adam", "AdamW"):
        beta_1, beta_2 = (float(b.item() if hasattr(b, "item") else b) for b in group["betas"])
        return {"name": "TorchAdam", "learning_rate": number("lr"), "beta_1": beta_1, "beta_2": beta_2,
                "epsilon": number("eps"), "weight_decay": number("weight_decay"), "amsgrad": bool(group["amsgrad"]),
                "decoupled_weight_decay": bool(group.get("decoupled_weight_decay", kind == "AdamW")),
                "maximize": bool(group.get("maximize", False))}
    return {"name": "TorchAdagrad", "learning_rate": number("lr"), "lr_decay": number("lr_decay"),
            "weight_decay": number("weight_decay"), "initial_accumulator_value": number("initial_accumulator_value"),
            "epsilon": number("eps"), "maximize": bool(group.get("maximize", False))}


class DistributedOptimizer:
    """Wrap a ``torch.optim`` optimizer so that ``step()`` synchronises the replicas (see the module doc).

    Args:
        optimizer: any ``torch.optim`` optimizer (under parameter servers: SGD, Adam, AdamW, Adagrad).
        named_parameters: ``module.named_parameters()`` (Horovod's argument): names the parameters, and
            so the variables and checkpoint entries. Parameters already wrapped by
            :func:`~stratagem.adapters.torch_params.wrap_module` keep their variables; others are
            wrapped here. Without it, parameters must have been wrapped, or get positional names
            (``param.0``, ... in ``param_groups`` order).
        strategy: the strategy (default: the one whose ``scope()`` is active).
        overlap: under ``mirrored`` with several replicas, all-reduce buckets of gradients while the
            backward pass runs (default True, as DDP); False: all of them in ``step()``.
        bucket_bytes: the size of a bucket of gradients, in bytes (default: the strategy's
            ``bucket_bytes``, 25 MiB): a bucket is closed once it holds at least this many, as
            DDP's ``bucket_cap_mb``.
        find_unused_parameters: a parameter that got no gradient in a step counts as zeros in the
            reduction (one that no replica used keeps ``grad=None``); without it (default), such a
            parameter is an error naming it (DDP's option).
        on_reduced_gradients: ``fn(params)``, called in ``step()`` with the parameters that have a
            gradient, after the reduction and before the torch optimizer's step: the place to clip
            (``lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0)``). Every replica sees the same
            gradients there. Not under ``between_graph`` (the ps tasks update).

    Use it as the torch optimizer: ``loss.backward(); opt.step(); opt.zero_grad()``. Every replica
    calls ``step()`` with gradients for the same parameters. Other attributes (``param_groups``,
    ``state``, ``state_dict()``...) are the torch optimizer's. Checkpoints: ``strategy.save(dir)`` /
    ``strategy.restore(dir)`` keep the parameters and this optimizer's state (see
    :mod:`stratagem.adapters.torch_state`).
    """

    def __init__(self, optimizer, named_parameters=None, *, strategy=None, overlap: bool = True,
                 bucket_bytes: int | None = None, find_unused_parameters: bool = False,
                 on_reduced_gradients: Callable | None = None):
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationError(
                f"DistributedOptimizer wraps a torch.optim optimizer, not {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.strategy = strategy = resolve_strategy(strategy, "DistributedOptimizer")
        if strategy.name == "parameter_server":
            # The coordinator schedules step functions onto workers, and what they take travels by
            # reference (the strategy's variables and optimizer) or by value (arrays): a torch module
            # and this wrapper cannot follow them there.
            raise ConfigurationError(
                "DistributedOptimizer runs where the training loop runs: under 'mirrored' and "
                "'between_graph'. Under 'parameter_server' the coordinator's steps run on the workers: "
                "pass the Variables and a stratagem optimizer to the step (stratagem.optimizers.TorchAdam, "
                "TorchSGD, TorchAdagrad are torch's rules) and view them there with torch.from_numpy"
            )
        from stratagem.strategies.ps.base import PSStrategyBase   # the parameter-server strategies

        self.on_parameter_servers = isinstance(strategy, PSStrategyBase)
        _check_options(overlap, bucket_bytes, find_unused_parameters, on_reduced_gradients)
        if on_reduced_gradients is not None and self.on_parameter_servers:
            raise ConfigurationError(
                f"on_reduced_gradients cannot run under {strategy.name!r}: the gradients are reduced and "
                f"applied on the ps tasks, so there are no reduced gradients here to clip; use 'mirrored'"
            )
        self.on_reduced_gradients = on_reduced_gradients
        if self.on_parameter_servers:
            self._rule_config = ps_rule_config(optimizer)   # refused before any variable is made
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = {id(p): name for name, p in (named_parameters or ())}
        if len({id(p) for p in params}) != len(params):
            raise ConfigurationError("a parameter appears twice in the optimizer's param_groups")
        to_wrap, named = [], []
        for index, param in enumerate(params):
            var = variable_of(param)
            name = var.name if var is not None else names.get(id(param), f"param.{index}")
            named.append((name, param))
            if var is None:
                to_wrap.append((name, param))
        if to_wrap:
            wrap_parameters(to_wrap, strategy)
        self._pairs = [(param, variable_of(param)) for _, param in named]
        self._rule = None
        self._state = None
        if self.on_parameter_servers:
            from stratagem.training.optimizers.rules import from_config

            with strategy.scope():
                self._rule = from_config(self._rule_config)
        else:
            self._state = TorchOptimizerState(optimizer, named)
            strategy.on_optimizer(self._state)   # strategy.save/restore keep its state
        self._reducer = None
        if _reduces_like_ddp(strategy):
            self._reducer = GradientReducer(
                named, strategy, overlap=overlap, find_unused_parameters=find_unused_parameters,
                bucket_bytes=bucket_bytes if bucket_bytes is not None else strategy.config["bucket_bytes"])
        self._synchronized: list | None = None

    @property
    def variables(self) -> dict:
        """``{name: Variable}`` of the parameters this optimizer updates."""
        return {var.name: var for _, var in self._pairs}

    def step(self, closure=None):
        """Reduce the gradients through the strategy and update the parameters (see the class doc).
        ``closure`` (re-evaluates the model, returns the loss) is called first, as in torch."""
        import torch

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._reducer is not None and self._reducer.in_no_sync:
            raise ConfigurationError("DistributedOptimizer.step() inside no_sync(): the gradients accumulated "
                                     "there are reduced by the next backward pass outside it; step after that")
        if self._synchronized is None:
            self.synchronize()
        params, self._synchronized = self._synchronized, None
        if self.on_parameter_servers:
            self._push([(param, var) for param, var in self._pairs if param.grad is not None])
            return loss
        if self.on_reduced_gradients is not None:
            self.on_reduced_gradients(params)
        with self.strategy.recorder.span("optimizer", "optimizer", {"optimizer": type(self.optimizer).__name__}):
            self.optimizer.step()
        self._state.iterations += 1
        if self._reducer is not None:
            self.strategy.reduce_gradients([])      # counts the step (for save), as the other path does
        return loss

    def synchronize(self) -> list:
        """Reduce the gradients now (wait for the buckets in flight) and write them into ``param.grad``;
        return the parameters that have a gradient. ``step()`` calls it unless it was called since the
        last step (Horovod's ``synchronize()``: clip in between, then ``step()``). Under
        ``between_graph`` it only checks the gradients: the ps tasks reduce them in ``step()``."""
        import torch

        if self._reducer is not None:
            if not self._reducer.has_gradients():
                raise _no_gradient()
            self._synchronized = self._reducer.synchronize()
            return list(self._synchronized)
        present = [(param, var) for param, var in self._pairs if param.grad is not None]
        if not present:
            raise _no_gradient()
        for param, var in present:
            if param.grad.is_sparse:
                raise ConfigurationError(f"parameter {var.name!r} has a sparse gradient; stratagem.torch "
                                         f"reduces dense gradients only (use a dense embedding)")
        if not self.on_parameter_servers:
            reduced = self.strategy.reduce_gradients([(as_array(param.grad), var) for param, var in present])
            with torch.no_grad():
                for (param, _), grad in zip(present, reduced):
                    param.grad.copy_(as_tensor(grad))
        self._synchronized = [param for param, _ in present]
        return list(self._synchronized)

    def no_sync(self):
        """A context manager (DDP's ``model.no_sync()``): backward passes inside it accumulate the
        gradients locally, with no communication; the next backward pass outside it (then ``step()``)
        reduces the accumulated sum. Where the reduction happens in ``step()`` anyway (a world of one,
        ``between_graph``, ``overlap=False``) accumulating needs nothing, and it does nothing."""
        if self._reducer is not None:
            return self._reducer.no_sync()
        return contextlib.nullcontext()

    @property
    def bucket_members(self) -> list[list[str]] | None:
        """The parameters' names bucket by bucket, in the order the buckets are all-reduced (rebuilt
        after the first step from the order the chief's gradients arrived); None where ``step()``
        reduces through the strategy instead."""
        return None if self._reducer is None else self._reducer.bucket_members

    def _push(self, present) -> None:
        config = ps_rule_config(self.optimizer)
        if config != self._rule_config:
            raise ConfigurationError(
                f"the torch optimizer's settings changed ({self._rule_config} -> {config}); under "
                f"{self.strategy.name!r} the ps tasks run the settings first sent (no learning-rate schedules)"
            )
        self._rule.apply_gradients([(as_array(param.grad), var) for param, var in present])
        for _, var in self._pairs:
            var.value   # noqa: B018 - a read refreshes this task's copy (the parameter's buffer) if stale

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The torch optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str):
        # param_groups, state, state_dict, load_state_dict, add_param_group...: the torch optimizer's.
        if name in ("optimizer", "__setstate__", "_reducer", "_synchronized", "on_reduced_gradients"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        where = "on the ps tasks" if self.on_parameter_servers else "all-reduced"
        return f"DistributedOptimizer({type(self.optimizer).__name__}, {len(self._pairs)} parameters, {where})"


def _no_gradient() -> ConfigurationError:
    return ConfigurationError("DistributedOptimizer.step(): no parameter has a gradient; call loss.backward() first")


def _reduces_like_ddp(strategy) -> bool:
    """Whether ``step()`` reduces through :class:`GradientReducer` (buckets, overlap): under ``mirrored``
    with several replicas, without compression (the strategy's compressors keep per-variable state),
    elastic training (the world changes under the strategy's own communicator) or the ``nccl``
    transport (one NCCL communicator per member set, shared with the strategy's collectives)."""
    return (strategy.name == "mirrored" and strategy.num_replicas_in_sync > 1
            and strategy.config.get("on_failure") == "raise" and strategy.compressor is None
            and strategy.transport_name != "nccl")


def _check_options(overlap, bucket_bytes, find_unused_parameters, on_reduced_gradients) -> None:
    for option, value in (("overlap", overlap), ("find_unused_parameters", find_unused_parameters)):
        if not isinstance(value, bool):
            raise ConfigurationError(f"DistributedOptimizer({option}=...) takes True or False, got {value!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 1):
        raise ConfigurationError(f"DistributedOptimizer(bucket_bytes=...) takes a number of bytes >= 1, "
                                 f"got {bucket_bytes!r} (DDP's bucket_cap_mb=25 is bucket_bytes=25 << 20)")
    if on_reduced_gradients is not None and not callable(on_reduced_gradients):
        raise ConfigurationError(f"on_reduced_gradients takes a function of the parameters, got "
                                 f"{type(on_reduced_gradients).__name__}")
