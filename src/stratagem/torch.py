"""PyTorch on a stratagem strategy: parameters as Variables (no copies), ``DistributedOptimizer``,
``broadcast_parameters``, checkpoints as ``state_dict``.

Importing this module imports torch (``import stratagem`` does not). The parts:

- :func:`wrap_module` makes every parameter of an ``nn.Module`` a view of a stratagem Variable named by
  its ``state_dict`` key (CPU: ``torch.from_numpy`` of the variable's buffer; GPU: DLPack to cupy), so
  the module always computes with the strategy's current values and nothing is copied per step.
- :class:`DistributedOptimizer` wraps any ``torch.optim`` optimizer. Under ``mirrored`` its ``step()``
  all-reduces the gradients (weighted by each replica's share of the batch) and runs the torch
  optimizer's own rule, so Adam is torch's Adam; under ``between_graph`` the rule runs on the ps
  tasks, translated to torch's exact equations (SGD, Adam, AdamW, Adagrad). (Under
  ``parameter_server`` the coordinator's steps run on the workers: it is refused, with the way to
  train there: the Variables and ``stratagem.optimizers.TorchAdam`` & co. passed to the step.)
- Under ``mirrored`` with several replicas ``DistributedOptimizer`` reduces as PyTorch's DDP does:
  buckets of gradients all-reduced while the backward pass runs, ``no_sync()``,
  ``find_unused_parameters``, ``on_reduced_gradients`` (clip the reduced gradients).
- :func:`convert_sync_batchnorm` makes a module's BatchNorm layers :class:`SyncBatchNorm`: batch
  statistics (and their gradients) over the replicas' global batch.
- :func:`broadcast_parameters` copies one replica's tensors (a module's ``state_dict``, buffers
  included) into every other replica's, in place.
- Checkpoints: ``strategy.save(dir)`` / ``strategy.restore(dir)`` keep the parameters and the torch
  optimizer's state; :func:`module_state_dict` reads a checkpoint back as a torch ``state_dict``.

Alone, a world of one (the same script runs under ``stratagem launch --worker 4``)::

    >>> import torch, stratagem, stratagem.torch
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Linear(3, 1)
    >>> strategy = stratagem.strategy("mirrored")
    >>> opt = stratagem.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
    ...                                            model.named_parameters(), strategy=strategy)
    >>> sorted(opt.variables)
    ['bias', 'weight']
    >>> x, y = torch.ones(4, 3), torch.zeros(4, 1)
    >>> for _ in range(3):
    ...     loss = ((model(x) - y) ** 2).mean()
    ...     loss.backward(); opt.step(); opt.zero_grad()
    >>> bool(torch.equal(model.bias.detach(), torch.from_numpy(opt.variables["bias"].numpy())))
    True
    >>> strategy.shutdown()

Under ``mirrored`` the wrapper creates the variables in the strategy's ``scope()``, so every replica
starts from the chief's initial values; feed each replica its rows with ``strategy.distribute_dataset``
so that the gradient mean weighs replicas by their rows (N replicas then make exactly the update of
one process on the whole batch). With several replicas a parameter with no gradient at a step is an
error naming it, unless ``find_unused_parameters=True`` (then it counts as zeros, and one that no
replica used keeps ``grad=None``); in a world of one and under ``between_graph`` such gradients are
left out.
"""

from __future__ import annotations

import torch as _torch  # noqa: F401 - this module needs torch: fail here, with torch's ImportError

from stratagem.adapters.torch_optim import DistributedOptimizer, ps_rule_config
from stratagem.adapters.torch_params import broadcast_parameters, variable_of, wrap_module, wrap_parameters
from stratagem.adapters.torch_state import TorchOptimizerState, module_state_dict
from stratagem.adapters.torch_syncbn import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["wrap_module", "wrap_parameters", "variable_of", "DistributedOptimizer", "broadcast_parameters",
           "module_state_dict", "TorchOptimizerState", "ps_rule_config", "SyncBatchNorm", "convert_sync_batchnorm"]
